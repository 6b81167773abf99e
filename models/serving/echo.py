"""`echo: true` on /v1/completions, as vLLM answers it: the choice's text starts with the prompt's, and
with `logprobs` its log-probs start with the prompt tokens' (the first token's null, nothing comes
before it), each with its `logprobs` likeliest alternatives and itself (vLLM's top dict always holds
the token taken). `max_tokens: 0` with echo: the prompt alone. What lm-eval's loglikelihood and
multiple-choice requests ask of a completions endpoint."""

from __future__ import annotations

from models.serving.responses import token_text


def prompt_logprobs(model, prompt_ids: list[int], top: int, device) -> tuple[list, list]:
    """Each prompt token's log-prob given the ones before it (None for the first) and, with `top` > 0,
    its alternatives [(token id, log-prob), ...]: the `top` likeliest and the token itself."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids], device=device)).logits[0, :-1].float()
    logps = torch.log_softmax(logits, dim=-1)
    taken = torch.tensor(prompt_ids[1:], device=logps.device)
    values = logps.gather(1, taken[:, None])[:, 0].tolist()
    alternatives = []
    if top:
        best_values, best_ids = logps.topk(min(top, logps.shape[-1]), dim=-1)
        for token, value, ids, scores in zip(prompt_ids[1:], values, best_ids.tolist(), best_values.tolist()):
            pairs = dict(zip(ids, scores))
            pairs.setdefault(token, value)
            alternatives.append(list(pairs.items()))
    return [None, *values], [None, *alternatives] if top else []


def echoed_logprobs(tokenizer, prompt_ids: list[int], logprobs: list, top: list, generated: dict | None,
                    as_ids: bool) -> dict:
    """OpenAI's legacy log-probs of the prompt's tokens, then of the generated ones (`generated`, the
    completion's own log-probs; None when nothing was generated), offsets running on through both."""
    texts = [token_text(tokenizer, i, as_ids) for i in prompt_ids]
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    tops = [None if alternatives is None else {token_text(tokenizer, i, as_ids): v for i, v in alternatives}
            for alternatives in top] if top else None
    if not generated or not generated["tokens"]:
        return {"tokens": texts, "token_logprobs": logprobs, "text_offset": offsets, "top_logprobs": tops}
    return {"tokens": texts + generated["tokens"], "token_logprobs": logprobs + generated["token_logprobs"],
            "text_offset": offsets + [at + offset for offset in generated["text_offset"]],
            "top_logprobs": tops + generated["top_logprobs"] if tops is not None and generated["top_logprobs"]
            else tops}


def echo_choices(served, request, job, prompts: list[list[int]], choices: list[dict]) -> None:
    """Each choice of a finished echo request with its prompt before it (in place): the prompt's text,
    with `logprobs` its tokens' log-probs (computed here, between two batches of the engine, on the
    weights the job decoded with); with `max_tokens` 0 the prompt alone."""
    asked = request.logprobs
    scored = []
    if asked is not None:
        with served.batcher.engine, served.adapters.active(served.model, job.adapter):
            scored = [prompt_logprobs(served.model, ids, asked, served.device) for ids in prompts]
    given = request.prompts()
    prompt_only = request.max_tokens == 0
    for choice in choices:
        p = choice["index"] // request.n
        text = given[p] if isinstance(given[p], str) else served.tokenizer.decode(prompts[p])
        choice["text"] = text if prompt_only else text + choice["text"]
        if prompt_only:
            choice["finish_reason"] = "length"
            if "token_ids" in choice:
                choice["token_ids"] = []
        if scored:
            logprobs, top = scored[p]
            choice["logprobs"] = echoed_logprobs(served.tokenizer, prompts[p], logprobs, top,
                                                 None if prompt_only else choice["logprobs"],
                                                 request.return_tokens_as_token_ids)
