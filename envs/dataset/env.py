"""`dataset`: single-turn tasks from the rows of a prompt-only dataset, scored by reward functions
with TRL's signature (envs/rewards.py has built-ins; a user's `module:function` works unchanged).

The rows come from a dataset stage (`data: STAGE_ID`; `source:` is that stage written inline, the
spec adds it as `<env id>-data`), which every stage using the env then depends on; the stage hands
them over with `use_rows`. The held-out split is `eval_fraction` of the rows (by a hash of the
row's id) or a second dataset (`eval_data`, or `eval_source` inline: `<env id>-eval-data`).

A task is correct when the first reward function scores it 1 (put the success measure first);
formatted unless a function whose name ends in `format` scores it below 1.
"""

from __future__ import annotations

import math

from envs.base import (
    NO_OUTCOME,
    Check,
    EnvFieldError,
    Outcome,
    RewardFunc,
    RewardShapeError,
    Rubric,
    Task,
)
from envs.dataset.config import DatasetEnvConfig, JudgeReward, RewardModelReward
from envs.dataset.reward_modules import load_function, trl_reward
from envs.dataset.rows import RowTasks
from envs.single_turn import SingleTurnEnv


class DatasetEnv(RowTasks, SingleTurnEnv):
    config_class = DatasetEnvConfig

    def __init__(self, config: DatasetEnvConfig, name: str = "dataset"):
        super().__init__(config, name)
        funcs = []
        self.scorers: dict[str, object] = {}  # a learned reward's label -> its scorer (use_scorers)
        for i, reward in enumerate(config.rewards):
            if isinstance(reward, (RewardModelReward, JudgeReward)):
                funcs.append(self.learned_reward(reward))
                continue
            try:
                funcs.append(trl_reward(reward, load_function(reward, config.reward_folder)))
            except ValueError as exc:
                raise EnvFieldError(f"rewards[{i}].function", str(exc)) from None
        formats = [func for func in funcs if func.name.endswith("format")]
        self.rubric = Rubric(funcs, correct=user_check(funcs[:1], not_applied_passes=False),
                             formatted=user_check(formats, not_applied_passes=True))

    def learned_rewards(self) -> list[RewardModelReward | JudgeReward]:
        """The rewards a model gives: a reward model's, a judge's (their scorers come from the stage)."""
        return [reward for reward in self.config.rewards if isinstance(reward, (RewardModelReward, JudgeReward))]

    def use_scorers(self, scorers: dict[str, object]) -> None:
        """The scorer of each learned reward, by its label: `score(prompt, completion, answer)` (one
        value, or an exception naming what went wrong) and `prefetch(items)` (many at once)."""
        self.scorers = dict(scorers)

    def learned_reward(self, reward: RewardModelReward | JudgeReward) -> RewardFunc:
        """The rubric's function of a learned reward: its scorer's value, scored many at once when the
        stage prefetches a batch (Rubric.prefetch)."""
        label = reward.label

        def scorer():
            if label not in self.scorers:
                raise RuntimeError(f"reward {label!r} has no scorer (the stage did not attach it)")
            return self.scorers[label]

        def score(completion: str, task: Task, outcome: Outcome):
            return scorer().score(task.prompt, completion, task.answer)

        def prefetch(items: list[tuple[str, Task]]):
            scorer().prefetch([(task.prompt, completion, task.answer) for completion, task in items])

        return RewardFunc(label, score, reward.weight, prefetch=prefetch)

    def oracle_answer(self, task: Task) -> str:
        return f"The answer is {task.answer}."


def user_check(funcs: list[RewardFunc], not_applied_passes: bool) -> Check:
    """A check over the user's functions: 1 when each gives full marks (or does not apply, where
    that passes), else 0."""
    def check(completion: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
        marks = [_full_marks(func, completion, task, outcome) for func in funcs]
        return float(all(not_applied_passes if mark is None else mark for mark in marks))

    return check


def _full_marks(func: RewardFunc, completion: str, task: Task, outcome: Outcome) -> bool | None:
    """Whether `func` gives the completion 1 or more; None when it does not apply. A function that
    raises gives no marks (the rubric's score reports its error)."""
    try:
        value = func.fn(completion, task, outcome)
    except RewardShapeError:
        raise
    except Exception:  # the user's function: its error is the rubric's to report
        return False
    return None if value is None else math.isfinite(value) and value >= 1.0
