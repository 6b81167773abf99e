"""The start check of a rollout server (`ServerPolicy.check`, at stage start and in `posttrain
validate --check-endpoints`), each failure one line naming the endpoint and what to change.

- It serves the model, and answers a token-id prompt with the ids it sampled and their log-probs.
- Its context length: the spec's `rollout.max_model_len`, else the model's /v1/models card
  (vLLM's `max_model_len`); requests then never ask for more than the context has left.
- Its log-probs are the trainer's: after temperature. vLLM reports them before it by default
  (`--logprobs-mode raw_logprobs`). One token's two likeliest log-probs at temperature 1 and 0.5
  tell them apart: raw gaps stay as they are, processed ones double. Logits (the `*_logits` modes)
  are no log-probs at all: positive, or more than all the mass.
- Whether it has sampling defaults of its own (vLLM: the model's generation_config, e.g. Qwen3's
  top_k 20): a request that leaves the fields out decodes from another distribution than one that
  sets them. Every rollout request sets every field, so they never apply; the check says so.
- What it is: vLLM answers /version (full-weight sync differs: tasks/rollout/weight_sync.py, and
  gates on the version). A vLLM server that is paused (its /is_paused, a development route) is
  refused at once: every request would wait for a /resume, and a weight sync leaves a server paused
  only when its weights may be mixed.
"""

from __future__ import annotations

import itertools
import math

from models.sampling import SamplingParams
from tasks.rollout.endpoint_policy import EndpointError, endpoint_call

PROBE_PROMPT = [0]
NEEDS = "token ids and log-probs (vLLM >= 0.10.2: return_token_ids; or posttrain serve-model)"
PROCESSED_FLAG = "start vLLM with --logprobs-mode processed_logprobs"


def check_server(policy) -> None:
    """Check `policy`'s server (a ServerPolicy) and record what was found in `policy.server`."""
    version = vllm_version(policy)
    policy.server = {"kind": "vllm", "version": version} if version else {"kind": "other"}
    if version:
        refuse_paused(policy)
    at_one = probe(policy, SamplingParams(1, temperature=1.0))
    not_logits(policy, at_one)
    returned_tokens(policy.base_url, at_one, 1)
    if policy.max_model_len is None:
        policy.max_model_len = card_max_model_len(policy)
    at_half = probe(policy, SamplingParams(1, temperature=0.5))
    after_temperature(policy, tops(at_one), tops(at_half))
    policy.server["own_defaults"] = tops(probe(policy, None)) != tops(at_one)


def probe(policy, params):
    """The first choice of a one-token completion of PROBE_PROMPT with its two likeliest tokens'
    log-probs; `params` None: a request that sets no sampling field but the temperature."""
    model = policy.target[0]
    fields = {"max_tokens": 1, "seed": 0, "logprobs": 2,
              "extra_body": {"return_token_ids": True, "return_tokens_as_token_ids": True}}
    if params is None:
        fields["temperature"] = 1.0
    else:
        fields = {**policy.sampling(params, 0, 1), "logprobs": 2}
        fields["extra_body"] = {**fields["extra_body"], "return_tokens_as_token_ids": True}
    response = endpoint_call(policy.base_url, policy.client, model, lambda: policy.client.completions.create(
        model=model, prompt=PROBE_PROMPT, **fields))
    if not response.choices:
        raise EndpointError(f"{policy.base_url}: the answer has no choices")
    return response.choices[0]


def tops(choice) -> dict[str, float]:
    entries = getattr(choice.logprobs, "top_logprobs", None) if choice.logprobs is not None else None
    return dict(entries[0]) if entries and isinstance(entries[0], dict) else {}


def not_logits(policy, choice) -> None:
    values = [v for v in tops(choice).values() if isinstance(v, (int, float))]
    if any(v > 0 for v in values) or sum(math.exp(min(v, 50.0)) for v in values) > 1.001:
        raise EndpointError(f"{policy.base_url}: the server reports logits, not log-probs; the trainer needs "
                            f"log-probs after temperature: {PROCESSED_FLAG}")


def after_temperature(policy, at_one: dict[str, float], at_half: dict[str, float]) -> None:
    """Refuse log-probs that do not follow the temperature sent (raw ones, or a server overriding it)."""
    shared = sorted((token for token in at_one if token in at_half), key=lambda token: -at_one[token])
    if len(shared) < 2 or at_one[shared[0]] - at_one[shared[1]] < 1e-3:
        return  # a tie at the top: nothing to compare (the served model decides, not the server)
    ratio = (at_half[shared[0]] - at_half[shared[1]]) / (at_one[shared[0]] - at_one[shared[1]])
    if abs(ratio - 1) < 0.1:
        raise EndpointError(f"{policy.base_url}: the server's log-probs are raw (before temperature); the "
                            f"trainer's are after it: {PROCESSED_FLAG}")
    if abs(ratio - 2) > 0.1:
        raise EndpointError(f"{policy.base_url}: the server's log-probs do not follow the temperature sent (gaps "
                            f"x{ratio:.2f} at temperature 0.5, x2 expected); the trainer's are after temperature "
                            f"alone: {PROCESSED_FLAG}")


def card_max_model_len(policy) -> int | None:
    """The served model's context length from its /v1/models card (vLLM lists it; None where not)."""
    cards = endpoint_call(policy.base_url, policy.client, policy.served_model, lambda: policy.client.models.list())
    for card in cards.data:
        value = (card.model_extra or {}).get("max_model_len")
        if card.id == policy.served_model and type(value) is int and value > 0:
            return value
    return None


def vllm_version(policy) -> str | None:
    """vLLM's version from its /version route; None from a server without one (serve-model)."""
    import httpx

    try:
        response = httpx.get(f"{policy.root_url}/version", timeout=30,
                             headers={"Authorization": f"Bearer {policy.api_key}"} if policy.api_key else {})
        version = response.json().get("version") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return version if isinstance(version, str) else None


def refuse_paused(policy) -> None:
    """A paused vLLM server in one line (a server without the development routes is never paused)."""
    import httpx

    try:
        response = httpx.get(f"{policy.root_url}/is_paused", timeout=30,
                             headers={"Authorization": f"Bearer {policy.api_key}"} if policy.api_key else {})
        paused = response.status_code == 200 and response.json().get("is_paused") is True
    except (httpx.HTTPError, ValueError, AttributeError):
        return  # unreachable: the probes below say so
    if paused:
        raise EndpointError(f"{policy.base_url}: the server is paused (GET /is_paused): a weight sync that failed "
                            "part way leaves it so, its weights possibly mixed; restart it (or POST /resume if its "
                            "weights are whole)")


def vllm_at_least(version: str | None, minimum: tuple[int, ...]) -> bool:
    """Whether a vLLM version string (\"0.15.1\", \"0.16.0rc1.dev12+g0a1b2c\") is at least `minimum`."""
    numbers = []
    for part in (version or "").split(".")[:len(minimum)]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        numbers.append(int(digits))
    return bool(numbers) and tuple(numbers + [0] * (len(minimum) - len(numbers))) >= minimum


def described(policy) -> str:
    """What the check found, for `validate --check-endpoints`."""
    server = policy.server
    parts = [f"vLLM {server['version']}" if server.get("kind") == "vllm" else "not vLLM (serve-model or another)",
             f"max_model_len {policy.max_model_len}" if policy.max_model_len else "context length not reported",
             "log-probs after temperature"]
    if server.get("own_defaults"):
        parts.append("its own sampling defaults (never applied: each request sets every field)")
    return ", ".join(parts)


def returned_tokens(base_url: str, choice, max_tokens: int, vocab: int | None = None) -> tuple[list[int], list[float]]:
    """The generated ids and their log-probs of an answer's choice, checked: a server (hostile or just
    another kind) that returns neither, mismatched ones, more than `max_tokens` or ids outside the
    vocabulary (`vocab`, when known) is an EndpointError, never a guessed row."""
    token_ids = (choice.model_extra or {}).get("token_ids")
    logprobs = getattr(choice.logprobs, "token_logprobs", None) if choice.logprobs is not None else None
    if not isinstance(token_ids, list) or not all(type(i) is int and i >= 0 for i in token_ids):
        raise EndpointError(f"{base_url}: the answer has no generated token ids; rollouts need {NEEDS}")
    if len(token_ids) > max_tokens or (vocab is not None and any(i >= vocab for i in token_ids)):
        raise EndpointError(f"{base_url}: the answer's token ids are not a completion of this model "
                            f"({len(token_ids)} ids for max_tokens {max_tokens}, vocabulary {vocab})")
    if not isinstance(logprobs, list) or len(logprobs) != len(token_ids) or not all(
            isinstance(v, (int, float)) and not math.isnan(v) and v <= 0 for v in logprobs):
        raise EndpointError(f"{base_url}: the answer has no log-prob for each generated token; rollouts need {NEEDS}")
    return token_ids, [float(v) for v in logprobs]
