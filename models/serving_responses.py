"""The answers `posttrain serve-model` sends: OpenAI's chat.completion and text_completion shapes,
their log-probs, vLLM's returned token ids, and the server-sent events of a streamed answer.

A streamed answer is the non-streamed one cut into one event per generated token: the deltas'
text joins into the same text (stop strings cut the same way), the log-probs and token ids are the
same, and the last event of a choice carries its finish_reason.
"""

from __future__ import annotations

import json
import time
import uuid

from models.sampling import Generation


def token_text(tokenizer, token_id: int, as_ids: bool = False) -> str:
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id])


def completion_logprobs(tokenizer, generation: Generation, as_ids: bool, tokens: slice = slice(None)) -> dict:
    """OpenAI's completions log-probs (legacy shape) of the generated tokens in `tokens`."""
    ids = generation.token_ids[tokens]
    texts = [token_text(tokenizer, i, as_ids) for i in ids]
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    top = generation.top_logprobs[tokens] if generation.top_logprobs else None
    return {"tokens": texts, "token_logprobs": generation.logprobs[tokens], "text_offset": offsets,
            "top_logprobs": [{token_text(tokenizer, i, as_ids): v for i, v in alternatives} for alternatives in top]
            if top is not None else None}


def chat_logprobs(tokenizer, generation: Generation, tokens: slice = slice(None)) -> dict:
    """OpenAI's chat log-probs: per generated token its text, bytes, log-prob and alternatives."""

    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    top = generation.top_logprobs[tokens] if generation.top_logprobs else None
    content = []
    for k, (token_id, logprob) in enumerate(zip(generation.token_ids[tokens], generation.logprobs[tokens])):
        content.append({**entry(token_id, logprob),
                        "top_logprobs": [entry(i, v) for i, v in top[k]] if top is not None else []})
    return {"content": content}


def usage(prompt_tokens: int, generations: list[Generation]) -> dict:
    completion_tokens = sum(len(g.token_ids) for g in generations)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(kind: str, model: str) -> dict:
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model}


def text_deltas(tokenizer, token_ids: list[int], text: str) -> list[str]:
    """`text` (the answer's text: the decoded tokens, cut at a stop string) as one delta per token:
    token k's delta is what the first k+1 tokens' text adds to the part of `text` already sent, so
    the deltas join into exactly `text`, and a token that completes no character sends ""."""
    deltas, sent = [], 0
    for k in range(len(token_ids)):
        so_far = tokenizer.decode(token_ids[:k + 1], skip_special_tokens=True)
        agreed = sent
        while agreed < min(len(so_far), len(text)) and so_far[agreed] == text[agreed]:
            agreed += 1
        if so_far.endswith("\ufffd"):  # half a character: wait for the rest
            agreed = min(agreed, len(so_far) - 1)
        deltas.append(text[sent:max(agreed, sent)])
        sent = max(agreed, sent)
    if deltas:
        deltas[-1] += text[sent:]
    return deltas or [text]


def sse(event: dict | str) -> bytes:
    return f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode()
