"""The policy behind an OpenAI-compatible endpoint (`posttrain serve-model`, vLLM, an API model).

It plugs into `tasks.rollout.episodes.roll_out` like the local model: every turn, each running episode's
context goes out as chat messages (its prompt as the user's message; what the policy and the env
wrote since, if anything, as an assistant message the server continues, vLLM's
`continue_final_message`), the requests of a batch concurrently. The answers come back as text and
are turned into ids with the local tokenizer, ended the way the local engine ends them, so the rest
of the loop (transcripts, env steps, rows) cannot tell the two policies apart.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from artifacts.store import first_line
from artifacts.urls import ScrubbedError
from models.sampling import Generation, SamplingParams, before_stop
from tasks.rollout.episodes import Context, ended_ids


class EndpointError(ScrubbedError, RuntimeError):
    """The endpoint cannot answer (unreachable, unknown model, a refused request); one line, whose
    URLs show no credentials (a policy built past the spec's check may hold some)."""


class EndpointConfigError(ValueError):
    """An endpoint config that cannot be used as it stands (its API key's variable unset); one line."""


class EndpointPolicy:
    """`act` and `complete` of the rollout loop's policy protocol, over the official `openai` client."""

    def __init__(self, base_url: str, model: str, tokenizer, api_key: str | None = None, extensions: bool = True,
                 max_workers: int = 4, max_retries: int = 1, timeout: float | None = None):
        from openai import OpenAI

        self.base_url, self.model, self.tokenizer = base_url, model, tokenizer
        self.extensions = extensions  # vLLM's request extensions (a plain OpenAI API refuses them)
        self.max_workers = max_workers
        # a key goes only to the endpoint whose config names its variable (`api_key_env`): never
        # OPENAI_API_KEY by default, which would hand it to whatever URL a spec or event gives
        # the client retries timeouts, connection errors, 429s and 5xx itself, backing off
        self.client = OpenAI(base_url=base_url, api_key=api_key or "none", max_retries=max_retries,
                             **({"timeout": timeout} if timeout is not None else {}))

    @classmethod
    def of(cls, config, tokenizer, field: str) -> "EndpointPolicy":
        """The policy of a spec's endpoint config (`teacher:`, `judge:`)."""
        return cls(config.endpoint, config.model, tokenizer, api_key=endpoint_api_key(config, field))

    def check_model(self) -> None:
        """Fail in one line unless the endpoint answers and serves the model."""
        served = endpoint_call(self.base_url, self.client, self.model,
                               lambda: [card.id for card in self.client.models.list()])
        if self.model not in served:
            raise EndpointError(f"{self.base_url}: unknown model {self.model!r} (the endpoint serves: "
                                f"{', '.join(served) or 'none'})")

    def act(self, episodes: list[int], contexts: list[Context], turn: int, params: SamplingParams,
            seeds: list[int]) -> list[Generation]:
        """One action per context, each request with its episode's seed for this turn (a group of
        repeats of one task samples different actions)."""
        requests = [self._request(context, params, seed) for seed, context in zip(seeds, contexts)]
        with ThreadPoolExecutor(max_workers=self.max_workers) as pool:
            return list(pool.map(lambda request: self._generation(request, params.stop), requests))

    def complete(self, prompt: str, params: SamplingParams) -> str:
        """One chat answer to a fresh prompt (an episode's own model call: RLM's `llm_query`)."""
        request = {"messages": [{"role": "user", "content": prompt}], **self._sampling(params, 0)}
        return self._call(request).choices[0].message.content or ""

    def _request(self, context: Context, params: SamplingParams, seed: int) -> dict:
        """The chat request of a context: the prompt, and the assistant message to continue if any."""
        messages = [{"role": "user", "content": context.prompt}]
        request = {"messages": messages, **self._sampling(params, seed)}
        extra_body = {"include_stop_str_in_output": True} if params.stop and self.extensions else {}
        if len(context.ids) > context.prompt_len:
            if not self.extensions:
                raise EndpointError(f"{self.base_url}: continuing a multi-turn context needs the "
                                    "continue_final_message extension (extensions are off)")
            so_far = self.tokenizer.decode(context.ids[context.prompt_len:], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": so_far})
            extra_body |= {"continue_final_message": True, "add_generation_prompt": False}
        if params.top_k > 0 and self.extensions:  # OpenAI's API has no top-k
            extra_body["top_k"] = params.top_k
        return {**request, "extra_body": extra_body} if extra_body else request

    def _sampling(self, params: SamplingParams, seed: int) -> dict:
        sampling = {"temperature": 0 if params.temperature is None else params.temperature,
                    "top_p": params.top_p, "max_tokens": params.max_new_tokens, "seed": seed}
        return {**sampling, "stop": list(params.stop)} if params.stop else sampling

    def _generation(self, request: dict, stop: tuple[str, ...]) -> Generation:
        """The answer as the local engine returns it: text without the stop string, ids with it
        (or with the end token when the model ended on its own)."""
        choice = self._call(request).choices[0]
        text = choice.message.content or ""
        finish_reason = "length" if choice.finish_reason == "length" else "stop"
        ids = ended_ids(self.tokenizer, text, stop) if finish_reason == "stop" else \
            self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return Generation(before_stop(text, stop), ids, finish_reason=finish_reason)

    def _call(self, request: dict):
        """One chat completion; whatever goes wrong becomes a one-line EndpointError."""
        return endpoint_call(self.base_url, self.client, self.model,
                             lambda: self.client.chat.completions.create(model=self.model, **request))


def endpoint_api_key(config, field: str) -> str | None:
    """The API key of an endpoint config: from the environment variable it names (`api_key_env`),
    never from the spec itself; None when it names none."""
    if config.api_key_env is None:
        return None
    api_key = os.environ.get(config.api_key_env)
    if not api_key:
        raise EndpointConfigError(f"{field}.api_key_env: environment variable {config.api_key_env} is not set")
    return api_key


def endpoint_call(base_url: str, client, model: str, create):
    """`create()` (one request of the `openai` client); whatever goes wrong becomes a one-line EndpointError."""
    import openai

    try:
        return create()
    except openai.APIConnectionError as exc:
        raise EndpointError(f"{base_url}: cannot reach the endpoint ({connection_reason(exc)})") from None
    except openai.NotFoundError as exc:
        raise EndpointError(not_found(base_url, client, model, exc)) from None
    except openai.APIStatusError as exc:
        raise EndpointError(f"{base_url}: HTTP {exc.status_code}: {api_message(exc)}") from None


def not_found(base_url: str, client, model: str, exc) -> str:
    """A 404: the model is not served there (say which are), or the URL is no OpenAI API."""
    import openai

    try:
        served = [card.id for card in client.models.list()]
    except openai.OpenAIError:
        return f"{base_url}: no OpenAI-compatible API there (HTTP 404: {api_message(exc)})"
    if model not in served:
        return f"{base_url}: unknown model {model!r} (the endpoint serves: {', '.join(served) or 'none'})"
    return f"{base_url}: HTTP 404: {api_message(exc)}"


def connection_reason(exc) -> str:
    cause = exc.__cause__ or exc
    return first_line(str(cause)) or type(cause).__name__


def api_message(exc) -> str:
    body = exc.body if isinstance(exc.body, dict) else {}
    error = body.get("error", body)
    message = error.get("message") if isinstance(error, dict) else None
    return first_line(str(message or exc.message))

