"""The `dataset` env's config: its rows' sources, its held-out split and its rewards (functions
with TRL's signature, a reward model, a judge)."""

from __future__ import annotations

import string
from pathlib import Path, PurePath
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag, model_validator

from artifacts.urls import scrub_urls
from envs.judge_requests import JudgeRequests

BUILTIN_REWARDS = "posttrain.rewards"  # how a spec names envs/rewards.py
# module:function, or a module's file and its function (path/to/my_rewards.py:function)
FUNCTION = r"^(?:[A-Za-z_][\w.]*|(?:[^:]*/)?[A-Za-z_]\w*\.py):[A-Za-z_]\w*$"


class RewardConfig(BaseModel):
    """A TRL-style reward function: `module:function` (a module of the spec's folder, else an installed
    one) or `path/to/module.py:function` (a file, relative to the spec's folder)."""

    model_config = ConfigDict(extra="forbid")

    function: str = Field(pattern=FUNCTION)
    weight: float = 1.0  # 0: a logged metric only

    @property
    def name(self) -> str:
        return self.function.split(":")[1]

    @property
    def written_module(self) -> str:
        return self.function.split(":")[0]

    @property
    def names_file(self) -> bool:
        return self.written_module.endswith(".py")

    @property
    def module(self) -> str:
        """The name its module is imported under: a named file's own name."""
        if self.names_file:
            return PurePath(self.written_module).stem
        return "envs.rewards" if self.written_module == BUILTIN_REWARDS else self.written_module

    def module_folder(self, spec_folder: Path) -> Path | None:
        """The folder its module is looked for in first: the spec's, or a named file's own; None for
        the built-ins."""
        if self.names_file:
            return (spec_folder / self.written_module).resolve().parent
        return None if self.written_module == BUILTIN_REWARDS else spec_folder


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


class JudgeScoring(JudgeRequests):
    """A model behind an OpenAI-compatible endpoint that answers a score for each completion
    (tasks/rollout/judge_client.py): `prompt` is filled with {prompt}, {completion} (fenced: the
    client puts it between delimiters and tells the judge it is data) and {answer} (the row's answer
    column, if any); the reply's last line must be `SCORE: <number>`, from `min_score` to
    `max_score`, which becomes a reward in [0, 1]. Its request settings are the JudgeRequests group."""

    endpoint: str = Field(pattern=r"^https?://\S+$")  # base URL, ending in /v1
    model: str
    api_key_env: str | None = None  # the environment variable holding the API key (never the key itself)
    # the fence's rules and the `SCORE:` line are the client's to ask for, in a system message
    prompt: str = ("Rate the response to the task from 0 (useless or wrong) to 10 (excellent and correct).\n\n"
                   "Task:\n{prompt}\n\nResponse:\n{completion}")
    min_score: float = 0.0
    max_score: float = 10.0
    max_tokens: int = Field(16, gt=0)  # room for its final line, `SCORE: 10`

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
        return f"{self.model} at {scrub_urls(self.endpoint)}"


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


class TaskRows(BaseModel):
    """Where an env's task rows come from (the `dataset` and `mcp` kinds): a dataset stage of prompts
    or its options inline (flows/spec_data.py makes it a stage), and the held-out split."""

    model_config = ConfigDict(extra="forbid")

    data: str | None = None  # a dataset stage of prompts (set by the spec when `source` is given)
    source: str | None = None  # the dataset stage's options, inline
    split: str | None = None
    columns: dict[str, str] = {}
    limit: int | None = Field(None, gt=0)
    shuffle_seed: int | None = None
    eval_fraction: float = Field(0.1, ge=0, lt=1)
    # another row env whose held-out split this one shares: the split hashes each row's id with an
    # env's name, so two envs over the same rows (one scoring generation with a check, one rewarding
    # RL with a learned reward) hold out the same rows only when one names the other here
    held_out_as: str | None = None
    eval_data: str | None = None
    eval_source: str | None = None
    # the folder its reward modules are looked for in first: the spec file's (flows/spec_data.py sets
    # it); None in a stage's process, which imports them from the import path (the request carried them)
    _reward_folder: Path | None = PrivateAttr(None)

    @property
    def reward_folder(self) -> Path | None:
        return self._reward_folder

    def find_rewards_in(self, folder: Path) -> None:
        self._reward_folder = folder

    def reward_functions(self) -> list[RewardConfig]:
        """The TRL-style functions it names (their modules travel with a stage's request)."""
        return []

    @model_validator(mode="after")
    def _rows_given(self):
        if self.data is None and self.source is None:
            raise ValueError("give the rows as `data: STAGE_ID` or `source: PATH`")
        if self.eval_data is not None and self.eval_source is not None:
            raise ValueError("give the held-out rows as `eval_data` or `eval_source`, not both")
        return self


class DatasetEnvConfig(TaskRows):
    kind: Literal["dataset"]
    rewards: list[Reward] = Field(min_length=1)

    def reward_functions(self) -> list[RewardConfig]:
        return [reward for reward in self.rewards if isinstance(reward, RewardConfig)]

    @model_validator(mode="after")
    def _one_source(self):
        labels = [reward.name if isinstance(reward, RewardConfig) else reward.label for reward in self.rewards]
        if len(set(labels)) < len(labels):
            twice = sorted({label for label in labels if labels.count(label) > 1})
            raise ValueError(f"rewards: two rewards named {', '.join(twice)} (give one a `name:`)")
        return self
