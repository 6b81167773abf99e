"""The fake vLLM server's routes (FastAPI, as vLLM's), and running it on 127.0.0.1 for a test."""

import contextlib

from fake_vllm.protocol import VllmError
from fake_vllm.server import PAUSE_SINCE, EngineDead, FakeVllm, FakeVllmConfig


def make_app(config: FakeVllmConfig):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response
    from starlette.concurrency import run_in_threadpool

    fake = FakeVllm(config)
    app = FastAPI()
    app.state.fake = fake

    @app.exception_handler(VllmError)
    async def vllm_error(request, exc: VllmError):
        return JSONResponse(exc.body(), status_code=exc.code)

    @app.exception_handler(EngineDead)
    async def engine_dead(request, exc: EngineDead):
        fake.on_engine_death()  # vLLM's launcher: terminate_if_errored, then a bare 500
        return Response(status_code=500)

    async def json_body(request: Request):
        try:
            return await request.json()
        except ValueError:
            raise VllmError(400, "Invalid JSON body", "Bad Request") from None

    @app.get("/version")
    async def version():
        return {"version": config.version}

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return fake.cards()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await json_body(request)
        return await run_in_threadpool(fake.complete, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await json_body(request)
        return await run_in_threadpool(fake.chat, body)

    if config.runtime_lora:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request):
            body = await json_body(request)
            return PlainTextResponse(await run_in_threadpool(fake.load_adapter, body))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request):
            return PlainTextResponse(fake.unload_adapter(await json_body(request)))

    if config.dev_mode and config.at_least(PAUSE_SINCE):
        @app.post("/pause")
        async def pause(mode: str = "abort", wait_for_inflight_requests: bool = False):
            try:
                return await run_in_threadpool(fake.pause, fake.pause_mode(mode, wait_for_inflight_requests))
            except ValueError as exc:
                return JSONResponse({"error": str(exc)}, status_code=400)

        @app.post("/resume")
        async def resume():
            return fake.resume()

        @app.get("/is_paused")
        async def is_paused():
            return {"is_paused": fake.paused}

    if config.dev_mode:
        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache():
            fake.prefix_cache_resets += 1
            return Response(status_code=200)

        @app.post("/collective_rpc")
        async def collective_rpc(request: Request):
            body = await json_body(request)
            if "method" not in body:
                raise VllmError(400, "Missing 'method' in request body", "Bad Request")
            try:
                method = getattr(fake.worker, body["method"])
                result = await run_in_threadpool(method, *body.get("args", []), **body.get("kwargs", {}))
            except Exception as exc:  # vLLM's exception handler: an ErrorResponse with the message
                raise VllmError(500, str(exc), "InternalServerError") from None
            if result is None:
                return Response(status_code=200)
            return {"results": [result if isinstance(result, (dict, list)) else str(result)]}

    return app


@contextlib.contextmanager
def running_fake(config: FakeVllmConfig):
    """The fake on a free port of 127.0.0.1 in a background thread; yields (base URL ending in /v1, FakeVllm)."""
    import uvicorn
    from conftest import free_port, serving

    app = make_app(config)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    app.state.fake.on_engine_death = lambda: setattr(server, "should_exit", True)
    with serving(server, port) as url:
        yield url, app.state.fake
