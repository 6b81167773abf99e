"""Typed configs of every stage kind; the YAML `stages:` entries mirror these one-to-one.

Kept free of heavy imports so that `posttrain validate` stays fast.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator
from pydantic_core import PydanticCustomError

from data_contracts.config import ContractConfig

StageId = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")


class Defaults(BaseModel):
    model_config = ConfigDict(extra="forbid")

    retries: int = Field(2, ge=0)
    retry_delay_seconds: float = Field(5, ge=0)
    timeout_seconds: float = Field(3600, gt=0)
    gpus: int = Field(0, ge=0)


class StageBase(BaseModel):
    """Fields every stage has; the orchestration ones fall back to the spec's `defaults`."""

    model_config = ConfigDict(extra="forbid")

    id: str = StageId
    retries: int | None = Field(None, ge=0)
    retry_delay_seconds: float | None = Field(None, ge=0)
    timeout_seconds: float | None = Field(None, gt=0)
    gpus: int | None = Field(None, ge=0)
    contract: ContractConfig | None = None  # overrides for the data contract of the stage's dataset

    def env_refs(self) -> list[tuple[str, str]]:
        """(field path, env id) pairs this stage names."""
        return []

    def stage_refs(self) -> list[tuple[str, str, str]]:
        """(field path, stage id, artifact kind expected) for every input stage."""
        return []

    def reads_base_model(self) -> bool:
        """Whether the stage starts from the spec's base model (not from an input checkpoint)."""
        return False

    def params(self) -> dict:
        """What decides the stage's output (its cache key), without orchestration settings."""
        return self.model_dump(exclude={"id", "retries", "retry_delay_seconds", "timeout_seconds", "gpus"})


class Endpoint(BaseModel):
    """A model behind an OpenAI-compatible endpoint (`posttrain serve-model`, vLLM, an API)."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str = Field(pattern=r"^https?://\S+$")  # base URL, ending in /v1
    model: str  # the name the endpoint serves it under
    api_key_env: str | None = None  # the environment variable holding the API key (never the key itself)

    def describe(self) -> str:
        return f"{self.model} at {self.endpoint}"


class EndpointTeacher(Endpoint):
    """A teacher model at an endpoint: it plays the env's train tasks for SFT data."""

    max_tokens: int = Field(256, gt=0)  # per action (per turn of a multi-turn env)
    temperature: float = Field(0, ge=0)  # 0: greedy


class Judge(Endpoint):
    """A judge model at an endpoint: it grades each evaluated answer yes or no (tasks/judge.py)."""

    max_tokens: int = Field(8, gt=0)


class SynthesizeStage(StageBase):
    """Teacher traces for SFT from an environment's train split."""

    kind: Literal["synthesize"]
    env: str
    n: int = Field(gt=0)
    teacher: Literal["oracle"] | EndpointTeacher = "oracle"  # the env's programmatic oracle, or a model
    seed: int = 0

    @field_validator("teacher", mode="before")
    @classmethod
    def _oracle_or_endpoint(cls, value):
        """A mapping is an endpoint teacher: its own errors name its fields (`teacher.model: missing`)
        instead of listing why it is not 'oracle' either."""
        if isinstance(value, dict):
            return EndpointTeacher.model_validate(value)
        if value != "oracle" and not isinstance(value, EndpointTeacher):
            raise PydanticCustomError("teacher", "expected 'oracle' or an endpoint teacher (a mapping with "
                                                 "endpoint and model)")
        return value

    def env_refs(self):
        return [("env", self.env)]


class TrainStage(StageBase):
    """Optimizer, schedule and checkpointing fields of the stages that train a model."""

    learning_rate: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(20, ge=0)
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    checkpoint_every: int = Field(100, gt=0)
    seed: int = 0


class DatasetTrainStage(TrainStage):
    """Training over a dataset in batches (sft, preference): epochs or a fixed number of steps."""

    epochs: float = Field(1.0, gt=0)
    max_steps: int | None = Field(None, gt=0)
    batch_size: int = Field(32, gt=0)
    max_seq_len: int = Field(128, gt=8)
    data: str | list[str]  # one dataset stage, or several trained on together (e.g. one per env)

    def datasets(self) -> list[str]:
        return [self.data] if isinstance(self.data, str) else list(self.data)

    def data_refs(self, kind: str) -> list[tuple[str, str, str]]:
        if isinstance(self.data, str):
            return [("data", self.data, kind)]
        return [(f"data[{i}]", data, kind) for i, data in enumerate(self.data)]


class SftStage(DatasetTrainStage):
    """Supervised fine-tuning with a completion-only loss."""

    kind: Literal["sft"]
    policy: str | None = None  # a checkpoint stage; the spec's base model when absent

    def reads_base_model(self) -> bool:
        return self.policy is None

    def stage_refs(self):
        refs = self.data_refs("dataset")
        if self.policy is not None:
            refs.append(("policy", self.policy, "checkpoint"))
        return refs


class PreferenceStage(DatasetTrainStage):
    """Preference alignment on rollouts: best vs worst completion per prompt, DPO-family loss.

    The input checkpoint `policy` is the reference model; its log-probs of every pair are
    computed once, before training, and stored with the pairs.
    """

    kind: Literal["preference"]
    policy: str
    method: Literal["dpo", "ln_dpo", "ipo"] = "dpo"
    beta: float = Field(0.1, gt=0)
    min_reward_gap: float = Field(0.0, ge=0)  # pairs need chosen - rejected reward above this
    learning_rate: float = Field(2e-5, gt=0)
    batch_size: int = Field(16, gt=0)
    warmup_steps: int = Field(10, ge=0)
    max_seq_len: int = Field(256, gt=8)

    def stage_refs(self):
        return [("policy", self.policy, "checkpoint"), *self.data_refs("rollouts")]  # data: generate stages


class AntiDoom(BaseModel):
    """Anti-doom-loop shaping of the RL reward: a penalty for repeated word n-grams."""

    model_config = ConfigDict(extra="forbid")

    ngram: int = Field(4, ge=1)
    threshold: float = Field(0.2, ge=0, lt=1)  # share of repeated n-grams tolerated before any penalty
    penalty: float = Field(0.5, ge=0)  # weight of the penalty in the reward (0: only the `repetition` metric)
    # a trajectory that never reaches its end, or leaves a <think> block open, earns none of
    # the rubric's positive terms (its penalties still apply)
    validate_trace: bool = True


class DynamicSampling(BaseModel):
    """DAPO's dynamic sampling: groups whose rewards are all equal carry no signal; drop them and
    draw more prompts, at most `max_rounds` draws per step."""

    model_config = ConfigDict(extra="forbid")

    max_rounds: int = Field(3, ge=1)


class Overlong(BaseModel):
    """DAPO's soft overlong shaping: a penalty ramping from 0 to `penalty` over the last `buffer`
    tokens of the `max_tokens` budget (the full penalty for a cut-off action)."""

    model_config = ConfigDict(extra="forbid")

    buffer: int = Field(16, gt=0)
    penalty: float = Field(1.0, ge=0)


class RlStage(TrainStage):
    """On-policy RL from verifiable rewards over a weighted mix of environments.

    `grpo`: one training row per trajectory (env-written tokens masked), token-level ratio.
    `steppo`: one row per turn (the action), critic-free step advantages from group-normalized
    rewards-to-go, one sequence-level ratio per step (DOMAIN.md, StepPO). With `credit: cod`,
    Connect the Dots packs get mean-style returns against the same slot of the pack's other
    rollouts (DOMAIN.md, CoD), by default without std scaling (`scale_rewards` left unset).
    """

    kind: Literal["rl"]
    policy: str
    envs: dict[str, Annotated[float, Field(gt=0)]] = Field(min_length=1)  # env id -> mixing weight
    algorithm: Literal["grpo", "steppo"] = "grpo"
    loss_aggregation: Literal["grpo", "dr_grpo", "dapo"] = "dapo"
    steps: int = Field(gt=0)
    prompts_per_step: int = Field(8, gt=0)
    group_size: int = Field(8, ge=2)
    epsilon_low: float = Field(0.2, ge=0, lt=1)  # clip range (binds once a batch is reused)
    epsilon_high: float = Field(0.28, ge=0)
    beta: float = Field(0.0, ge=0)  # k3 KL to the input checkpoint (with LoRA: the adapter-disabled base)
    scale_rewards: Literal["group", "batch", "none"] = "group"
    num_iterations: int = Field(1, ge=1)  # updates per batch; the ratio's old policy is the sampling one
    gamma: float = Field(1.0, gt=0, le=1)  # steppo: discount of the reward-to-go
    credit: Literal["reward_to_go", "cod"] = "reward_to_go"  # steppo: how step rewards become returns
    dynamic_sampling: DynamicSampling | None = None
    overlong: Overlong | None = None
    mask_truncated: bool = False  # actions cut by max_tokens add no gradient (grpo: their whole trajectory)
    temperature: float = Field(1.0, gt=0)
    max_tokens: int = Field(64, gt=0)
    anti_doom: AntiDoom | None = None
    learning_rate: float = Field(1e-5, gt=0)
    warmup_steps: int = Field(5, ge=0)
    checkpoint_every: int = Field(50, gt=0)

    @model_validator(mode="after")
    def _clip_range(self):
        if self.epsilon_high < self.epsilon_low:
            raise ValueError(f"epsilon_high ({self.epsilon_high}) must be at least epsilon_low ({self.epsilon_low})")
        if self.overlong is not None and self.overlong.buffer >= self.max_tokens:
            raise ValueError(f"overlong.buffer ({self.overlong.buffer}) must be below max_tokens ({self.max_tokens})")
        if self.credit == "cod" and self.algorithm != "steppo":
            raise ValueError("credit: cod assigns credit per step; use algorithm: steppo")
        if self.credit == "cod" and "scale_rewards" not in self.model_fields_set:
            self.scale_rewards = "none"  # CoD's baseline is the slot's mean over the group, no std unless asked
        return self

    def env_refs(self):
        return [(f"envs.{env_id}", env_id) for env_id in self.envs]

    def stage_refs(self):
        return [("policy", self.policy, "checkpoint")]


class GenerateStage(StageBase):
    """On-policy rollouts: `samples` sampled + `greedy` greedy completions per prompt, scored by the env."""

    kind: Literal["generate"]
    policy: str
    env: str
    n: int = Field(gt=0)  # prompts
    split: Literal["train", "eval"] = "train"
    samples: int = Field(5, ge=0)
    greedy: int = Field(1, ge=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(64, gt=0)
    batch_size: int = Field(64, gt=0)
    seed: int = 0

    @model_validator(mode="after")
    def _some_completions(self):
        if self.samples + self.greedy < 1:
            raise ValueError("samples + greedy must be at least 1")
        return self

    def env_refs(self):
        return [("env", self.env)]

    def stage_refs(self):
        return [("policy", self.policy, "checkpoint")]


class SampledEval(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(0.7, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)


class EvaluateStage(StageBase):
    """Held-out accuracy, format rate, doom-loop rate and length per checkpoint and env."""

    kind: Literal["evaluate"]
    checkpoints: list[str] = Field(min_length=1)
    envs: list[str] = Field(min_length=1)
    n: int = Field(200, gt=0)
    max_new_tokens: int = Field(64, gt=0)
    batch_size: int = Field(64, gt=0)
    sampled: SampledEval | None = SampledEval()
    judge: Judge | None = None  # also a judge model's verdict on every greedy answer
    seed: int = 0

    def env_refs(self):
        return [(f"envs[{i}]", env) for i, env in enumerate(self.envs)]

    def stage_refs(self):
        return [(f"checkpoints[{i}]", c, "checkpoint") for i, c in enumerate(self.checkpoints)]


# The output key of each kind's primary artifact (what downstream stages read); the others are
# secondary (`.report`, `.pairs`). Looked up by key: JSON written with sorted keys loses the order.
PRIMARY_OUTPUT = {"synthesize": "dataset", "generate": "rollouts", "sft": "checkpoint", "preference": "checkpoint",
                  "rl": "checkpoint", "evaluate": "results"}
STAGE_OUTPUT = {"synthesize": "dataset", "generate": "rollouts", "sft": "checkpoint", "preference": "checkpoint",
                "rl": "checkpoint", "evaluate": "evaluation"}

StageConfig = Annotated[Union[SynthesizeStage, GenerateStage, SftStage, PreferenceStage, RlStage, EvaluateStage],
                        Field(discriminator="kind")]
STAGE_CONFIG = TypeAdapter(StageConfig)
