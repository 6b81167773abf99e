"""What `posttrain serve-model` refuses, and how it says so (models/serving/ is the server).

A request is read and checked whole before it waits for the engine. Its headers must all arrive
within `read_timeout` of the connection opening (or of its previous response), else the
connection is closed; a body needs a Content-Length, checked before a byte is read (411 without
one, 413 over `max_body_bytes`), and must arrive within `read_timeout` (408). The fields have
bounds (models/serving/requests.py: the constants below). Only then does it wait for the
engine, at most `queue_timeout` (503), and its answer comes within `request_timeout` of its
arrival or not at all (504; its rows leave the engine's batch). Every refusal is OpenAI's error shape:
{"error": {"message", "type", "param", "code"}}, never a traceback.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

MAX_MESSAGES = 512  # messages in one request
MAX_CONTENT_CHARS = 262_144  # characters in one message's content
MAX_TOOLS = 128  # tools in one chat request, calls in one message
MAX_STOP = 16  # stop strings in one request
MAX_STOP_CHARS = 256  # characters in one stop string
MAX_SEED = 2**63 - 1  # seeds are 0..MAX_SEED: the engine's torch generator takes a 64-bit seed
MAX_N = 64  # choices of one prompt
MAX_PROMPTS = 64  # prompts in one completions request
MAX_CHOICES = 256  # prompts × n in one request
MAX_PROMPT_IDS = 262_144  # ids in one token-id prompt (the model's context bounds it further)
MAX_LOGPROBS = 20  # alternatives reported per token (vLLM's default cap)
GREEDY_BELOW = 1e-5  # a temperature below this decodes greedily, as vLLM does (logits / 1e-300 overflow)
BODY_METHODS = {"POST", "PUT", "PATCH"}


@dataclass(frozen=True)
class Limits:
    """The server's configurable limits (`posttrain serve-model --max-body-bytes ...`)."""

    max_body_bytes: int = 1 << 20  # a request body's size
    read_timeout: float = 30.0  # seconds for a request's headers to arrive, and again for its body
    queue_timeout: float = 60.0  # seconds a validated request waits for the requests ahead of it
    max_connections: int = 256  # open connections and requests at once (a rollout client keeps 64); beyond: 503
    request_timeout: float = 600.0  # seconds a request may take in all, from arrival to its answer (504)
    batch_window: float = 0.01  # seconds an idle engine waits for more requests to decode with the first


class ServingError(Exception):
    """A request the server answers with an OpenAI-style error (status, message, type, param)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_body(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(exc: ServingError, close: bool = False):
    from starlette.responses import JSONResponse

    headers = {"connection": "close"} if close else None
    return JSONResponse(error_body(exc.status, exc.message, exc.kind, exc.param), exc.status, headers)


class BodyLimit:
    """ASGI middleware: a request's body is read here, whole and bounded, before the app sees it."""

    def __init__(self, app, limits: Limits):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            return await self.app(scope, receive, send)
        try:
            length = content_length(scope["headers"], self.limits.max_body_bytes)
            body = await asyncio.wait_for(read_body(receive, length), self.limits.read_timeout)
        except TimeoutError:
            refusal = ServingError(408, f"the request body did not arrive within {self.limits.read_timeout:g} s")
            return await error_response(refusal, close=True)(scope, receive, send)
        except ServingError as refusal:  # the unread body is left behind with the connection
            return await error_response(refusal, close=True)(scope, receive, send)
        return await self.app(scope, replay(body, receive), send)


def content_length(headers: list[tuple[bytes, bytes]], limit: int) -> int:
    """The body's declared size, refused before it is read: missing, chunked or over `limit`."""
    lengths = [value for name, value in headers if name == b"content-length"]
    if not lengths or any(name == b"transfer-encoding" for name, _ in headers):
        raise ServingError(411, "the request needs a Content-Length header (chunked bodies are not accepted)")
    if len(lengths) > 1 or not lengths[0].isdigit():
        raise ServingError(400, "the Content-Length header is not one byte count")
    length = int(lengths[0])
    if length > limit:
        raise ServingError(413, f"the request body is {length} bytes, more than this server's limit of {limit}")
    return length


async def read_body(receive, length: int) -> bytes:
    """The body, at most `length` bytes (HTTP framing already holds the client to its Content-Length)."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ServingError(400, "the client closed the connection before its body arrived")
        body += message.get("body", b"")
        if len(body) > length:
            raise ServingError(413, f"the request body is longer than its Content-Length of {length}")
        if not message.get("more_body", False):
            return bytes(body)


def replay(body: bytes, receive):
    """An ASGI `receive` that gives the body already read, then the connection's own messages."""
    given = False

    async def receive_again():
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive_again


def add_error_handlers(app) -> None:
    """Every error the app answers in OpenAI's shape: refusals, invalid fields, unknown routes, bugs."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    async def refused(request, exc: ServingError):
        return error_response(exc)

    async def invalid(request, exc: RequestValidationError):
        param, message = validation_message(exc.errors())
        return error_response(ServingError(400, message, param=param))

    async def http_error(request, exc: HTTPException):
        return error_response(ServingError(exc.status_code, str(exc.detail)))

    async def internal(request, exc: Exception):  # the traceback goes to the server's log only
        return error_response(ServingError(500, "the server failed on this request", "server_error"))

    for kind, handler in ((ServingError, refused), (RequestValidationError, invalid), (HTTPException, http_error),
                          (Exception, internal)):
        app.add_exception_handler(kind, handler)


def validation_message(errors) -> tuple[str | None, str]:
    """The first problem of a request body: (the field, `field: what is wrong` in one line)."""
    first = errors[0]
    if first["type"] == "json_invalid":
        return None, "the request body is not valid JSON"
    where = ".".join(str(part) for part in first["loc"] if part != "body")
    message = first["msg"].removeprefix("Value error, ")
    return where or None, f"{where}: {message}" if where else message


def server_config(app, limits: Limits, **kwargs):
    """uvicorn's config for `app`: h11 with a deadline for request headers (below)."""
    import uvicorn

    return uvicorn.Config(app, http=deadline_protocol(limits.read_timeout), log_level="warning",
                          limit_concurrency=limits.max_connections, **kwargs)


def deadline_protocol(seconds: float):
    """uvicorn's h11 protocol, which waits for a request's headers forever, with a deadline: a
    connection still short of a request's headers `seconds` after it opened (or after its last
    response) is closed. A malformed request's 400 is JSON like every other error."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class DeadlineH11Protocol(H11Protocol):
        deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def _arm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
            self.deadline = self.loop.call_later(seconds, self._expire)

        def _expire(self) -> None:
            waiting_for_headers = self.cycle is None or self.cycle.response_complete
            if waiting_for_headers and not self.transport.is_closing():
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            body = json.dumps(error_body(400, f"not a valid HTTP request ({msg})")).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return DeadlineH11Protocol
