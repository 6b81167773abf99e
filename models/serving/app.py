"""The routes of `posttrain serve-model` (models/serving/model.py holds the model they serve).

`/v1/chat/completions` and `/v1/completions` (OpenAI's, with vLLM's extensions; `stream: true`
answers in server-sent events), `/v1/models`, vLLM's `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` when started with a LoRA folder, and `/health`. With an API key every
`/v1` route needs `Authorization: Bearer KEY` (401 otherwise), as vLLM's `--api-key`.

A request waits for its answer on the event loop while the engine thread decodes: past
`queue_timeout` without the engine having started it, it is dropped (503); past `request_timeout`
in all it leaves the batch (504); a client that hangs up is noticed within 0.1 s, and its rows
stop decoding.
"""


import asyncio
import hmac
import socket
import time
from pathlib import Path

from models.config import ModelConfig
from models.serving.model import ServedModel
from models.serving.batch import Job
from models.serving.limits import (
    BodyLimit,
    Limits,
    ServingError,
    add_error_handlers,
    error_body,
    error_response,
    server_config,
)
from models.serving.requests import ChatRequest, CompletionRequest
from models.serving.responses import envelope, sse, usage
from models.serving.stream import choice_streams, stream_chunks
from models.serving.weights import LoadAdapter, ReloadWeights, UnloadAdapter

POLL = 0.1  # seconds between checks of a waiting request's deadlines and connection


class ClientGone(Exception):
    """The client closed its connection before its answer."""


def wake_on(job: Job) -> asyncio.Event:
    """An event the engine thread sets when `job` starts, draws tokens (if streamed) or finishes."""
    loop = asyncio.get_running_loop()
    moved = asyncio.Event()
    job.notify = job.progress = lambda: loop.call_soon_threadsafe(moved.set)
    return moved


def overdue(served: ServedModel, job: Job, since: float) -> ServingError | None:
    """The 504 of a request past its deadline (the job abandoned), else None."""
    if time.monotonic() < since + served.limits.request_timeout:
        return None
    job.abandon()
    return ServingError(504, f"the request did not finish within {served.limits.request_timeout:g} s", "server_error")


async def waited(served: ServedModel, job: Job, request, since: float, moved: asyncio.Event,
                 until_started: bool = False) -> Job:
    """`job` once the engine has decoded it (or started it); refused past its deadlines, dropped when
    the client goes."""
    limits = served.limits
    while not (job.finished.is_set() or (until_started and job.started.is_set())):
        moved.clear()
        now = time.monotonic()
        if not job.started.is_set() and now >= since + limits.queue_timeout and job.abandon():
            raise ServingError(503, f"the server is busy: this request waited {limits.queue_timeout:g} s for the "
                                    "requests ahead of it; try again later", "server_error")
        if (late := overdue(served, job, since)) is not None:
            raise late
        if await request.is_disconnected():
            job.abandon()
            raise ClientGone
        try:
            await asyncio.wait_for(moved.wait(), POLL)
        except TimeoutError:
            pass
    if job.error is not None:
        raise job.error
    return job


async def events(served: ServedModel, request, job: Job, prompt_tokens: int, since: float, moved: asyncio.Event):
    """The server-sent events of a streamed job, as the engine draws its tokens (models/serving/stream.py)."""
    chat = isinstance(request, ChatRequest)
    head = {key: value for key, value in envelope("chat" if chat else "text", request.model).items()
            if key != "object"}
    streams = choice_streams(request, job)
    try:
        if chat:
            for stream in streams:
                yield sse({**head, "object": "chat.completion.chunk", "choices": [{
                    "index": stream.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}]})
        while True:
            moved.clear()
            final = job.finished.is_set()
            if final and job.error is not None:
                yield sse(error_body(500, "the server failed on this request", "server_error"))
                break
            for chunk in stream_chunks(served, request, job, head, streams, final):
                yield sse(chunk)
            if final:
                if request.stream_options is not None and request.stream_options.include_usage:
                    yield sse({**head, "object": "chat.completion.chunk" if chat else "text_completion",
                               "choices": [], "usage": usage(prompt_tokens, served.choices(request, job))})
                break
            if (late := overdue(served, job, since)) is not None:
                yield sse(error_body(late.status, late.message, late.kind))
                break
            try:
                await asyncio.wait_for(moved.wait(), POLL)
            except TimeoutError:
                pass
        yield sse("[DONE]")
    finally:  # the client went away (the response was cancelled) or the deadline passed
        if not job.finished.is_set():
            job.abandon()


class ApiKey:
    """ASGI middleware: `/v1` routes need the server's API key as a bearer token."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + self.key):
                refusal = ServingError(401, "a valid API key is needed (Authorization: Bearer KEY)",
                                       "authentication_error")
                return await error_response(refusal)(scope, receive, send)
        return await self.app(scope, receive, send)


def make_app(folder: str | Path, model_name: str, model: ModelConfig | None = None, limits: Limits | None = None,
             *, lora_folder: str | Path | None = None, api_key: str | None = None, tool_parser=None):
    """The FastAPI app serving the checkpoint in `folder` as `model_name`, loaded with `model`
    (the spec's model config: dtype, LoRA base) when known, refusing what `limits` bounds;
    `app.state` holds both (server_config reads the limits)."""
    from fastapi import FastAPI, Request
    from starlette.responses import Response, StreamingResponse

    limits = limits or Limits()
    served = ServedModel(folder, model_name, model, limits, lora_folder, tool_parser)
    app = FastAPI(title=f"posttrain serve-model {model_name}")
    app.state.served, app.state.limits = served, limits
    app.add_middleware(BodyLimit, limits=limits)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)
    add_error_handlers(app)

    async def answered(request, http: Request, make_job, answer):
        since = time.monotonic()
        job, prompts = make_job(request)
        if request.stream:
            job.drawn = [[] for _ in job.prompts]
        moved = wake_on(job)
        served.batcher.submit(job)
        try:
            job = await waited(served, job, http, since, moved, until_started=request.stream)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        if not request.stream:
            return answer(request, job, prompts)
        prompt_tokens = len(prompts) if prompts and isinstance(prompts[0], int) else sum(map(len, prompts))
        return StreamingResponse(events(served, request, job, prompt_tokens, since, moved),
                                 media_type="text/event-stream")

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": served.cards()}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict:
        return served.card(served.adapter_of(name))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatRequest, http: Request):
        return await answered(request, http, served.chat_job, served.chat_answer)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, http: Request):
        return await answered(request, http, served.completion_job, served.completion_answer)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadAdapter):
        from starlette.concurrency import run_in_threadpool

        await run_in_threadpool(served.load_adapter, request)  # waits for the batch decoding now
        return Response(f"Success: LoRA adapter '{request.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadAdapter):
        from starlette.concurrency import run_in_threadpool

        await run_in_threadpool(served.unload_adapter, request.lora_name)
        return Response(f"Success: LoRA adapter '{request.lora_name}' removed successfully.", media_type="text/plain")

    @app.post("/v1/reload_weights")
    async def reload_weights(request: ReloadWeights):
        from starlette.concurrency import run_in_threadpool

        await run_in_threadpool(served.reload_weights, request)
        return {"weights_version": request.version}

    return app


class ListenError(Exception):
    """The server cannot listen on the host and port asked for (in use, not an address here)."""


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound, listening socket: bound before the model loads, so a taken port fails at once."""
    try:
        # IPPROTO_TCP named, so that asyncio sets TCP_NODELAY on each connection (it skips proto 0): without
        # it a keep-alive client's every request after the first waited ~40 ms (Nagle and delayed ACKs)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        raise ListenError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    return sock


def serve(folder: str | Path, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          model: ModelConfig | None = None, limits: Limits | None = None, *, lora_folder: str | Path | None = None,
          api_key: str | None = None, tool_parser=None) -> None:
    """Serve until interrupted. The line is printed once the socket listens, so a client that read
    it can connect; port 0 picks a free port (the line names it)."""
    import uvicorn

    sock = listening_socket(host, port)
    app = make_app(folder, model_name, model, limits, lora_folder=lora_folder, api_key=api_key, tool_parser=tool_parser)
    print(f"serving {model_name} on http://{host}:{sock.getsockname()[1]}/v1", flush=True)
    uvicorn.Server(server_config(app, app.state.limits)).run(sockets=[sock])
