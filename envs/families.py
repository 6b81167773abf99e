"""What the generated task families of the envs share: made-up words split into a train and a
held-out pool, the distinct words of one variant, and the `generated:` config of an env.

A word is held out by its crc32, so a held-out variant, named and filled with held-out words,
shares no name or content word with any train variant, on every machine.
"""

from __future__ import annotations

import random
import zlib
from functools import lru_cache
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field

from envs.base import Task

ONSETS = "b br d dr f g gr k kl l m n p pr s sk st t tr v z".split()
VOWELS = "a e i o u".split()
CODAS = ["", "", "n", "r", "l", "s", "k", "m"]
HELD_OUT_SHARE = 5  # one made-up word in HELD_OUT_SHARE belongs to the held-out pool
EXTENSIONS = ["txt", "md", "log", "csv", "dat", "cfg", "bak", "ini"]
# shell words and the words of the families' instructions: a made-up name is none of them
RESERVED = set(EXTENSIONS) | set("""
ls cat cut sed tr wc sort head tail mv cp grep find echo bash test done for do in if fi set tee uniq then else
run one shell command per turn write when finished the are line lines file files take keep last first its has
but fix sorted number words three print should typo copy named under header column without edit place every
same name ending rename largest holds distinct alphabetical order contain many how there them replace with
somewhere output memory search read move into change remember this what is to of and saved wrote moved
count reply tool tools task""".split())


@lru_cache(maxsize=None)
def word_pool(split: str) -> tuple[str, ...]:
    """The made-up words of a split (`train` or `eval`): disjoint, deterministic, lowercase."""
    draw, words = random.Random("terminal-words"), set()
    while len(words) < 4000:
        stem = "".join(draw.choice(ONSETS) + draw.choice(VOWELS) for _ in range(draw.choice((1, 2, 2))))
        words.add(stem + draw.choice(CODAS))
    held_out = {word for word in words if zlib.crc32(word.encode()) % HELD_OUT_SHARE == 0}
    chosen = held_out if split == "eval" else words - held_out
    return tuple(sorted(word for word in chosen if len(word) >= 3 and word not in RESERVED))


class Words:
    """Distinct words of one pool for one variant."""

    def __init__(self, draw: random.Random, pool: tuple[str, ...]):
        self.draw, self.pool, self.used = draw, pool, set()

    def __call__(self) -> str:
        while True:
            word = self.draw.choice(self.pool)
            if word not in self.used and not any(word in other or other in word for other in self.used):
                self.used.add(word)  # no word inside another: grep, sed and graders match substrings
                return word

    def some(self, n: int) -> list[str]:
        return [self() for _ in range(n)]


def variant_words(family: str, split: str, index: int, seed: int) -> tuple[random.Random, Words]:
    """The seeded draw and the word source of variant `index` of a family: the same on every machine."""
    draw = random.Random(f"{family}:{split}:{seed}:{index}")
    return draw, Words(draw, word_pool(split))


class GeneratedTasks(BaseModel):
    """An env's tasks drawn from its generated families instead of its task files; each env's
    subclass names its families."""

    model_config = ConfigDict(extra="forbid")

    train: int = Field(200, ge=1, le=10000)  # variants of each family to train on
    eval: int = Field(10, ge=1, le=1000)  # held-out variants of each family (held-out words)
    seed: int = Field(0, ge=0)

    def catalogue(self, make: Callable[[str, str, int, int], Task]) -> list[Task]:
        """Every variant: `make(family, split, index, seed)` for each family, train then eval."""
        return [make(family, split, index, self.seed) for family in self.families
                for split, count in (("train", self.train), ("eval", self.eval)) for index in range(count)]
