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

import json
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
    MAX_TOOLS,
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


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=MAX_STOP_CHARS)
    description: str = Field("", max_length=MAX_CONTENT_CHARS)
    parameters: dict = {"type": "object", "properties": {}}


class Tool(BaseModel):
    """OpenAI's tool schema, `{"type": "function", "function": {name, description, parameters}}`."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: ToolFunction


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: dict[str, str]  # {"name": ...}


class ChatMessage(BaseModel):
    """A chat turn; an assistant's may carry `tool_calls` (then its content may be null), a `tool`
    turn answers one (`tool_call_id`)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = Field(None, max_length=MAX_CONTENT_CHARS)
    tool_calls: list[dict] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=MAX_STOP_CHARS)
    name: str | None = Field(None, max_length=MAX_STOP_CHARS)

    @model_validator(mode="after")
    def _content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant's with tool_calls may omit it)")
        return self

    def template_turn(self) -> dict:
        """The turn as chat templates read it (a call's `arguments` as the object it encodes)."""
        turn = {**self.model_dump(exclude_none=True), "content": self.content or ""}
        if self.tool_calls:
            turn["tool_calls"] = [decoded_call(call) for call in self.tool_calls]
        return turn

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
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    @model_validator(mode="after")
    def _consistent(self):
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs an assistant message last")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs true")
        return self

    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def tool_schemas(self) -> list[dict] | None:
        """The tools the template renders (none when tool_choice is "none", as OpenAI's API hides them)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump() for tool in self.tools]

    def top_logprobs_asked(self) -> int:
        return self.top_logprobs or 0


class CompletionRequest(SamplingRequest):
    """A completion of raw prompts: text (tokenized as is, no chat template) or token ids, one
    prompt or a list of them (the choices come prompt by prompt, `n` each)."""

    prompt: str | list  # a text, token ids, or a list of either (checked by `_bounded_prompt`)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # log-probs of the sampled tokens and this many more
    echo: bool = False  # the prompt before the completion, its tokens' log-probs too (models/serving/echo.py)
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: the prompt alone (lm-eval's loglikelihood)
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
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 needs echo true")
        if self.echo and self.stream:
            raise ValueError("echo is not supported with stream by posttrain serve-model")
        return self

    def token_budget(self) -> int | None:
        return 1 if self.max_tokens == 0 else self.max_tokens  # 0: one token decoded, none answered

    def prompts(self) -> list[str | list[int]]:
        return prompt_list(self.prompt)

    def top_logprobs_asked(self) -> int:
        return self.logprobs or 0


def prompt_list(prompt) -> list:
    """The prompts of a completions request: one text, one id list, or a list of either."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def decoded_call(call: dict) -> dict:
    """An OpenAI tool call with its `arguments` JSON text decoded (templates write them as objects)."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        return {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}
    except json.JSONDecodeError:
        return call
