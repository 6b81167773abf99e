"""How the fake decodes a completion request: the project's own engine samples (token ids, stop
strings, one seed per choice, as vLLM's parallel sampling seeds choice j with seed + j), and the
log-probs are recomputed by one forward pass over prompt and completion in the server's
`--logprobs-mode`: `raw_logprobs` (vLLM's default) before temperature and top-k/top-p,
`processed_logprobs` after them (masked tokens -9999.0, as vLLM clamps -inf)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from fake_vllm.protocol import CompletionRequest, Sampling, VllmError

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
CLAMPED = -9999.0


@dataclass
class Choice:
    token_ids: list[int]
    text: str
    finish_reason: str  # stop | length | abort
    stop_reason: str | None
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]


def decode(model, tokenizer, prompt: list[int], sampling: Sampling, request: CompletionRequest, mode: str,
           aborted=lambda: False) -> list[Choice]:
    """`sampling.n` choices of `prompt`; `aborted()` asked every step (a /pause?mode=abort)."""
    from models.sampling import SamplingParams, generate_tokens

    if not sampling.neutral_penalties:
        raise VllmError(501, f"the fake vLLM server decodes without min_p and penalties, got {sampling}",
                        "NotImplementedError")
    params = SamplingParams(sampling.max_tokens, None if sampling.greedy else sampling.temperature, sampling.top_p,
                            sampling.top_k, sampling.stop)
    seed = sampling.seed if sampling.seed is not None else random.randrange(2**31)
    generations = generate_tokens(model, tokenizer, [prompt] * sampling.n, params,
                                  row_seeds=[seed + j for j in range(sampling.n)],
                                  abandoned=lambda: set(range(sampling.n)) if aborted() else set())
    was_aborted = aborted()
    choices = []
    for generation in generations:
        logprobs, tops = scored(model, prompt, generation.token_ids, sampling, mode, request.logprobs or 0)
        text, stop_reason = choice_text(tokenizer, generation.token_ids, sampling.stop, request)
        finish = "abort" if was_aborted else "stop" if generation.finish_reason == "stop" else "length"
        choices.append(Choice(generation.token_ids, text, finish, stop_reason if finish == "stop" else None,
                              logprobs, tops))
    return choices


def choice_text(tokenizer, token_ids: list[int], stop: tuple[str, ...], request: CompletionRequest):
    """The detokenized text, cut at the first stop string (kept with include_stop_str_in_output), and
    that string (the stop reason; None at the end token)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=request.skip_special_tokens)
    hits = [(text.find(s), s) for s in stop if s in text]
    if not hits:
        return text, None
    index, string = min(hits)
    return text[:index + len(string)] if request.include_stop_str_in_output else text[:index], string


def scored(model, prompt: list[int], completion: list[int], sampling: Sampling, mode: str, top: int):
    """Each completion token's log-prob in `mode`, and the `top` likeliest tokens at each position
    (the sampled one always among them)."""
    import torch

    if not completion:
        return [], []
    with torch.no_grad():
        ids = torch.tensor([prompt + completion], device=model.device)
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    logprobs = distribution(logits, sampling, mode)
    chosen = torch.tensor(completion, device=logits.device)
    values = logprobs.gather(-1, chosen[:, None])[:, 0].clamp(min=CLAMPED).tolist()
    tops = []
    if top:
        best_values, best_ids = logprobs.topk(top, dim=-1)
        for position, token in enumerate(completion):
            entry = {int(i): max(float(v), CLAMPED) for i, v in zip(best_ids[position], best_values[position])}
            entry[token] = values[position]
            tops.append(entry)
    return values, tops


def distribution(logits, sampling: Sampling, mode: str):
    """The log-probabilities vLLM reports: raw, or after temperature (not for a greedy request) and
    top-k / top-p, renormalized over the tokens kept."""
    import torch

    if mode == "raw_logprobs" or sampling.greedy:
        return torch.log_softmax(logits, dim=-1)
    scaled = torch.log_softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_k > 0:
        kth = scaled.topk(min(sampling.top_k, scaled.size(-1)), dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, -float("inf"))
    if sampling.top_p < 1.0:
        ordered, order = scaled.sort(dim=-1, descending=True)
        probs = ordered.exp()
        outside = probs.cumsum(-1) - probs > sampling.top_p
        scaled = scaled.scatter(-1, order, ordered.masked_fill(outside, -float("inf")))
    return torch.log_softmax(scaled, dim=-1)
