"""Built-in reward functions with TRL's `reward_funcs` signature, for the dataset env (also
addressed as `posttrain.rewards:<name>` in a spec):

    fn(prompts, completions, completion_ids, **columns) -> list[float | None]

`completions` are strings, or (conversational data) lists holding the assistant's message; each
extra column of the dataset (`answer`, ...) comes as a keyword holding one value per completion.
None means "does not apply" (a row without an answer)."""

from __future__ import annotations

import re
import string

_ANSWER_IS = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*(.+)", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_HASHES = re.compile(r"####\s*(.+)")
_THINK = re.compile(r"\s*<think>.*?</think>\s*\S", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
LENGTH_SCALE = 1024  # tokens at which length_penalty reaches 1


def text_of(completion) -> str:
    """A completion's text: the string, or the content of its (last) message."""
    if isinstance(completion, str):
        return completion
    return str(completion[-1].get("content") or "") if completion else ""


def normalize(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (SQuAD's answer normalisation)."""
    text = "".join(ch for ch in str(text).lower() if ch not in string.punctuation)
    return " ".join(_ARTICLES.sub(" ", text).split())


def final_answer(text: str) -> str:
    """What a completion gives as its answer: the last \\boxed{}, else what follows `####` or
    "answer is", else the whole text."""
    for pattern in (_BOXED, _HASHES, _ANSWER_IS):
        found = pattern.findall(text)
        if found:
            return found[-1].strip().splitlines()[0] if found[-1].strip() else ""
    return text


def _numeric(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip().rstrip("."))
    except ValueError:
        return None


def exact_match(prompts, completions, completion_ids=None, answer=None, **columns) -> list[float | None]:
    """1 when the completion's final answer equals the `answer` column after normalisation."""
    answers = answer or [None] * len(completions)
    return [None if want is None else float(normalize(final_answer(text_of(c))) == normalize(want))
            for c, want in zip(completions, answers)]


def math_answer(prompts, completions, completion_ids=None, answer=None, **columns) -> list[float | None]:
    """1 when the final answer (\\boxed{} or after ####) equals `answer` as a number (or, not a
    number, as normalised text)."""
    answers = answer or [None] * len(completions)
    scores = []
    for completion, want in zip(completions, answers):
        if want is None:
            scores.append(None)
            continue
        got = final_answer(text_of(completion))
        got_number, want_number = _numeric(got), _numeric(str(want))
        same = abs(got_number - want_number) < 1e-6 if got_number is not None and want_number is not None \
            else normalize(got) == normalize(want)
        scores.append(float(same))
    return scores


def think_format(prompts, completions, completion_ids=None, **columns) -> list[float]:
    """1 when the completion reasons in one <think>...</think> block, then answers."""
    return [float(bool(_THINK.match(text_of(c))) and text_of(c).count("<think>") == 1) for c in completions]


def answer_format(prompts, completions, completion_ids=None, **columns) -> list[float]:
    """1 when the completion states a final answer (\\boxed{}, ####, or "the answer is")."""
    return [float(any(p.search(text_of(c)) for p in (_BOXED, _HASHES, _ANSWER_IS))) for c in completions]


def length_penalty(prompts, completions, completion_ids=None, **columns) -> list[float]:
    """The completion's length in tokens over LENGTH_SCALE, capped at 1 (give it a negative weight)."""
    lengths = [len(ids) if ids is not None else len(text_of(c).split()) for c, ids in
               zip(completions, completion_ids or [None] * len(completions))]
    return [min(1.0, n / LENGTH_SCALE) for n in lengths]
