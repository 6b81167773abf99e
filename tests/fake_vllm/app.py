"""The fake vLLM server's routes (FastAPI, as vLLM's), and running it on 127.0.0.1 for a test."""

import contextlib

from fake_vllm.protocol import VLLM_VERSION, VllmError
from fake_vllm.server import FakeVllm, FakeVllmConfig


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

    async def json_body(request: Request):
        try:
            return await request.json()
        except ValueError:
            raise VllmError(400, "Invalid JSON body", "Bad Request") from None

    @app.get("/version")
    async def version():
        return {"version": VLLM_VERSION}

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

    if config.runtime_lora:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request):
            body = await json_body(request)
            return PlainTextResponse(await run_in_threadpool(fake.load_adapter, body))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request):
            return PlainTextResponse(fake.unload_adapter(await json_body(request)))

    if config.dev_mode:
        @app.post("/pause")
        async def pause(mode: str = "abort"):
            try:
                return await run_in_threadpool(fake.pause, mode)
            except ValueError as exc:
                return JSONResponse({"error": str(exc)}, status_code=400)

        @app.post("/resume")
        async def resume():
            return fake.resume()

        @app.get("/is_paused")
        async def is_paused():
            return {"is_paused": fake.paused}

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache():
            fake.prefix_cache_resets += 1
            return Response(status_code=200)

        @app.post("/collective_rpc")
        async def collective_rpc(request: Request):
            body = await json_body(request)
            if "method" not in body:
                raise VllmError(400, "Missing 'method' in request body", "Bad Request")
            method = getattr(fake.worker, body["method"])
            result = await run_in_threadpool(method, *body.get("args", []), **body.get("kwargs", {}))
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
    with serving(uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")), port) as url:
        yield url, app.state.fake
