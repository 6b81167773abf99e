"""A rollout backend as a third-party package would ship it: a config class declared through the
`posttrain.rollouts` entry-point group, whose policy every stage with a `rollout:` field plays through.

`constant` answers every turn with the same text: the smallest policy the episode loop accepts.
`write_toy_backend(folder)` installs it the way pip would (tests/toy_stage.py: write_package).
"""

from __future__ import annotations

from pathlib import Path

from toy_stage import write_package

TOY_BACKEND = '''"""`constant`: a rollout backend whose policy answers every turn with `answer`."""

from typing import Literal

from models.sampling import Generation
from tasks.rollout.backends import RolloutBackend
from tasks.rollout.episodes import ended_ids


class ConstantPolicy:
    def __init__(self, tokenizer, answer: str):
        self.tokenizer, self.answer = tokenizer, answer

    def act(self, episodes, contexts, turn, params, seeds):
        return self.generate_many([context.ids for context in contexts], params, seeds)

    def generate_many(self, prompts, params, seeds, on_done=None):
        ids = ended_ids(self.tokenizer, self.answer, params.stop)
        generations = [Generation(self.answer, list(ids), [0.0] * len(ids), "stop") for _ in prompts]
        if on_done is not None:
            on_done(len(prompts))
        return generations

    def complete(self, prompt, params):
        return self.answer


class ConstantRollout(RolloutBackend):
    backend: Literal["constant"]
    answer: str

    def policy(self, folder, tokenizer, ctx, batch_size=64):
        return ConstantPolicy(tokenizer, self.answer)

    def trainer_policy(self, model, tokenizer, batch_size):
        return ConstantPolicy(tokenizer, self.answer)
'''


def write_toy_backend(folder: Path) -> Path:
    return write_package(folder, "toy_rollouts", TOY_BACKEND,
                         "[posttrain.rollouts]\nconstant = toy_rollouts:ConstantRollout\n")
