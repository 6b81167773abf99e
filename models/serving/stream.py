"""Streamed answers of `posttrain serve-model` (`stream: true`): server-sent events as the engine draws.

The engine thread records each streamed row's tokens as they are drawn (models/serving/batch.py) and
wakes the request's event loop; every wake sends, per choice, what its text grew by and the new
tokens' log-probs and ids. A choice's text is held back where it could still change: characters
that could be the start of a stop string, a character its tokens have only half written, trailing
whitespace (a tokenizer's clean-up may drop it before punctuation). The last event of a choice
flushes the rest of the answer's own text with its finish_reason, so the deltas join into exactly
the non-streamed text. Then usage when asked (`stream_options.include_usage`), then `[DONE]`.
"""

from __future__ import annotations

from models.sampling import Generation, before_stop
from models.serving.requests import ChatRequest
from models.serving.responses import chat_logprobs, completion_logprobs


def provisional(tokenizer, token_ids: list[int], stop: tuple[str, ...]) -> str:
    """The part of a still-decoding row's text that its next tokens cannot change."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    if any(s in text for s in stop):
        return before_stop(text, stop)
    hold = max((len(s) - 1 for s in stop), default=0)
    text = text[:len(text) - hold] if hold else text
    return text.rstrip().removesuffix("\ufffd").rstrip()


class ChoiceStream:
    """One choice's progress: the text and tokens already sent."""

    def __init__(self, index: int, row: int):
        self.index, self.row = index, row
        self.text, self.tokens, self.finished = "", 0, False

    def grow(self, text: str) -> str:
        """The delta from what was sent to `text`, when `text` goes on from it (else nothing yet)."""
        if not text.startswith(self.text):
            return ""
        delta, self.text = text[len(self.text):], text
        return delta


def stream_chunks(served, request, job, head: dict, streams: list[ChoiceStream], final: bool):
    """The chunks of one wake: for each choice with new text or tokens, what it grew by; with `final`
    (the job is done) each choice's last chunk, with the rest of its text and its finish_reason."""
    chat = isinstance(request, ChatRequest)
    kind = "chat.completion.chunk" if chat else "text_completion"
    generations = served.choices(request, job) if final else None
    for stream in streams:
        if stream.finished:
            continue
        drawn = job.drawn[stream.row]
        if final:
            generation = generations[stream.index]
            delta = stream.grow(served.text(request, job, generation))
        else:
            generation = Generation("", [t for t, _, _ in drawn], [lp for _, lp, _ in drawn],
                                    top_logprobs=[top for _, _, top in drawn] if job.params.top_logprobs else [])
            delta = stream.grow(provisional(served.tokenizer, generation.token_ids, job.params.stop))
        tokens = slice(stream.tokens, len(generation.token_ids))
        if not delta and tokens.start == tokens.stop and not final:
            continue
        stream.tokens, stream.finished = tokens.stop, final
        part = {"index": stream.index, "finish_reason": generation.finish_reason if final else None}
        if chat:
            part |= {"delta": {"content": delta} if delta or not final else {},
                     "logprobs": chat_logprobs(served.tokenizer, generation, tokens) if request.logprobs else None}
        else:
            part |= {"text": delta, "logprobs": completion_logprobs(
                served.tokenizer, generation, request.return_tokens_as_token_ids, tokens)
                if request.logprobs is not None else None}
        if request.return_token_ids:
            part["token_ids"] = generation.token_ids[tokens]
        yield {**head, "object": kind, "choices": [part]}


def choice_streams(request, job) -> list[ChoiceStream]:
    """Choice i of prompt p reads row p·copies + i (one row per prompt when greedy: its choices are one)."""
    prompts = len(job.prompts) // job.copies
    return [ChoiceStream(p * request.n + i, p * job.copies + (i if job.copies > 1 else 0))
            for p in range(prompts) for i in range(request.n)]
