"""Doom-loop detection: a generation that repeats itself and never reaches its end.

Definition used throughout posttrain (DOMAIN.md leaves the exact detector open):
a completion is a doom loop when it was cut off by the token budget (finish reason
`length`) AND its tail is periodic — some unit of 1..`max_period` characters repeated at
least `min_repeats` times back to back — or at least `max_repeated_fraction` of its word
4-grams are repeats. A completion that reaches its end (stop/EOS) is never a doom loop,
however repetitive; the rubric handles that case (e.g. several final answers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_THINK_TAG = re.compile(r"</?think>")


@dataclass(frozen=True)
class DoomLoopDetector:
    min_repeats: int = 3
    max_period: int = 128
    tail_chars: int = 1024
    min_loop_chars: int = 12
    ngram: int = 4
    max_repeated_fraction: float = 0.5

    def tail_repeats(self, text: str) -> float:
        """Most back-to-back copies of one unit at the end of `text` (1.0 = no repetition)."""
        tail = text[-self.tail_chars:]
        best = 1.0
        for period in range(1, min(self.max_period, len(tail) // 2) + 1):
            run = _periodic_suffix(tail, period)
            if run + period >= self.min_loop_chars:
                best = max(best, (run + period) / period)
        return best

    def is_loop(self, text: str, truncated: bool) -> bool:
        if not truncated:
            return False
        if self.tail_repeats(text) >= self.min_repeats:
            return True
        return repeated_ngram_fraction(text.split(), self.ngram) >= self.max_repeated_fraction


def _periodic_suffix(text: str, period: int) -> int:
    """Largest r with text[-r:] == text[-r - period:-period] (monotone in r: binary search)."""
    low, high = 0, len(text) - period
    while low < high:
        mid = (low + high + 1) // 2
        if text[len(text) - mid:] == text[len(text) - mid - period:len(text) - period]:
            low = mid
        else:
            high = mid - 1
    return low


def repeated_ngram_fraction(words: list[str], n: int) -> float:
    """Share of word n-grams that already occurred earlier in the sequence."""
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def repetition_excess(text: str, n: int, threshold: float) -> float:
    """Anti-doom shaping term in [0, 1] (used with a negative weight): with f the share of
    repeated word n-grams, (f − threshold) / (1 − threshold) when f > threshold, else 0."""
    repeated = repeated_ngram_fraction(text.split(), n)
    return max(0.0, repeated - threshold) / (1.0 - threshold)


def trace_is_valid(text: str, truncated: bool) -> bool:
    """Reasoning-trace validation: the trajectory reached its end, every <think> block is
    closed before the next opens, and something (the answer) follows the last one."""
    if truncated:
        return False
    depth = 0
    for tag in _THINK_TAG.findall(text):
        depth += 1 if tag == "<think>" else -1
        if depth not in (0, 1):
            return False
    if depth:
        return False
    return "</think>" not in text or bool(text.rsplit("</think>", 1)[1].strip())


def overlong_excess(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO soft overlong term in [0, 1] (used with a negative weight): 0 up to max_tokens − buffer,
    rising linearly to 1 at max_tokens (an action cut by the budget gets 1)."""
    return min(1.0, max(0.0, (length - (max_tokens - buffer)) / buffer))
