"""The rl stage's config: `RlStage`, where its rollouts decode (`rollout:`, any registered backend:
tasks/rollout/backends/) and whether they run ahead of the trainer (`asynchronous:`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tasks.config import ONE_SEQUENCE_ONLY, PLOT_MODULES, AntiDoom, DynamicSampling, Overlong, SpecView, TrainStage
from tasks.rollout.backends import LocalRollout, Rollout


class Asynchronous(BaseModel):
    """Rollouts for the next steps decode while the trainer trains: at most `max_staleness` policy
    versions behind the weights a step trains (older rows are dropped and counted)."""

    model_config = ConfigDict(extra="forbid")

    max_staleness: int = Field(1, ge=1)


class RlStage(TrainStage):
    """On-policy RL from verifiable rewards over a weighted mix of environments.

    `grpo`: one training row per trajectory (env-written tokens masked), token-level ratio.
    `steppo`: one row per turn (the action), critic-free step advantages from group-normalized
    rewards-to-go, one sequence-level ratio per step (DOMAIN.md, StepPO). With `credit: cod`,
    Connect the Dots packs get mean-style returns against the same slot of the pack's other
    rollouts (DOMAIN.md, CoD), by default without std scaling (`scale_rewards` left unset).
    `importance_sampling_level: sequence` gives grpo (either advantage) GSPO's ratio, one per row,
    as TRL's GRPOConfig(importance_sampling_level="sequence"); steppo's ratio is always per step.
    """

    outputs = ("checkpoint", "report")
    primary = "checkpoint"
    produces = "checkpoint"
    preload = ("peft", "accelerate", *PLOT_MODULES)  # curves at checkpoints
    runs = "tasks.stages.rl"  # the package: its `run` is stage.py's
    publishes_weights = True  # to a rollout server, every rollout.sync_every optimizer steps

    kind: Literal["rl"]
    policy: str
    envs: dict[str, Annotated[float, Field(gt=0)]] = Field(min_length=1)  # env id -> mixing weight
    algorithm: Literal["grpo", "steppo"] = "grpo"
    # grpo's estimator: group-normalized, or REINFORCE leave-one-out (TRL's RLOOTrainer; its
    # scale_rewards: none by default, batch for TRL's normalize_advantages)
    advantage: Literal["grpo", "rloo"] = "grpo"
    # the clipped ratio: one per token, or one per row (GSPO: exp of the mean token log-ratio); steppo: sequence
    importance_sampling_level: Literal["token", "sequence"] = "token"
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
    samples_every: int = Field(10, gt=0)  # a table of the step's episodes to the trackers of report_to
    rollout: Rollout = Field(default_factory=LocalRollout)
    asynchronous: Asynchronous | None = None
    importance_cap: float = Field(2.0, gt=0)  # C of the truncated importance weights (server-sampled rows)

    @model_validator(mode="after")
    def _consistent(self):
        if self.epsilon_high < self.epsilon_low:
            raise ValueError(f"epsilon_high ({self.epsilon_high}) must be at least epsilon_low ({self.epsilon_low})")
        if self.overlong is not None and self.overlong.buffer >= self.max_tokens:
            raise ValueError(f"overlong.buffer ({self.overlong.buffer}) must be below max_tokens ({self.max_tokens})")
        if self.credit == "cod" and self.algorithm != "steppo":
            raise ValueError("credit: cod assigns credit per step; use algorithm: steppo")
        self.rollout.check_asynchronous(None if self.asynchronous is None else self.asynchronous.max_staleness)
        if self.credit == "cod" and "scale_rewards" not in self.model_fields_set:
            self.scale_rewards = "none"  # CoD's baseline is the slot's mean over the group, no std unless asked
        if self.advantage == "rloo":
            self._check_rloo()
        if self.algorithm == "steppo":
            self._check_steppo_ratio()
        return self

    def _check_steppo_ratio(self) -> None:
        if self.importance_sampling_level == "token" and "importance_sampling_level" in self.model_fields_set:
            raise ValueError("importance_sampling_level: token: steppo's ratio is one per step (sequence, DOMAIN.md "
                             "StepPO); a token-level ratio is algorithm: grpo's")
        self.importance_sampling_level = "sequence"

    def _check_rloo(self) -> None:
        if self.algorithm != "grpo":
            raise ValueError("advantage: rloo gives one advantage per trajectory; use algorithm: grpo (steppo's "
                             "step advantages have their own baseline)")
        if "scale_rewards" not in self.model_fields_set:
            self.scale_rewards = "none"  # TRL's RLOO: leave-one-out advantages as they are unless asked
        elif self.scale_rewards == "group":
            raise ValueError("scale_rewards: group divides by each group's std (GRPO); with advantage: rloo use "
                             "none (TRL's default) or batch (TRL's normalize_advantages)")

    @property
    def gspo(self) -> bool:
        """grpo (either advantage) with GSPO's sequence-level ratio."""
        return self.algorithm == "grpo" and self.importance_sampling_level == "sequence"

    def env_refs(self):
        return [(f"envs.{env_id}", env_id) for env_id in self.envs]

    def params(self) -> dict:
        """Without reporting (`samples_every`) and where the rollout server is (its URL, key, folder);
        a local stage's key leaves out the server's fields altogether, and the ratio's level where it
        is the algorithm's own (grpo token, steppo sequence), so keys made before the field hold."""
        params = {key: value for key, value in super().params().items()
                  if key != "samples_every" and (key != "importance_sampling_level" or self.gspo)}
        return self.rollout.keyed(params, ("asynchronous", "importance_cap"))

    def stage_refs(self):
        return [("policy", self.policy, "checkpoint")]

    def endpoints(self) -> list[tuple[str, object]]:
        return self.rollout.endpoints()

    def check_spec(self, spec: SpecView) -> None:
        """Rollouts running ahead overlap the update, which on several processes is collectives; a grpo
        row is one growing context: an env that restarts it (cod) needs steppo's rows per step."""
        super().check_spec(spec)
        if self.asynchronous is not None and spec.gpus(self) > 1:
            given = "" if self.gpus is not None else " (defaults.gpus)"
            raise spec.error(self.id, "asynchronous", f"runs in one process (its rollouts overlap the update's "
                                                      f"collectives), this stage has gpus {spec.gpus(self)}{given}: "
                                                      "give it gpus: 1, or drop asynchronous")
        if self.algorithm != "grpo":
            return
        for env_id in self.envs:
            if spec.env_class(env_id).restarts_context:
                raise spec.error(self.id, f"envs.{env_id}", f"env {env_id!r} ({spec.envs[env_id].kind}) "
                                                            f"{ONE_SEQUENCE_ONLY}")
