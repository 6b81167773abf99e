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
import string
import sys
import zlib
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

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


class RewardModelReward(BaseModel):
    """A reward model trained by a `reward_model` stage scores each completion with its prompt
    (tasks/rollout/learned_rewards.py): `sigmoid` puts its score in (0, 1) like a rubric's terms,
    `logit` keeps the raw score (TRL's GRPOTrainer uses it raw)."""

    model_config = ConfigDict(extra="forbid")

    reward_model: str  # the reward_model stage
    weight: float = 1.0
    name: str | None = None  # the reward's column (`reward_<name>`); default the stage id
    output: Literal["sigmoid", "logit"] = "sigmoid"
    max_length: int = Field(512, gt=8)  # tokens of prompt + completion it reads
    batch_size: int = Field(32, gt=0)

    @property
    def label(self) -> str:
        return self.name or self.reward_model


class JudgeScoring(BaseModel):
    """A model behind an OpenAI-compatible endpoint that answers a score for each completion:
    `prompt` is filled with {prompt}, {completion} and {answer} (the row's answer column, if any);
    the first number of its reply, from `min_score` to `max_score`, becomes a reward in [0, 1]."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str = Field(pattern=r"^https?://\S+$")  # base URL, ending in /v1
    model: str
    api_key_env: str | None = None  # the environment variable holding the API key (never the key itself)
    prompt: str = ("Rate the response to the task from 0 (useless or wrong) to 10 (excellent and correct).\n\n"
                   "Task:\n{prompt}\n\nResponse:\n{completion}\n\nReply with the number only.")
    min_score: float = 0.0
    max_score: float = 10.0
    max_tokens: int = Field(16, gt=0)
    timeout_seconds: float = Field(60.0, gt=0)
    retries: int = Field(2, ge=0)  # a request that times out or fails is tried again this many times
    max_workers: int = Field(4, gt=0)  # requests in flight at once

    @model_validator(mode="after")
    def _valid(self):
        if self.max_score <= self.min_score:
            raise ValueError(f"max_score ({self.max_score}) must be above min_score ({self.min_score})")
        fields = {name for _, name, _, _ in string.Formatter().parse(self.prompt) if name is not None}
        unknown = fields - {"prompt", "completion", "answer"}
        if unknown or "completion" not in fields:
            raise ValueError(f"prompt: a template with {{completion}} (and {{prompt}}, {{answer}} if wanted); "
                             f"it names {', '.join(sorted(unknown)) or 'no completion'}")
        return self

    def describe(self) -> str:
        return f"{self.model} at {self.endpoint}"


class JudgeReward(BaseModel):
    model_config = ConfigDict(extra="forbid")

    judge: JudgeScoring
    weight: float = 1.0
    name: str = "judge"

    @property
    def label(self) -> str:
        return self.name


def reward_source(entry) -> str | None:
    """Which kind of reward a `rewards:` entry is, by the key that names its source."""
    keys = entry if isinstance(entry, dict) else vars(entry)
    return next((tag for key, tag in REWARD_TAGS.items() if key in keys), None)


REWARD_TAGS = {"function": "function-reward", "reward_model": "reward-model-reward", "judge": "judge-reward"}
Reward = Annotated[Annotated[RewardConfig, Tag("function-reward")]
                   | Annotated[RewardModelReward, Tag("reward-model-reward")]
                   | Annotated[JudgeReward, Tag("judge-reward")],
                   Discriminator(reward_source, custom_error_type="reward_source",
                                 custom_error_message="a reward names its `function`, `reward_model` or `judge`")]


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
    rewards: list[Reward] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_source(self):
        labels = [reward.name if isinstance(reward, RewardConfig) else reward.label for reward in self.rewards]
        if len(set(labels)) < len(labels):
            twice = sorted({label for label in labels if labels.count(label) > 1})
            raise ValueError(f"rewards: two rewards named {', '.join(twice)} (give one a `name:`)")
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
        self.scorers: dict[str, object] = {}  # a learned reward's label -> its scorer (use_scorers)
        for i, reward in enumerate(config.rewards):
            if isinstance(reward, (RewardModelReward, JudgeReward)):
                funcs.append(self.learned_reward(reward))
                continue
            try:
                funcs.append(trl_reward(reward, load_function(reward)))
            except ValueError as exc:
                raise EnvFieldError(f"rewards[{i}].function", str(exc)) from None
        self.rubric = Rubric(funcs)
        self.rows: dict[str, list[Task]] = {"train": [], "eval": []}

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
