"""`posttrain serve-model`: one checkpoint behind an OpenAI-compatible chat API (FastAPI + uvicorn).

A served checkpoint is a policy like any other (docs/DESIGN §7): a teacher for `synthesize`, a
model for an OpenAI client, or the endpoint a rollout plays through (tasks/common/endpoint_policy.py).
It decodes with the project's own engine, one request at a time, so a one-user-message request
gives exactly what in-process evaluation gives for that prompt. Besides OpenAI's parameters it
accepts vLLM's `add_generation_prompt`, `continue_final_message` (continue the final assistant
message: how a multi-turn context goes on after a tool's output) and `include_stop_str_in_output`.
What it refuses (sizes, bounds, deadlines) and how it says so: models/serving_limits.py.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from models.config import ModelConfig
from models.loading import ADAPTER_CONFIG, load_model, load_tokenizer
from models.sampling import Generation, SamplingParams, generate_tokens
from models.serving_limits import (
    GREEDY_BELOW,
    MAX_CONTENT_CHARS,
    MAX_MESSAGES,
    MAX_SEED,
    MAX_STOP,
    MAX_STOP_CHARS,
    BodyLimit,
    Limits,
    ServingError,
    add_error_handlers,
    server_config,
)

SENTINEL = "\x00posttrain-final-message\x00"  # stands for the final message's content while rendering


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=MAX_CONTENT_CHARS)

    @model_validator(mode="before")
    @classmethod
    def _plain(cls, message):
        """Newer clients' forms: a `developer` message is a system message, content may come as text parts."""
        if not isinstance(message, dict):
            return message
        message = {**message, "role": "system"} if message.get("role") == "developer" else message
        parts = message.get("content")
        if isinstance(parts, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in parts):
            message = {**message, "content": "".join(str(p.get("text", "")) for p in parts)}
        return message


class ChatRequest(BaseModel):
    """The chat-completion parameters the server honours; others a client sends are ignored.
    Each is bounded (models/serving_limits.py): a value out of range is a 400 naming the field,
    never reduced into range; a temperature below GREEDY_BELOW (1e-5) decodes greedily, and a
    token budget beyond the context window is clamped to it (`sampling`)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    temperature: float | None = Field(None, ge=0, le=2)  # absent: OpenAI's default 1; 0: greedy
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # vLLM extension; 0 or -1: off
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)  # absent: seed 0, so the server is deterministic
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    include_stop_str_in_output: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _bounded_stop(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, not {len(stops)}")
        if any(isinstance(s, str) and len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters")
        return stop

    @model_validator(mode="after")
    def _consistent(self):
        if self.stream:
            raise ValueError("stream: streaming is not supported by posttrain serve-model")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs an assistant message last")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops if s)

    def sampling(self, room: int) -> SamplingParams:
        """The engine's parameters. The token budget asked for is clamped to `room`, the rest of the
        context window, which is also the budget when none is asked for (finish_reason "length"
        says it ran out); a temperature below GREEDY_BELOW is greedy decoding."""
        asked = self.max_completion_tokens or self.max_tokens
        temperature = 1.0 if self.temperature is None else self.temperature
        return SamplingParams(min(asked or room, room), temperature if temperature >= GREEDY_BELOW else None,
                              self.top_p, max(self.top_k, 0), self.stop_strings())


def render_prompt(tokenizer, messages: list[dict], add_generation_prompt: bool, continue_final_message: bool) -> str:
    """The chat template's text; to continue the final message, everything the template writes
    after its content (the end-of-turn marker) is cut, found by rendering a sentinel in its place."""
    if not continue_final_message:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    *earlier, final = messages
    rendered = tokenizer.apply_chat_template([*earlier, {**final, "content": SENTINEL}], tokenize=False,
                                             add_generation_prompt=False)
    cut = rendered.rfind(SENTINEL)
    if cut < 0:
        raise ServingError(400, "continue_final_message: the chat template drops the final message's content")
    return rendered[:cut] + final["content"]


def response_text(tokenizer, generation: Generation, stop: tuple[str, ...], include_stop: bool) -> str:
    """OpenAI's text ends before the stop string; vLLM's include_stop_str_in_output keeps it
    (and nothing the token that held it wrote after it)."""
    if not include_stop:
        return generation.text
    text = tokenizer.decode(generation.token_ids, skip_special_tokens=True)
    hits = [(text.find(s), -len(s), s) for s in stop if s in text]
    if not hits:
        return text
    position, _, found = min(hits)
    return text[:position + len(found)]


class ServedModel:
    """One loaded checkpoint, on its device (`serving_device`), and the lock that keeps the engine
    to one request at a time; a request waits for it at most `queue_timeout` seconds."""

    def __init__(self, folder: str | Path, name: str, model: ModelConfig | None = None,
                 queue_timeout: float = Limits.queue_timeout):
        self.name, self.created = name, int(time.time())
        model = model or model_config(folder)
        self.device = serving_device(model)
        self.tokenizer = load_tokenizer(folder)
        self.model = load_model(folder, model).to(self.device).eval()
        self.context = getattr(self.model.config, "max_position_embeddings", None)
        self.lock, self.queue_timeout = threading.Lock(), queue_timeout

    def card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "posttrain"}

    def check_name(self, name: str) -> None:
        if name != self.name:
            raise ServingError(404, f"The model `{name}` does not exist (this server serves `{self.name}`).",
                               param="model")

    @contextmanager
    def turn(self, since: float):
        """The engine (and the tokenizer), once the requests ahead have finished; 503 once the
        request has waited `queue_timeout` seconds since `since` (time.monotonic())."""
        if not self.lock.acquire(timeout=max(since + self.queue_timeout - time.monotonic(), 0)):
            raise ServingError(503, f"the server is busy: this request waited {self.queue_timeout:g} s for the "
                                    "requests ahead of it; try again later", "server_error")
        try:
            yield
        finally:
            self.lock.release()

    def complete(self, request: ChatRequest, since: float | None = None) -> dict:
        """Decode a request (on a worker thread) and shape OpenAI's chat.completion answer; `since`:
        when it started waiting (default now), a wait for a worker thread included."""
        self.check_name(request.model)
        with self.turn(time.monotonic() if since is None else since):
            prompt_ids = self._prompt_ids(request)
            params = request.sampling(self._room(len(prompt_ids)))
            copies = 1 if params.temperature is None else request.n  # greedy choices are all the same
            generations = generate_tokens(self.model, self.tokenizer, [prompt_ids] * copies, params,
                                          batch_size=1, seed=request.seed or 0) * (request.n // copies)
            texts = [response_text(self.tokenizer, g, params.stop, request.include_stop_str_in_output)
                     for g in generations]
        completion_tokens = sum(len(g.token_ids) for g in generations)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.name,
                "choices": [{"index": i, "message": {"role": "assistant", "content": text},
                             "finish_reason": g.finish_reason, "logprobs": None}
                            for i, (text, g) in enumerate(zip(texts, generations))],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                          "total_tokens": len(prompt_ids) + completion_tokens}}

    def _prompt_ids(self, request: ChatRequest) -> list[int]:
        """Exactly `models.sampling.chat_prompt`'s ids for a single user message."""
        messages = [m.model_dump() for m in request.messages]
        text = render_prompt(self.tokenizer, messages, request.add_generation_prompt, request.continue_final_message)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _room(self, prompt_tokens: int) -> int:
        """Tokens left in the context window after the prompt: the most a request decodes (256
        when the model's config names no context)."""
        if self.context is None:
            return 256
        if prompt_tokens >= self.context:
            raise ServingError(400, f"messages: the prompt is {prompt_tokens} tokens, the model's context is "
                                    f"{self.context}", param="messages")
        return self.context - prompt_tokens


def serving_device(model: ModelConfig) -> str:
    """Where a served model runs: the first GPU the process sees when CUDA is present and
    `model.device` is auto, else the CPU."""
    import torch

    return "cuda:0" if model.device == "auto" and torch.cuda.is_available() else "cpu"


def model_config(folder: str | Path) -> ModelConfig:
    """For a folder without its spec's model config: the default one; a LoRA adapter checkpoint
    names its base model itself (as the path it was trained from)."""
    adapter = Path(folder) / ADAPTER_CONFIG
    if adapter.exists():
        return ModelConfig(base=json.loads(adapter.read_text())["base_model_name_or_path"])
    return ModelConfig()


def make_app(folder: str | Path, model_name: str, model: ModelConfig | None = None, limits: Limits | None = None):
    """The FastAPI app serving the checkpoint in `folder` as `model_name`, loaded with `model`
    (the spec's model config: dtype, LoRA base) when known, refusing what `limits` bounds;
    `app.state` holds both (server_config reads the limits)."""
    from fastapi import FastAPI
    from starlette.concurrency import run_in_threadpool

    limits = limits or Limits()
    served = ServedModel(folder, model_name, model, limits.queue_timeout)
    app = FastAPI(title=f"posttrain serve-model {model_name}")
    app.state.served, app.state.limits = served, limits
    app.add_middleware(BodyLimit, limits=limits)
    add_error_handlers(app)

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [served.card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict:
        served.check_name(name)
        return served.card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatRequest) -> dict:
        return await run_in_threadpool(served.complete, request, time.monotonic())  # the event loop stays free

    return app


class ListenError(Exception):
    """The server cannot listen on the host and port asked for (in use, not an address here)."""


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound, listening socket: bound before the model loads, so a taken port fails at once."""
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        raise ListenError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    return sock


def serve(folder: str | Path, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          model: ModelConfig | None = None, limits: Limits | None = None) -> None:
    """Serve until interrupted. The line is printed once the socket listens, so a client that read
    it can connect; port 0 picks a free port (the line names it)."""
    import uvicorn

    sock = listening_socket(host, port)
    app = make_app(folder, model_name, model, limits)
    print(f"serving {model_name} on http://{host}:{sock.getsockname()[1]}/v1", flush=True)
    uvicorn.Server(server_config(app, app.state.limits)).run(sockets=[sock])
