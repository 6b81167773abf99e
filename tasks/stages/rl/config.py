"""The rl stage's config: `RlStage`, and where its rollouts decode (`rollout:`), each backend
building the step's rollout source (tasks/stages/rl/sources.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tasks.common.rollout_backends import LocalRollout, ServerRollout, rollout_union
from tasks.config import ONE_SEQUENCE_ONLY, PLOT_MODULES, AntiDoom, DynamicSampling, Overlong, SpecView, TrainStage


class Asynchronous(BaseModel):
    """Rollouts for the next steps decode while the trainer trains: at most `max_staleness` policy
    versions behind the weights a step trains (older rows are dropped and counted)."""

    model_config = ConfigDict(extra="forbid")

    max_staleness: int = Field(1, ge=1)


class RlLocalRollout(LocalRollout):
    """The stage's own engine decodes, in lockstep with the trainer."""

    def check_asynchronous(self, asynchronous: Asynchronous | None) -> None:
        if asynchronous is not None:
            raise ValueError("asynchronous: needs rollout.backend server (rollouts decode there while this trains)")

    def source(self, stage: "RlStage", collect, training, tokenizer, ctx):
        """The step's rollouts from the model being trained itself; sharded, on its whole weights,
        gathered once a step (a different number of decode steps on each process)."""
        from tasks.common.sharding import full_weights
        from tasks.stages.rl.sources import Rollouts

        model = training.accelerator.unwrap_model(training.model)

        def decoded(policy, step: int):
            with full_weights(training.model):
                return collect(policy, step)

        return Rollouts(decoded, self.trainer_policy(model, tokenizer, stage.prompts_per_step * stage.group_size),
                        model)


class RlServerRollout(ServerRollout):
    """A server decodes; the stage publishes its weights there every `sync_every` optimizer steps,
    saved under `sync_folder`, a folder the server reads (serve-model's --lora-folder; vLLM loads the
    adapter from its path): tasks/stages/rl/weight_sync.py."""

    sync_every: int = Field(1, ge=1)
    sync_folder: str | None = None  # required: None only to explain what it is for when it is missing

    @model_validator(mode="after")
    def _sync_folder_given(self):
        if self.sync_folder is None:
            raise ValueError("sync_folder: an rl stage on a server publishes its weights there (a folder the "
                             "server reads: serve-model's --lora-folder)")
        return self

    def check_asynchronous(self, asynchronous: Asynchronous | None) -> None:
        if asynchronous is not None and asynchronous.max_staleness < self.sync_every - 1:
            raise ValueError(f"asynchronous.max_staleness ({asynchronous.max_staleness}) must be at least "
                             f"rollout.sync_every - 1 ({self.sync_every - 1}): rollouts wait for weights "
                             "that recent")

    def source(self, stage: "RlStage", collect, training, tokenizer, ctx):
        """The step's rollouts from the server, in lockstep or running ahead (`asynchronous`), the
        weights published to it; the server checked before any training."""
        from tasks.stages.rl.sources import AheadRollouts, LockstepRollouts
        from tasks.stages.rl.weight_sync import WeightSync

        model = training.accelerator.unwrap_model(training.model)
        if stage.asynchronous is not None and training.accelerator.num_processes > 1:
            raise ValueError("asynchronous: runs in one process (its rollouts overlap the update's collectives)")
        server = self.trainer_policy(model, tokenizer, stage.prompts_per_step * stage.group_size)
        sync = WeightSync(server, self.sync_folder, ctx.stage_id, ctx.model.lora is not None)
        if stage.asynchronous is None:
            return LockstepRollouts(collect, server, model, sync, self.sync_every)
        return AheadRollouts(collect, server, model, sync, self.sync_every, stage.asynchronous.max_staleness,
                             stage.steps)


RlRollout = rollout_union(RlLocalRollout, RlServerRollout)


class RlStage(TrainStage):
    """On-policy RL from verifiable rewards over a weighted mix of environments.

    `grpo`: one training row per trajectory (env-written tokens masked), token-level ratio.
    `steppo`: one row per turn (the action), critic-free step advantages from group-normalized
    rewards-to-go, one sequence-level ratio per step (DOMAIN.md, StepPO). With `credit: cod`,
    Connect the Dots packs get mean-style returns against the same slot of the pack's other
    rollouts (DOMAIN.md, CoD), by default without std scaling (`scale_rewards` left unset).
    """

    outputs = ("checkpoint", "report")
    primary = "checkpoint"
    produces = "checkpoint"
    preload = ("peft", "accelerate", *PLOT_MODULES)  # curves at checkpoints
    runs = "tasks.stages.rl"  # the package: its `run` is stage.py's

    kind: Literal["rl"]
    policy: str
    envs: dict[str, Annotated[float, Field(gt=0)]] = Field(min_length=1)  # env id -> mixing weight
    algorithm: Literal["grpo", "steppo"] = "grpo"
    # grpo's estimator: group-normalized, or REINFORCE leave-one-out (TRL's RLOOTrainer; its
    # scale_rewards: none by default, batch for TRL's normalize_advantages)
    advantage: Literal["grpo", "rloo"] = "grpo"
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
    rollout: RlRollout = Field(default_factory=RlLocalRollout)
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
        self.rollout.check_asynchronous(self.asynchronous)
        if self.credit == "cod" and "scale_rewards" not in self.model_fields_set:
            self.scale_rewards = "none"  # CoD's baseline is the slot's mean over the group, no std unless asked
        if self.advantage == "rloo":
            self._check_rloo()
        return self

    def _check_rloo(self) -> None:
        if self.algorithm != "grpo":
            raise ValueError("advantage: rloo gives one advantage per trajectory; use algorithm: grpo (steppo's "
                             "step advantages have their own baseline)")
        if "scale_rewards" not in self.model_fields_set:
            self.scale_rewards = "none"  # TRL's RLOO: leave-one-out advantages as they are unless asked
        elif self.scale_rewards == "group":
            raise ValueError("scale_rewards: group divides by each group's std (GRPO); with advantage: rloo use "
                             "none (TRL's default) or batch (TRL's normalize_advantages)")

    def env_refs(self):
        return [(f"envs.{env_id}", env_id) for env_id in self.envs]

    def params(self) -> dict:
        """Without reporting (`samples_every`) and where the rollout server is (its URL, key, folder);
        a local stage's key leaves out the server's fields altogether."""
        params = {key: value for key, value in super().params().items() if key != "samples_every"}
        return self.rollout.keyed(params, ("asynchronous", "importance_cap"))

    def stage_refs(self):
        return [("policy", self.policy, "checkpoint")]

    def endpoints(self) -> list[tuple[str, object]]:
        return self.rollout.endpoints()

    def check_spec(self, spec: SpecView) -> None:
        """A grpo row is one growing context: an env that restarts it (cod) needs steppo's rows per step."""
        super().check_spec(spec)
        if self.algorithm != "grpo":
            return
        for env_id in self.envs:
            if spec.env_class(env_id).restarts_context:
                raise spec.error(self.id, f"envs.{env_id}", f"env {env_id!r} ({spec.envs[env_id].kind}) "
                                                            f"{ONE_SEQUENCE_ONLY}")
