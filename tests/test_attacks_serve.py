"""`posttrain serve-model` under attack: each request a hostile or broken client could send, sent to
the real server on 127.0.0.1, and the harmless answer it gets (models/serving/limits.py): a JSON
error in OpenAI's shape naming the field, a clamped budget, a dropped connection, a 503 in time;
never a 500, a traceback or a hang. Most go to the session's server (conftest.base_url); the
deadlines are tried on a second server of the same checkpoint with small ones."""

import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
from test_serve_model import NAME, running_app, trained_checkpoint

from models.serving.limits import MAX_CONTENT_CHARS, MAX_MESSAGES, MAX_STOP, Limits

TIGHT = Limits(read_timeout=1.0, queue_timeout=0.5)
HI = [{"role": "user", "content": "what is 2+3?"}]


@pytest.fixture(scope="module")
def tight():
    """The checkpoint behind a server with 1 s to read a request and 0.5 s to wait for the engine;
    yields (base URL, app)."""
    from models.serving.app import make_app

    app = make_app(trained_checkpoint(), NAME, limits=TIGHT)
    with running_app(app) as url:
        yield url, app


def post(base_url: str, body, timeout: float = 30) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{base_url}/chat/completions", content=content, timeout=timeout,
                      headers={"content-type": "application/json"})


def refused(response: httpx.Response, status: int, param: str | None, words: str) -> dict:
    """The response is OpenAI's error shape with this status, naming `param`, its message saying `words`."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert error["param"] == param and words in error["message"] and "Traceback" not in response.text
    return error


def ask(base_url: str, **fields) -> httpx.Response:
    return post(base_url, {"model": NAME, "messages": HI, "temperature": 0, "max_tokens": 8, **fields})


def raw(base_url: str) -> socket.socket:
    """A plain TCP connection to the server, for what no HTTP client sends."""
    address = urlsplit(base_url)
    return socket.create_connection((address.hostname, address.port), timeout=10)


def answer(sock: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of the response on `sock`, read until the server closes it."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_a_huge_max_tokens_is_clamped_to_the_context(base_url):
    from models.loading import load_tokenizer
    from models.sampling import chat_prompt
    from models.serving.requests import ChatRequest

    assert ChatRequest(model=NAME, messages=HI, max_tokens=2**200).sampling(room=40).max_new_tokens == 40
    prompt = "1 " * 248
    room = 512 - len(chat_prompt(load_tokenizer(trained_checkpoint()), prompt))  # a few tokens of the model's 512 left
    assert 0 < room < 20
    for field, huge in (("max_tokens", 10**12), ("max_completion_tokens", 2**70)):
        response = post(base_url, {"model": NAME, "messages": [{"role": "user", "content": prompt}],
                                   "temperature": 1.0, field: huge, "seed": 1}).json()
        assert response["usage"]["completion_tokens"] <= room and response["usage"]["total_tokens"] <= 512


def test_a_prompt_longer_than_the_context_is_refused(base_url):
    too_long = post(base_url, {"model": NAME, "messages": [{"role": "user", "content": "1 " * 600}]})
    refused(too_long, 400, "messages", "the model's context is 512")


def test_a_body_over_the_limit_is_refused_before_it_is_read(base_url):
    with raw(base_url) as sock:  # the headers alone: the server answers without waiting for the body
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 4294967296\r\n\r\n{\"model\":")
        status, body = answer(sock)
    assert status == 413 and "4294967296 bytes, more than this server's limit of 1048576" in body["error"]["message"]
    with raw(base_url) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        status, body = answer(sock)
    assert status == 411 and "Content-Length" in body["error"]["message"]
    with raw(base_url) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n")
        status, body = answer(sock)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def test_too_many_or_too_long_messages_and_stop_strings_are_refused(base_url):
    refused(ask(base_url, messages=HI * (MAX_MESSAGES + 1)), 400, "messages", f"at most {MAX_MESSAGES} items")
    refused(ask(base_url, messages=[{"role": "user", "content": "x" * (MAX_CONTENT_CHARS + 1)}]), 400,
            "messages.0.content", f"at most {MAX_CONTENT_CHARS} characters")
    refused(ask(base_url, stop=["</a>"] * (MAX_STOP + 1)), 400, "stop", f"at most {MAX_STOP} stop strings")
    refused(ask(base_url, stop="x" * 1000), 400, "stop", "at most 256 characters")
    assert ask(base_url, stop=["</a>"] * MAX_STOP).status_code == 200


def test_seeds_out_of_range_or_not_integers_are_refused(base_url):
    for seed in (2**64, 2**63, -1, 1.5, "seven", [1]):
        refused(ask(base_url, seed=seed, temperature=1.0), 400, "seed", "seed: ")
    assert ask(base_url, seed=2**63 - 1, temperature=1.0).status_code == 200


def test_temperature_and_top_p_out_of_range_are_refused_and_a_tiny_temperature_is_greedy(base_url):
    greedy = ask(base_url).json()["choices"][0]["message"]["content"]
    for tiny in (1e-300, 5e-324, 1e-6):
        assert ask(base_url, temperature=tiny).json()["choices"][0]["message"]["content"] == greedy
    for temperature in (-0.1, -1e-300, 2.5, 1e308):
        refused(ask(base_url, temperature=temperature), 400, "temperature", "temperature: ")
    for top_p in (0, -1, 1.5):
        refused(ask(base_url, temperature=1.0, top_p=top_p), 400, "top_p", "top_p: ")
    body = json.dumps({"model": NAME, "messages": HI, "max_tokens": 8})[:-1]
    for field in ("temperature", "top_p"):
        for value in ("NaN", "Infinity", "1e999"):  # Python's JSON reads these as floats
            refused(post(base_url, f'{body}, "{field}": {value}}}'), 400, field, f"{field}: ")


def test_every_error_is_openais_json_shape(base_url):
    refused(post(base_url, b"{not json"), 400, None, "not valid JSON")
    refused(ask(base_url, model="gpt-nothing"), 404, "model", "`gpt-nothing` does not exist")
    refused(httpx.get(f"{base_url}/no/such/route"), 404, None, "Not Found")
    refused(httpx.get(f"{base_url}/chat/completions"), 405, None, "Method Not Allowed")
    refused(ask(base_url, n=1000), 400, "n", "n: ")
    refused(ask(base_url, messages=[{"role": "narrator", "content": "x"}]), 400, "messages.0.role", "")


def completes_promptly(base_url: str, within: float = 20) -> None:
    started = time.monotonic()
    assert ask(base_url).status_code == 200
    assert time.monotonic() - started < within


def closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


def test_a_client_that_stalls_in_its_headers_is_dropped_and_holds_nothing(tight):
    base_url, _ = tight
    with raw(base_url) as stalled, raw(base_url) as dripping:
        started = time.monotonic()
        for sock in (stalled, dripping):
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        completes_promptly(base_url)
        for _ in range(8):  # a header byte now and then does not keep a connection open
            try:
                dripping.sendall(b"X")
            except OSError:
                break
            time.sleep(0.25)
        assert closed_by_server(stalled, 5) and closed_by_server(dripping, 5)
        assert time.monotonic() - started < TIGHT.read_timeout + 5


def test_a_client_that_never_sends_its_body_gets_408_and_holds_nothing(tight):
    base_url, _ = tight
    with raw(base_url) as stalled:
        stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 100\r\n\r\n{\"model\":")
        started = time.monotonic()
        completes_promptly(base_url)
        status, body = answer(stalled)
    assert status == 408 and "did not arrive within 1 s" in body["error"]["message"]
    assert time.monotonic() - started < TIGHT.read_timeout + 5


def test_a_request_that_waits_for_the_engine_past_the_deadline_gets_503(tight):
    base_url, app = tight
    lock = app.state.served.batcher.engine
    with lock:  # a request ahead of this one that takes forever
        started = time.monotonic()
        refused(ask(base_url), 503, None, "waited 0.5 s for the requests ahead of it")
        assert time.monotonic() - started < TIGHT.queue_timeout + 5
    completes_promptly(base_url)
    ahead = threading.Thread(target=hold, args=(lock, 0.1))
    ahead.start()
    completes_promptly(base_url)  # a short wait is no refusal
    ahead.join()


def hold(lock: threading.Lock, seconds: float) -> None:
    with lock:
        time.sleep(seconds)


def test_connections_past_the_cap_get_503_and_the_cap_frees_with_them():
    """Many idle connections (each of which may be a 1 MiB body in waiting) are capped: past
    `max_connections` a request is turned away at once, and the server serves again when they go."""
    from models.serving.app import make_app

    limits = Limits(read_timeout=1.0, queue_timeout=0.5, max_connections=2)
    with running_app(make_app(trained_checkpoint(), NAME, limits=limits)) as base_url:
        with raw(base_url) as first, raw(base_url) as second:
            for sock in (first, second):
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            time.sleep(0.2)
            assert ask(base_url).status_code == 503
        time.sleep(limits.read_timeout + 1)
        completes_promptly(base_url)


def test_a_request_past_its_deadline_gets_504_and_a_gone_client_is_never_decoded():
    from models.serving.app import make_app

    limits = Limits(read_timeout=5.0, queue_timeout=60.0, request_timeout=0.5)
    app = make_app(trained_checkpoint(), NAME, limits=limits)
    batcher = app.state.served.batcher
    with running_app(app) as base_url:
        with batcher.engine:  # a batch ahead of these that takes long
            started = time.monotonic()
            refused(ask(base_url), 504, None, "did not finish within 0.5 s")
            assert time.monotonic() - started < limits.request_timeout + 5
            body = json.dumps({"model": NAME, "messages": HI, "max_tokens": 8}).encode()
            with raw(base_url) as gone:
                gone.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                deadline = time.monotonic() + 10
                while batcher.queued() < 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert batcher.queued() == 2
            time.sleep(0.5)  # the server notices the hang-up within a poll
            decoded = len(batcher.batches)
        completes_promptly(base_url)
        assert batcher.dropped == 2  # neither the late request nor the gone one was decoded
        assert len(batcher.batches) == decoded + 1
