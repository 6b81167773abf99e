"""vLLM's OpenAI-compatible protocol, as the fake server speaks it: the /v1/completions request
fields, how missing sampling fields are filled, the checks that answer 400, and the error shape.

Field lists, defaults and error texts follow vllm-project/vllm main as of v0.29.0 (2026-09):
- vllm/entrypoints/openai/completion/protocol.py: CompletionRequest (OpenAIBaseModel, extra="allow":
  unknown fields are ignored), `to_sampling_params` (request value, else the server's default from
  the model's generation_config under `--generation-config auto`, else _DEFAULT_SAMPLING_PARAMS);
- vllm/config/model.py: `get_diff_sampling_param` reads only repetition_penalty, temperature, top_k,
  top_p, min_p and max_new_tokens from generation_config.json;
- vllm/renderers/params.py: the context checks (`max_tokens` above max_model_len; prompt plus
  max_tokens above it), vllm/exceptions.py: the ` (parameter=..., value=...)` suffix;
- vllm/sampling_params.py: the SamplingParams checks;
- vllm/entrypoints/serve/engine/protocol.py: ErrorResponse {"error": {message, type, param, code}};
- vllm/v1/engine/parallel_sampling.py: with `n` > 1 and a seed, choice j samples with seed + j.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

VLLM_VERSION = "0.29.0"
GREEDY_BELOW = 1e-5  # a temperature under this samples greedily
MAX_LOGPROBS = 20  # --max-logprobs
# _DEFAULT_SAMPLING_PARAMS: what a field is when neither the request nor the server's defaults set it
HARD_DEFAULTS = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "temperature": 1.0,
                 "top_p": 1.0, "top_k": 0, "min_p": 0.0}
# what `--generation-config auto` takes from a model's generation_config.json (max_new_tokens aside:
# a completion request's max_tokens is never empty, so it never applies there)
GENERATION_CONFIG_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: list[int] | list[list[int]] | str | list[str] | None = None
    echo: bool | None = False
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = None
    max_tokens: int | None = 16
    n: int = 1
    presence_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = []
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None


class VllmError(Exception):
    """An error answer: `{"error": {"message", "type", "param", "code"}}` with status `code`."""

    def __init__(self, code: int, message: str, kind: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.kind, self.param = code, message, kind, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad_request(message: str, parameter: str | None = None, value=None) -> VllmError:
    """A VLLMValidationError: its text carries the parameter and the value."""
    suffix = f" (parameter={parameter}, value={value})" if parameter is not None else ""
    return VllmError(400, message + suffix, "BadRequestError", parameter)


@dataclass(frozen=True)
class Sampling:
    """The sampling a request decodes with, every field filled."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    max_tokens: int
    n: int
    seed: int | None
    stop: tuple[str, ...]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def neutral_penalties(self) -> bool:
        return self.min_p == 0.0 and self.repetition_penalty == 1.0 and self.presence_penalty == 0.0 \
            and self.frequency_penalty == 0.0


def sampling_of(request: CompletionRequest, server_defaults: dict) -> Sampling:
    """`to_sampling_params`: each field the request's, else the server's default, else the hard default."""
    filled = {name: getattr(request, name) if getattr(request, name) is not None
              else server_defaults.get(name, default) for name, default in HARD_DEFAULTS.items()}
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    max_tokens = request.max_tokens if request.max_tokens is not None else 16
    sampling = Sampling(**filled, max_tokens=max_tokens, n=request.n,
                        seed=None if request.seed == -1 else request.seed, stop=stop)
    check_sampling(sampling, request)
    return sampling


def check_sampling(sampling: Sampling, request: CompletionRequest) -> None:
    """SamplingParams' own checks (vllm/sampling_params.py), each a 400."""
    if sampling.temperature < 0:
        raise bad_request(f"temperature must be non-negative, got {sampling.temperature}.", "temperature",
                          sampling.temperature)
    if not 0 < sampling.top_p <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {sampling.top_p}.", "top_p", sampling.top_p)
    if sampling.top_k < 0:
        raise bad_request(f"top_k must be 0 (disable), or at least 1, got {sampling.top_k}.", "top_k", sampling.top_k)
    if not 0 <= sampling.min_p <= 1:
        raise bad_request(f"min_p must be in [0, 1], got {sampling.min_p}.", "min_p", sampling.min_p)
    if sampling.max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {sampling.max_tokens}.", "max_tokens",
                          sampling.max_tokens)
    if sampling.greedy and sampling.n > 1:
        raise bad_request(f"n must be 1 when using greedy sampling, got {sampling.n}.", "n", sampling.n)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(request, name)
        if value is not None and value < -1:
            raise bad_request(f"`{name}` must be a positive value or -1.", name, value)
        if value is not None and value > MAX_LOGPROBS:
            raise bad_request(f"Requested sample logprobs of {value}, which is greater than max allowed: "
                              f"{MAX_LOGPROBS}", name, value)


def check_context(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """The renderer's context checks, as their texts read in v0.29 (the first one's missing space
    and `=` included)."""
    if max_tokens > max_model_len:
        max_total_tokens = max_model_len
        raise bad_request(f"{'max_tokens'}={max_tokens}" + "cannot be greater than "
                          + f"max_model_len={max_total_tokens=}. Please request fewer output tokens.",
                          "max_tokens", max_tokens)
    if prompt_tokens + max_tokens > max_model_len:
        raise bad_request(f"You passed {prompt_tokens} input tokens and requested {max_tokens} output tokens. "
                          f"However, the model's context length is only {max_model_len} tokens, resulting in a "
                          f"maximum input length of {max_model_len - max_tokens} tokens. Please reduce the "
                          "length of the input prompt.", "input_tokens", prompt_tokens)


def unknown_model(name: str) -> VllmError:
    return VllmError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")
