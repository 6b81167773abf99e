"""A fake vLLM OpenAI-compatible server, for tests: vLLM's routes, field lists, defaults, error
shapes and runtime-LoRA and weight-update behaviour, over the project's own engine (engine.py).

What it models (vLLM v0.29 main; protocol.py names the source files):
- `/v1/completions`: missing sampling fields filled from the model's generation_config, a 400 when
  max_tokens does not fit the context left, log-probs in `--logprobs-mode` (raw by default);
- `/v1/models`: one card per served name with `max_model_len`, one per loaded adapter (`parent`);
- runtime LoRA (routes only with VLLM_ALLOW_RUNTIME_LORA_UPDATING): load and unload with vLLM's
  plain-text answers and errors, an LRU CPU cache of `max_cpu_loras` adapters, an adapter evicted
  from it reloaded from its path when a request names it (a deleted folder kills the engine: that
  request gets a bare 500 and the server shuts down, so clients then see refused connections, as
  vLLM's EngineDeadError handler does), the unload of an evicted adapter answered 500 with the name
  kept registered (the frontend returns before deleting it), a load of a registered name refused
  unless `load_inplace` (ignored by builds before 0.15: pydantic drops the unknown field);
- dev mode (VLLM_SERVER_DEV_MODE=1): /pause, /resume, /is_paused (builds from 0.12), /pause's `mode`
  (abort | wait | keep) from 0.15 only (before: `wait_for_inflight_requests`, default abort),
  /reset_prefix_cache, /collective_rpc on a worker that inherits `--worker-extension-cls` (a worker's
  exception: a 500 with its message, the engine alive);
- the worker's `model_runner.model_config` (quantization, dtype) and `model_runner.model.load_weights`;
- `version`: the vLLM version it acts as (older builds lack the routes and fields above);
- a route that is not registered: FastAPI's 404 {"detail": "Not Found"}.
Test hooks: `gate` (cleared, requests wait in flight before decoding), `requests` (the sampling
each request decoded with) and `failing_loads` (that many next `load_weights` calls fail part way,
after the first tensor, as a device error would).
"""

from __future__ import annotations

import copy
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from fake_vllm.chat import completion_body, message_of, prompt_ids, tool_choice_of, tool_parser
from fake_vllm.engine import Choice, decode
from fake_vllm.protocol import (GENERATION_CONFIG_KEYS, VLLM_VERSION, CompletionRequest, VllmError, bad_request,
                                check_context, sampling_of, unknown_model)

PAUSE_SINCE = (0, 12, 0)  # /pause, /resume, /is_paused (#28037)
PAUSE_MODE_SINCE = (0, 15, 0)  # /pause?mode= (#32351); load_inplace (#31326)


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in version.split(".")[:3])


class EngineDead(Exception):
    """The engine core died (vLLM's EngineDeadError): the API server answers a bare 500 and shuts down."""


@dataclass
class FakeVllmConfig:
    folder: Path  # the served checkpoint
    served_name: str
    max_model_len: int = 2048
    generation_config: dict = field(default_factory=dict)  # the model's generation_config.json (auto)
    logprobs_mode: str = "raw_logprobs"
    runtime_lora: bool = True  # VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora
    max_loras: int = 1
    max_cpu_loras: int | None = None  # None: max_loras
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE=1
    worker_extension: type | None = None  # --worker-extension-cls
    version: str = VLLM_VERSION  # the build it acts as
    quantization: str | None = None  # --quantization, or the checkpoint's quantization_config
    dtype: str = "float32"  # --dtype: the served weights' dtype
    tool_call_parser: str | None = None  # --enable-auto-tool-choice --tool-call-parser NAME (vLLM's name)

    def at_least(self, version: tuple[int, ...]) -> bool:
        return version_tuple(self.version) >= version


class FakeModelRunner:
    def __init__(self, server: "FakeVllm"):
        from types import SimpleNamespace

        self.model = WeightsLoader(server)
        self.model_config = SimpleNamespace(quantization=server.config.quantization, dtype=server.model.dtype)


class WeightsLoader:
    """vLLM's model as a worker extension sees it: `load_weights` of (name, tensor) pairs in the
    checkpoint's own names."""

    def __init__(self, server: "FakeVllm"):
        self.server = server
        self.torch_model = server.model

    def load_weights(self, weights) -> set[str]:
        import torch

        parameters = dict(self.torch_model.named_parameters())
        loaded = set()
        failing = self.server.failing_loads > 0
        self.server.failing_loads -= failing
        with torch.no_grad():
            for name, tensor in weights:
                if name not in parameters:
                    raise ValueError(f"no parameter {name}")
                parameters[name].copy_(tensor)
                loaded.add(name)
                if failing:
                    raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return loaded


class FakeVllm:
    def __init__(self, config: FakeVllmConfig):
        from models.config import ModelConfig
        from models.loading import load_model, load_tokenizer

        self.config = config
        self.model = load_model(config.folder, ModelConfig(dtype=config.dtype)).eval()
        self.tokenizer = load_tokenizer(config.folder)
        self.tool_parser = tool_parser(config.tool_call_parser)
        self.server_defaults = {k: v for k, v in config.generation_config.items() if k in GENERATION_CONFIG_KEYS}
        self.registry: dict[str, str] = {}  # adapter name -> path, in load order (the frontend's)
        self.cache: OrderedDict[str, object] = OrderedDict()  # adapter name -> its model (the CPU cache, LRU)
        self.dead = False  # the engine died (an adapter it had to reload was gone)
        self.paused, self.aborting, self.in_flight = False, False, 0
        self.state = threading.Condition()
        self.decoding = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()
        self.requests: list[dict] = []
        self.prefix_cache_resets = 0
        self.failing_loads = 0
        self.on_engine_death = lambda: None  # running_fake: the server shuts down
        bases = (config.worker_extension, FakeWorker) if config.worker_extension else (FakeWorker,)
        worker = type("Worker", bases, {})  # as vLLM mixes the extension into its worker class
        self.worker = worker(self)

    # completions

    def complete(self, body) -> dict:
        if self.dead:
            raise EngineDead("the engine core died")
        request = parse(body)
        model = self.model_for(request.model)
        prompts = self.prompts_of(request)
        sampling = sampling_of(request, self.server_defaults)
        for prompt in prompts:
            check_context(len(prompt), sampling.max_tokens, self.config.max_model_len)
        if request.stream:
            raise VllmError(501, "the fake vLLM server does not stream", "NotImplementedError")
        self.requests.append({"model": request.model, "sampling": sampling, "prompt_tokens": [len(p) for p in prompts]})
        choices = self.in_flight_decode(model, prompts, sampling, request)
        return self.answer(request, prompts, choices, sampling.n)

    def chat(self, body) -> dict:
        """A chat completion (chat.py): the messages and tools rendered, decoded as a completion."""
        if self.dead:
            raise EngineDead("the engine core died")
        if not isinstance(body, dict):
            parse(body)  # raises vLLM's validation error of a body that is no object
        choice = tool_choice_of(body, self.tool_parser)
        prompt = prompt_ids(self.tokenizer, body)
        request = parse(completion_body(body, prompt, self.config.max_model_len))
        if request.stream:
            raise VllmError(501, "the fake vLLM server does not stream", "NotImplementedError")
        sampling = sampling_of(request, self.server_defaults)
        check_context(len(prompt), sampling.max_tokens, self.config.max_model_len)
        self.requests.append({"model": request.model, "sampling": sampling, "prompt_tokens": [len(prompt)]})
        [choices] = self.in_flight_decode(self.model_for(request.model), [prompt], sampling, request)
        rows = []
        for index, generated in enumerate(choices):
            message, finish = message_of(generated.text, generated.finish_reason, self.tool_parser, choice)
            rows.append({"index": index, "message": message, "logprobs": None, "finish_reason": finish,
                         "stop_reason": generated.stop_reason,
                         "token_ids": generated.token_ids if request.return_token_ids else None})
        completion_tokens = sum(len(c.token_ids) for c in choices)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": request.model, "choices": rows,
                "prompt_token_ids": prompt if request.return_token_ids else None,
                "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + completion_tokens,
                          "completion_tokens": completion_tokens, "prompt_tokens_details": None}}

    def in_flight_decode(self, model, prompts, sampling, request) -> list[list[Choice]]:
        with self.state:
            self.state.wait_for(lambda: not self.paused)
            self.in_flight += 1
        try:
            while not self.gate.wait(0.05) and not self.aborting:
                pass  # held in flight by a test, until a /pause?mode=abort aborts it
            with self.decoding:
                return [decode(model, self.tokenizer, prompt, sampling, request, self.config.logprobs_mode,
                               lambda: self.aborting) for prompt in prompts]
        finally:
            with self.state:
                self.in_flight -= 1
                self.state.notify_all()

    def prompts_of(self, request: CompletionRequest) -> list[list[int]]:
        prompt = request.prompt
        if prompt is None or prompt == "" or prompt == []:
            raise bad_request("Either prompt or prompt_embeds must be provided and non-empty.")
        if isinstance(prompt, str):
            return [self.tokenizer(prompt)["input_ids"]]
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return [self.tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in prompt]

    def model_for(self, name: str | None):
        """The weights a request's `model` names: the served ones, or a loaded adapter's (reloaded
        from its path when the CPU cache evicted it)."""
        if not name or name == self.config.served_name:
            return self.model
        if name not in self.registry:
            raise unknown_model(name)
        if name not in self.cache:
            if not Path(self.registry[name]).is_dir():
                self.dead = True  # the worker's load fails inside the engine's step: the engine core dies
                raise EngineDead(name)
            self.cache_adapter(name)
        self.cache.move_to_end(name)
        return self.cache[name]

    def cache_adapter(self, name: str) -> None:
        from peft import PeftModel

        capacity = self.config.max_cpu_loras or self.config.max_loras
        while len(self.cache) >= capacity:
            self.cache.popitem(last=False)
        merged = PeftModel.from_pretrained(copy.deepcopy(self.model), self.registry[name]).merge_and_unload()
        self.cache[name] = merged.eval()

    def answer(self, request: CompletionRequest, prompts, choices: list[list[Choice]], n: int) -> dict:
        rows = []
        for p, (prompt, prompt_choices) in enumerate(zip(prompts, choices)):
            for j, choice in enumerate(prompt_choices):
                rows.append({"index": p * n + j, "text": choice.text,
                             "logprobs": self.logprobs_of(request, choice) if request.logprobs is not None else None,
                             "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason,
                             "token_ids": choice.token_ids if request.return_token_ids else None,
                             "prompt_token_ids": prompt if request.return_token_ids else None,
                             "prompt_logprobs": None})
        completion_tokens = sum(len(c.token_ids) for cs in choices for c in cs)
        prompt_tokens = sum(len(p) for p in prompts)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": request.model, "choices": rows, "service_tier": None, "system_fingerprint": None,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                          "completion_tokens": completion_tokens, "prompt_tokens_details": None},
                "kv_transfer_params": None}

    def logprobs_of(self, request: CompletionRequest, choice: Choice) -> dict:
        def token(token_id: int) -> str:
            if request.return_tokens_as_token_ids:
                return f"token_id:{token_id}"
            return self.tokenizer.decode([token_id])

        tokens = [token(t) for t in choice.token_ids]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        tops = [{token(t): v for t, v in entry.items()} for entry in choice.top_logprobs] if request.logprobs else \
            [{token(t): v} for t, v in zip(choice.token_ids, choice.logprobs)]
        return {"text_offset": offsets, "token_logprobs": choice.logprobs, "tokens": tokens, "top_logprobs": tops}

    def cards(self) -> dict:
        now = int(time.time())
        base = {"id": self.config.served_name, "object": "model", "created": now, "owned_by": "vllm",
                "root": str(self.config.folder), "parent": None, "max_model_len": self.config.max_model_len,
                "permission": []}
        adapters = [{**base, "id": name, "root": path, "parent": self.config.served_name, "max_model_len": None}
                    for name, path in self.registry.items()]
        return {"object": "list", "data": [base, *adapters]}

    # runtime LoRA

    def load_adapter(self, body: dict) -> str:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            raise VllmError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        inplace = bool(body.get("load_inplace")) and self.config.at_least(PAUSE_MODE_SINCE)
        if name in self.registry and not inplace:
            raise VllmError(400, f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                 "adapter in place, set 'load_inplace' to True.", "InvalidUserInput")
        if not (Path(path) / "adapter_config.json").is_file():
            raise VllmError(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
        self.registry[name] = path
        self.cache.pop(name, None)
        self.cache_adapter(name)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_adapter(self, body: dict) -> str:
        name = body.get("lora_name")
        if not name:
            raise VllmError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        if name not in self.registry:
            raise VllmError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        if self.cache.pop(name, None) is None:  # evicted: the engine has nothing to remove, and says so,
            # before the frontend deletes the name: it stays registered (a load of it is then a 400)
            raise VllmError(500, f"Failed to remove lora adapter '{name}' from the engine.", "InternalServerError")
        del self.registry[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    # dev mode

    def pause_mode(self, mode: str, wait_for_inflight_requests: bool) -> str:
        """What a /pause does on this build: before 0.15 only `wait_for_inflight_requests` counts
        (default: abort); from 0.15 the flag still means wait, else `mode`."""
        if wait_for_inflight_requests:
            return "wait"
        return mode if self.config.at_least(PAUSE_MODE_SINCE) else "abort"

    def pause(self, mode: str) -> dict:
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"Invalid pause mode: {mode}")
        with self.state:
            self.paused = True
            if mode == "abort":
                self.aborting = True
            if mode == "wait" or mode == "abort":
                self.state.wait_for(lambda: self.in_flight == 0)
            self.aborting = False
        return {"status": "paused"}

    def resume(self) -> dict:
        with self.state:
            self.paused = False
            self.state.notify_all()
        return {"status": "resumed"}


class FakeWorker:
    """What a `--worker-extension-cls` class is mixed into: the worker, its model runner's model."""

    def __init__(self, server: FakeVllm):
        self.server = server
        self.model_runner = FakeModelRunner(server)


def parse(body) -> CompletionRequest:
    from pydantic import ValidationError

    if not isinstance(body, dict):
        raise VllmError(400, "1 validation error:\n  body: Input should be a valid dictionary", "Bad Request", "body")
    try:
        return CompletionRequest.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0]
        where = ".".join(["body", *map(str, first["loc"])])
        raise VllmError(400, f"{len(errors)} validation error(s):\n  {first['msg']}", "Bad Request", where) from None
