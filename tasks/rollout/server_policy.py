"""The policy on an inference server, token in / token out: `rollout: {backend: server}`.

It plugs into `tasks.rollout.episodes.roll_out` like the local model. Each running episode's context
goes out as token ids to the server's `/v1/completions` (vLLM's token-id prompt; `posttrain
serve-model` speaks the same), one request per episode with that episode's seed, the requests of
a turn concurrently so that the server decodes them as one batch. The answer must carry the
generated ids (vLLM ≥ 0.10.2's `return_token_ids`) and each one's log-prob (`logprobs: 0`): the
rows hold exactly the ids the server sampled and the behaviour policy's log-probs, never a
re-tokenised text. Multi-turn episodes continue from the ids, so env-written tokens stay what the
env wrote (and masked).

What vLLM would otherwise decide, a request says: every sampling field (a field left out takes the
model's generation_config default, Qwen3's top_k 20 for one), and a max_tokens that fits the context
the server has left (vLLM answers 400 past `max_model_len`; an episode with no room left ends cut).
A completion the server aborted is an error, never a stop. The server is checked once before
anything runs (tasks/rollout/server_checks.py).

After a weight sync (tasks/rollout/weight_sync.py) requests name the new weights: the published
LoRA adapter's name, or, after a full-weight reload, the same name (serve-model also reports its
`weights_version`). Every generation records the version that produced it, and the policy counts
the requests in flight per name, so a sync never retires an adapter a request still names.
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace

from models.sampling import Generation, SamplingParams, before_stop, chat_prompt
from tasks.rollout.endpoint_policy import EndpointError, endpoint_api_key, endpoint_call
from tasks.rollout.episodes import Context
from tasks.rollout.server_checks import check_server, returned_tokens

MAX_CONCURRENT = 64  # requests in flight at once (a turn's episodes)
MAX_N = 64  # choices of one request (serve-model's cap)
GREEDY_BELOW = 1e-5  # a temperature under this decodes greedily on vLLM, where `n` must then be 1
# every sampling field a request could leave to the server, at the value that leaves the distribution
# as the trainer scores it (temperature and top_p are the sampling's own)
NEUTRAL = {"min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "ignore_eos": False, "stop_token_ids": []}


class ServerPolicy:
    """`act` and `complete` of the rollout loop's policy protocol over `/v1/completions`."""

    def __init__(self, base_url: str, model: str, tokenizer, api_key: str | None = None,
                 max_concurrent: int = MAX_CONCURRENT, timeout: float = 600.0, max_model_len: int | None = None):
        from openai import OpenAI

        self.base_url, self.served_model, self.tokenizer = base_url, model, tokenizer
        # (the name requests use, the weights' version it stands for): the served model at version 0,
        # then the latest synced adapter, or the served name again after a full-weight reload
        self.target: tuple[str, int] = (model, 0)
        self.max_concurrent = max_concurrent
        self.api_key = api_key
        self.vocab: int | None = None  # the model's vocabulary size, when known: returned ids must be below it
        self.max_model_len = max_model_len  # prompt + completion tokens the server holds (its /v1/models card)
        self.server: dict = {}  # what the start check found (server_checks.py): kind, version
        self.in_flight: Counter = Counter()  # requests under way, per model name they name
        self.accepting = threading.Event()  # cleared while a full-weight reload holds new requests back
        self.accepting.set()
        self.lock = threading.Condition()
        self.client = OpenAI(base_url=base_url, api_key=api_key or "none", max_retries=1, timeout=timeout)

    @classmethod
    def of(cls, rollout, tokenizer, field: str = "rollout") -> "ServerPolicy":
        """The policy of a stage's `rollout:` config; its key from the variable it names."""
        return cls(rollout.endpoint, rollout.model, tokenizer, api_key=endpoint_api_key(rollout, field),
                   max_model_len=rollout.max_model_len)

    @classmethod
    def checked(cls, rollout, tokenizer, vocab: int) -> "ServerPolicy":
        """`of(rollout)` for a model of `vocab` tokens, its server checked (one line naming the
        endpoint) before anything runs."""
        server = cls.of(rollout, tokenizer)
        server.vocab = vocab
        server.check()
        return server

    @property
    def root_url(self) -> str:
        """The server's own routes (vLLM's /version, /pause, ...) sit beside /v1."""
        return self.base_url.rstrip("/").removesuffix("/v1")

    def check(self) -> None:
        """Fail now, in one line, unless the server serves the model, returns what rollouts need and
        reports log-probs as the trainer computes them (tasks/rollout/server_checks.py)."""
        check_server(self)

    def act(self, episodes: list[int], contexts: list[Context], turn: int, params: SamplingParams,
            seeds: list[int]) -> list[Generation]:
        return self.generate_many([context.ids for context in contexts], params, seeds)

    def generate_many(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int],
                      on_done=None) -> list[Generation]:
        """A completion of each prompt with its seed, `max_concurrent` requests in flight (the server
        batches them); `on_done(count)` as they come back. A run of the same prompt with consecutive
        seeds (a group's samples at their first turn) is one request with `n`: vLLM and serve-model
        sample choice j with seed + j, as the local engine samples row j of the run. Not when greedy:
        vLLM answers 400 to a greedy request with `n` > 1 ("n must be 1 when using greedy sampling"),
        so each greedy completion is a request of its own."""
        greedy = params.temperature is None or params.temperature < GREEDY_BELOW
        runs = seed_runs(prompts, seeds, max_n=1 if greedy else MAX_N)
        done, lock = [0], threading.Lock()

        def one(run: tuple[int, int]) -> list[Generation]:
            first, count = run
            generations = self.generate(prompts[first], seeds[first], params, count)
            if on_done is not None:
                with lock:
                    done[0] += count
                    on_done(done[0])
            return generations

        if len(runs) == 1:
            return one(runs[0])
        with ThreadPoolExecutor(max_workers=min(self.max_concurrent, len(runs))) as pool:
            return [g for generations in pool.map(one, runs) for g in generations]

    def complete(self, prompt: str, params: SamplingParams) -> str:
        """One chat answer to a fresh prompt (an episode's own model call: RLM's `llm_query`), greedy."""
        generation = self.generate(chat_prompt(self.tokenizer, prompt), 0, replace(params, stop=()))[0]
        return self.tokenizer.decode(generation.token_ids, skip_special_tokens=True)

    def generate(self, prompt_ids: list[int], seed: int, params: SamplingParams, n: int = 1) -> list[Generation]:
        """`n` completions of `prompt_ids`, as the local engine returns them: the ids sampled (the end
        token or the one completing a stop string included), their log-probs, the text before the
        stop. With no room left in the server's context: `n` empty completions, cut ("length")."""
        max_tokens = self.room(prompt_ids, params.max_new_tokens)
        if max_tokens < 1:
            return [Generation("", [], [], "length", policy_version=self.target[1]) for _ in range(n)]
        with self.naming() as (model, version):
            response = endpoint_call(self.base_url, self.client, model, lambda: self.client.completions.create(
                model=model, prompt=prompt_ids, n=n, **self.sampling(params, seed, max_tokens)))
        if len(response.choices) != n:
            raise EndpointError(f"{self.base_url}: asked for {n} choices, the answer has {len(response.choices)}")
        reported = (response.model_extra or {}).get("weights_version")  # serve-model, after a full-weight reload
        version = reported if type(reported) is int and reported >= 0 else version
        return [self.generation(choice, params, max_tokens, version)
                for choice in sorted(response.choices, key=lambda c: c.index)]

    def generation(self, choice, params: SamplingParams, max_tokens: int, version: int) -> Generation:
        if choice.finish_reason not in ("stop", "length"):  # abort (a pause, a disconnect), error, repetition
            raise EndpointError(f"{self.base_url}: the server ended a completion with finish_reason "
                                f"{choice.finish_reason!r} (vLLM aborts requests on /pause?mode=abort); it is "
                                "no sample of the policy")
        token_ids, logprobs = returned_tokens(self.base_url, choice, max_tokens, self.vocab)
        text = before_stop(self.tokenizer.decode(token_ids, skip_special_tokens=True), params.stop)
        return Generation(text, token_ids, logprobs, choice.finish_reason, policy_version=version)

    def room(self, prompt_ids: list[int], max_new_tokens: int) -> int:
        """The tokens a completion of `prompt_ids` may have: what was asked, within the server's context."""
        if self.max_model_len is None:
            return max_new_tokens
        return min(max_new_tokens, self.max_model_len - len(prompt_ids))

    @contextmanager
    def naming(self):
        """(model name, version) a request names, counted in flight while it runs."""
        self.accepting.wait()
        with self.lock:
            model, version = self.target
            self.in_flight[model] += 1
        try:
            yield model, version
        finally:
            with self.lock:
                self.in_flight[model] -= 1
                self.lock.notify_all()

    def sampling(self, params: SamplingParams, seed: int, max_tokens: int) -> dict:
        """Every field of the request's sampling, none left to the server's defaults."""
        extra = {"return_token_ids": True, "include_stop_str_in_output": True, "skip_special_tokens": True,
                 "top_k": params.top_k, **NEUTRAL}
        sampling = {"temperature": 0 if params.temperature is None else params.temperature, "top_p": params.top_p,
                    "max_tokens": max_tokens, "seed": seed, "logprobs": 0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0, "stop": list(params.stop), "extra_body": extra}
        return sampling


def seed_runs(prompts: list[list[int]], seeds: list[int], max_n: int = MAX_N) -> list[tuple[int, int]]:
    """(first index, length) of each run of equal prompts whose seeds count up by one, at most `max_n` long."""
    runs: list[tuple[int, int]] = []
    for k, (prompt, seed) in enumerate(zip(prompts, seeds)):
        if runs and prompt == prompts[k - 1] and seed == seeds[k - 1] + 1 and runs[-1][1] < max_n:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((k, 1))
    return runs
