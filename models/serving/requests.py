"""The request bodies `posttrain serve-model` accepts: OpenAI's chat and completions, with vLLM's extensions.

Every field is bounded (the constants in models/serving/limits.py): a value out of range is a 400
naming the field, never reduced into range. Besides OpenAI's parameters they accept vLLM's
`top_k`, `include_stop_str_in_output`, `return_token_ids` (the generated ids on each choice and the
prompt's ids) and, for chat, `add_generation_prompt` and `continue_final_message` (continue the
final assistant message: how a multi-turn context goes on after a tool's output); completions
also take `return_tokens_as_token_ids` (log-prob tokens as `token_id:N`). A completions prompt may
be token ids, vLLM's token-in form: what the server decodes from is then exactly those ids.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from models.sampling import SamplingParams
from models.serving.limits import (
    GREEDY_BELOW,
    MAX_CONTENT_CHARS,
    MAX_LOGPROBS,
    MAX_MESSAGES,
    MAX_N,
    MAX_PROMPTS,
    MAX_PROMPT_IDS,
    MAX_SEED,
    MAX_STOP,
    MAX_STOP_CHARS,
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The sampling fields both APIs share; others a client sends are ignored."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    temperature: float | None = Field(None, ge=0, le=2)  # absent: OpenAI's default 1; below GREEDY_BELOW: greedy
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # vLLM extension; 0 or -1: off
    max_tokens: int | None = Field(None, gt=0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)  # absent: seed 0, so the server is deterministic
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _bounded_stop(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, not {len(stops)}")
        if any(isinstance(s, str) and len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters")
        return stop

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops if s)

    def token_budget(self) -> int | None:
        return self.max_tokens

    def top_logprobs_asked(self) -> int:
        return 0

    def sampling(self, room: int) -> SamplingParams:
        """The engine's parameters. The token budget asked for is clamped to `room`, the rest of the
        context window, which is also the budget when none is asked for (finish_reason "length"
        says it ran out); a temperature below GREEDY_BELOW is greedy decoding."""
        asked = self.token_budget()
        temperature = 1.0 if self.temperature is None else self.temperature
        return SamplingParams(min(asked or room, room), temperature if temperature >= GREEDY_BELOW else None,
                              self.top_p, max(self.top_k, 0), self.stop_strings(), self.top_logprobs_asked())


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


class ChatRequest(SamplingRequest):
    """A chat completion: the messages rendered with the checkpoint's chat template."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, gt=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _consistent(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs an assistant message last")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs true")
        return self

    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def top_logprobs_asked(self) -> int:
        return self.top_logprobs or 0


class CompletionRequest(SamplingRequest):
    """A completion of raw prompts: text (tokenized as is, no chat template) or token ids, one
    prompt or a list of them (the choices come prompt by prompt, `n` each)."""

    prompt: str | list  # a text, token ids, or a list of either (checked by `_bounded_prompt`)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # log-probs of the sampled tokens and this many more
    echo: bool = False
    return_tokens_as_token_ids: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _bounded_prompt(cls, prompt):
        prompts = prompt_list(prompt) if isinstance(prompt, (str, list)) else None
        if prompts is None or not all(isinstance(one, str) or (isinstance(one, list) and all(
                type(i) is int for i in one)) for one in prompts):
            raise ValueError("a text, a list of token ids (integers), or a list of either")
        if not prompts or len(prompts) > MAX_PROMPTS:
            raise ValueError(f"between 1 and {MAX_PROMPTS} prompts, not {len(prompts)}")
        for one in prompts:
            if isinstance(one, str) and len(one) > MAX_CONTENT_CHARS:
                raise ValueError(f"a prompt has at most {MAX_CONTENT_CHARS} characters")
            if isinstance(one, list) and not 0 < len(one) <= MAX_PROMPT_IDS:
                raise ValueError(f"a token-id prompt has between 1 and {MAX_PROMPT_IDS} ids")
            if isinstance(one, list) and any(i < 0 for i in one):
                raise ValueError("token ids are not negative")
        return prompt

    @model_validator(mode="after")
    def _supported(self):
        if self.echo:
            raise ValueError("echo is not supported by posttrain serve-model")
        return self

    def prompts(self) -> list[str | list[int]]:
        return prompt_list(self.prompt)

    def top_logprobs_asked(self) -> int:
        return self.logprobs or 0


def prompt_list(prompt) -> list:
    """The prompts of a completions request: one text, one id list, or a list of either."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)
