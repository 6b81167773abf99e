"""The answers `posttrain serve-model` sends: OpenAI's chat.completion and text_completion shapes,
their log-probs, vLLM's returned token ids, and the server-sent event framing (a streamed answer's
events: models/serving/stream.py)."""

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
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"  # "chat...": a chat answer or its chunks
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model}


def sse(event: dict | str) -> bytes:
    return f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode()

