"""A flaky S3 endpoint for tests: an HTTP proxy on 127.0.0.1 in front of a real S3 API (moto's server).

`FlakyS3Proxy(upstream)` listens on a free port of 127.0.0.1 (a `ThreadingHTTPServer`, one thread per
connection, HTTP/1.1 keep-alive as S3 clients expect). It reads each request whole (request line,
headers, body exactly as sent: Content-Length bytes or the raw chunked framing) and forwards it byte
for byte, on a new connection, to the upstream (moto checks no signature, and the Host header is passed
unchanged); the upstream's status, headers and body come back to the client (a chunked body re-framed
with Content-Length).

Faults are told to it with `inject(Fault(...), ...)` and chosen per request: the first fault whose
method and path pattern (a regex searched in the URL path, `/<bucket>/<key>`, no query) match and
whose budget is not spent decides. A fault's budget is `times` matching requests of each path
(`per_path`, the default: "the first K PUTs of each object key") or of all paths, or every matching
request for `seconds` after `inject` (a window), or both. Its action:

- `SLOW_DOWN`: answer 503 with S3's XML error body (`code`: SlowDown or ServiceUnavailable) without
  forwarding: nothing is stored;
- `HOLD`: forward nothing, answer nothing for `hold_s` seconds (past the client's read timeout), close;
- `HOLD_AFTER_FORWARD`: forward the request (the upstream applies it: the object is stored), then
  answer nothing for `hold_s` seconds and close the connection: the client times out on a write that
  happened, as a real endpoint does when a response is lost.

`log` holds (method, path, what was done) for every request since the last `inject` (or `clear`),
for tests to assert that faults hit.
"""

from __future__ import annotations

import http.client
import re
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOW_DOWN = "503"
HOLD = "hold"
HOLD_AFTER_FORWARD = "hold after forward"
MESSAGES = {"SlowDown": "Please reduce your request rate.",
            "ServiceUnavailable": "Service is unable to handle request."}
HOP_BY_HOP = {"transfer-encoding", "connection", "keep-alive", "content-length"}


@dataclass
class Fault:
    action: str
    method: str = "PUT"
    path: str = ""  # regex searched in the URL path
    times: int | None = None  # None: every matching request (within the window, if any)
    per_path: bool = True
    seconds: float | None = None  # a window from `inject`
    code: str = "SlowDown"
    hold_s: float = 5.0
    counts: Counter = field(default_factory=Counter)
    deadline: float | None = None

    def takes(self, method: str, path: str) -> bool:
        """Whether this request is one of the fault's (counting it if so); the caller holds the lock."""
        if method != self.method or not re.search(self.path, path):
            return False
        if self.deadline is not None and time.monotonic() > self.deadline:
            return False
        counted = path if self.per_path else ""
        if self.times is not None and self.counts[counted] >= self.times:
            return False
        self.counts[counted] += 1
        return True


class FlakyS3Proxy:
    def __init__(self, upstream: str):
        self.upstream = urlsplit(upstream)
        self.faults: list[Fault] = []
        self.log: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="flaky-s3")

    def __enter__(self) -> "FlakyS3Proxy":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def inject(self, *faults: Fault) -> None:
        with self.lock:
            for fault in faults:
                fault.deadline = None if fault.seconds is None else time.monotonic() + fault.seconds
            self.faults = list(faults)
            self.log = []

    def clear(self) -> None:
        self.inject()

    def fault_for(self, method: str, path: str) -> Fault | None:
        with self.lock:
            return next((fault for fault in self.faults if fault.takes(method, path)), None)

    def record(self, method: str, path: str, what: str) -> None:
        with self.lock:
            self.log.append((method, path, what))

    def done(self, action: str, path_pattern: str = "") -> list[str]:
        """The paths of the requests given `action` ("forwarded" for plain ones), in order."""
        with self.lock:
            return [path for _, path, what in self.log if what == action and re.search(path_pattern, path)]


def _handler_for(proxy: FlakyS3Proxy) -> type[BaseHTTPRequestHandler]:
    class Relay(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: the proxy keeps its own log
            pass

        def relay(self) -> None:
            body = self.raw_body()
            path = urlsplit(self.path).path
            fault = proxy.fault_for(self.command, path)
            action = fault.action if fault else "forwarded"
            proxy.record(self.command, path, action)
            if action == SLOW_DOWN:
                return self.slow_down(fault.code)
            if action == HOLD:
                return self.hold(fault.hold_s)
            status, reason, headers, answer = self.forward(body)
            if action == HOLD_AFTER_FORWARD:
                return self.hold(fault.hold_s)
            self.answer(status, reason, headers, answer)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = relay

        def raw_body(self) -> bytes:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                return self.raw_chunks()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def raw_chunks(self) -> bytes:
            """A chunked body with its framing and trailers, as sent."""
            raw = bytearray()
            while True:
                size_line = self.rfile.readline()
                raw += size_line
                size = int(size_line.split(b";")[0].strip(), 16)
                if size == 0:
                    break
                raw += self.rfile.read(size + 2)
            while True:  # trailers up to the empty line
                line = self.rfile.readline()
                raw += line
                if line in (b"\r\n", b"\n", b""):
                    return bytes(raw)

        def forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
            upstream = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
            try:
                upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    upstream.putheader(name, value)
                upstream.endheaders(body)
                response = upstream.getresponse()
                return response.status, response.reason, response.getheaders(), response.read()
            finally:
                upstream.close()

        def answer(self, status: int, reason: str, headers: list[tuple[str, str]], body: bytes) -> None:
            self.send_response_only(status, reason)
            for name, value in headers:
                if name.lower() not in HOP_BY_HOP:
                    self.send_header(name, value)
            if self.command == "HEAD":  # no body: the upstream's length describes the object
                length = dict((k.lower(), v) for k, v in headers).get("content-length", "0")
                self.send_header("Content-Length", length)
            else:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def slow_down(self, code: str) -> None:
            request_id = uuid.uuid4().hex[:16].upper()
            body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                    f"<Message>{MESSAGES[code]}</Message><RequestId>{request_id}</RequestId>"
                    f"<HostId>flaky-s3</HostId></Error>").encode()
            self.answer(503, "Slow Down", [("Content-Type", "application/xml"),
                                            ("x-amz-request-id", request_id)], body)

        def hold(self, seconds: float) -> None:
            time.sleep(seconds)
            self.close_connection = True

    return Relay
