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

import importlib
import math
import os
import sys
import zlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from data_contracts.formats import plain
from envs.base import (
    NO_OUTCOME,
    EnvBase,
    EnvFieldError,
    Outcome,
    RewardFunc,
    RewardShapeError,
    Rubric,
    SingleTurn,
    SubPolicy,
    Task,
    check_split,
)
from models.sampling import CONVERSATION_PREFIX, prompt_turns

BUILTIN_REWARDS = "posttrain.rewards"  # how a spec names envs/rewards.py
FUNCTION = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"


class RewardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    function: str = Field(pattern=FUNCTION)  # module:function, importable from the working folder or a package
    weight: float = 1.0  # 0: a logged metric only

    @property
    def name(self) -> str:
        return self.function.split(":")[1]

    @property
    def module(self) -> str:
        module = self.function.split(":")[0]
        return "envs.rewards" if module == BUILTIN_REWARDS else module


class DatasetEnvConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["dataset"]
    data: str | None = None  # a dataset stage of prompts (set by the spec when `source` is given)
    source: str | None = None  # the dataset stage's options, inline
    split: str | None = None
    columns: dict[str, str] = {}
    limit: int | None = Field(None, gt=0)
    shuffle_seed: int | None = None
    eval_fraction: float = Field(0.1, ge=0, lt=1)
    eval_data: str | None = None
    eval_source: str | None = None
    rewards: list[RewardConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_source(self):
        if self.data is None and self.source is None:
            raise ValueError("give the rows as `data: STAGE_ID` or `source: PATH`")
        if self.eval_data is not None and self.eval_source is not None:
            raise ValueError("give the held-out rows as `eval_data` or `eval_source`, not both")
        return self


def load_function(reward: RewardConfig):
    """The reward function a spec names, importable from the working folder or an installed package;
    ValueError (one line) when it does not import or is not callable."""
    if os.getcwd() not in sys.path:  # a console script's path starts at its own folder, not the working one
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(reward.module)
    except Exception as exc:  # the user's module: any import error is its own
        raise ValueError(f"{reward.function}: cannot import {reward.module} "
                         f"({type(exc).__name__}: {exc})".splitlines()[0]) from None
    fn = getattr(module, reward.name, None)
    if not callable(fn):
        raise ValueError(f"{reward.function}: {reward.module} has no function {reward.name}")
    return fn


def trl_reward(reward: RewardConfig, fn) -> RewardFunc:
    """A TRL-style batch function as one of the rubric's per-completion functions: called with one
    completion, its prompt and ids, and the row's extra columns; None (does not apply) passes on."""
    def score(completion: str, task: Task, outcome: Outcome, completion_ids=None):
        conversational = isinstance(task.info.get("prompt_turns"), list)
        prompt = task.info["prompt_turns"] if conversational else task.prompt
        answer = [{"role": "assistant", "content": completion}] if conversational else completion
        values = fn(prompts=[prompt], completions=[answer], completion_ids=[completion_ids],
                    **{column: [value] for column, value in task.info["columns"].items()})
        if not isinstance(values, (list, tuple)) or len(values) != 1:
            raise RewardShapeError(f"reward function {reward.function} returned "
                             f"{len(values) if isinstance(values, (list, tuple)) else type(values).__name__} "
                             "values for 1 completion")
        return None if values[0] is None else float(values[0])

    return RewardFunc(reward.name, score, reward.weight, with_ids=True)


class DatasetEnv(EnvBase):
    config_class = DatasetEnvConfig
    max_turns = 1
    reads_data = True  # the stage gives it the rows of its dataset stages (use_rows)

    def __init__(self, config: DatasetEnvConfig, name: str = "dataset"):
        super().__init__(config, name)
        funcs = []
        for i, reward in enumerate(config.rewards):
            try:
                funcs.append(trl_reward(reward, load_function(reward)))
            except ValueError as exc:
                raise EnvFieldError(f"rewards[{i}].function", str(exc)) from None
        self.rubric = Rubric(funcs)
        self.rows: dict[str, list[Task]] = {"train": [], "eval": []}

    def data_stages(self) -> list[str]:
        return [stage for stage in (self.config.data, self.config.eval_data) if stage is not None]

    def use_rows(self, rows: list[dict], eval_rows: list[dict] | None = None) -> None:
        """The dataset's prompt rows as tasks of each split."""
        tasks = [self.task(row) for row in rows]
        if eval_rows is not None:
            self.rows = {"train": tasks, "eval": [self.task(row) for row in eval_rows]}
            return
        cut = self.config.eval_fraction
        held_out = [zlib.crc32(task.id.encode()) % 10_000 < cut * 10_000 for task in tasks]
        self.rows = {"train": [t for t, out in zip(tasks, held_out) if not out],
                     "eval": [t for t, out in zip(tasks, held_out) if out]}

    def task(self, row: dict) -> Task:
        prompt = row["prompt"]
        turns = prompt_turns(prompt) if prompt.startswith(CONVERSATION_PREFIX) else None
        extra = {key: _cell(value) for key, value in row.items()
                 if key not in ("id", "row", "prompt", "conversational", "tools", "malformed", "total_tokens")}
        answer = extra.get("answer")
        return Task(id=f"{self.name}-{row['id']}", prompt=prompt, answer="" if answer is None else str(answer),
                    info={"columns": extra, "prompt_turns": turns})

    def tasks(self, split: str, n: int, seed: int) -> list[Task]:
        check_split(split)
        pool = self.rows[split]
        if not pool:
            raise ValueError(f"env {self.name}: no {split} rows (is its dataset stage an input of this stage?)")
        order = list(pool)
        self.draw(split, seed).shuffle(order)
        return [order[i % len(order)] for i in range(n)]

    def all_tasks(self) -> list[Task]:
        return self.rows["train"] + self.rows["eval"]

    def start(self, task: Task, llm: SubPolicy | None = None) -> SingleTurn:
        return SingleTurn()

    def oracle_actions(self, task: Task) -> list[str]:
        return [self.reference_completion(task)]

    def reference_completion(self, task: Task) -> str:
        return f"The answer is {task.answer}."

    def is_correct(self, completion: str, task: Task, outcome: Outcome = NO_OUTCOME) -> bool:
        return _full_marks(self.rubric.funcs[0], completion, task, outcome) is True

    def is_formatted(self, completion: str, task: Task, outcome: Outcome = NO_OUTCOME) -> bool:
        checks = [_full_marks(f, completion, task, outcome) for f in self.rubric.funcs if f.name.endswith("format")]
        return all(check is not False for check in checks)


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


def _cell(value):
    """A Parquet cell as a plain Python value (numpy scalars and arrays included; NaN is missing)."""
    value = plain(value)
    return None if isinstance(value, float) and math.isnan(value) else value
