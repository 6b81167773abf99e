"""The preference stage's config: offline pairs from datasets, or online pairs from envs."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from tasks.config import PLOT_MODULES, DatasetTrainStage, HeldOutLoss, SpecView


class PreferenceStage(DatasetTrainStage, HeldOutLoss):
    """Preference alignment, DPO-family loss. `offline`: on the pairs of its datasets (best vs worst
    completion per prompt of rollouts, or a user's pairs); the input checkpoint `policy` is the
    reference, its log-probs of every pair computed once, before training, and stored with the
    pairs. `online` (TRL's online DPO): every step samples two completions per prompt of its `envs`
    from the model being trained, their rubric (a reward model, a judge, a verifier) picks the pair,
    and the reference's log-probs are computed on the spot (tasks/stages/preference/online.py).
    """

    outputs = ("checkpoint", "pairs", "report")
    primary = "checkpoint"
    produces = "checkpoint"
    preload = ("peft", "accelerate", *PLOT_MODULES)  # curves at checkpoints
    runs = "tasks.stages.preference"  # the package: its `run` is stage.py's

    kind: Literal["preference"]
    policy: str
    mode: Literal["offline", "online"] = "offline"
    data: str | list[str] | dict[str, Annotated[float, Field(gt=0)]] | None = Field(None, min_length=1)  # offline
    envs: dict[str, Annotated[float, Field(gt=0)]] | None = Field(None, min_length=1)  # online: env id -> weight
    method: Literal["dpo", "ln_dpo", "ipo"] = "dpo"
    beta: float = Field(0.1, gt=0)
    min_reward_gap: float = Field(0.0, ge=0)  # pairs need chosen - rejected reward above this
    learning_rate: float = Field(2e-5, gt=0)
    batch_size: int = Field(16, gt=0)  # pairs a step (online: prompts a step)
    warmup_steps: int = Field(10, ge=0)
    max_seq_len: int = Field(256, gt=8)
    temperature: float = Field(1.0, gt=0)  # online: sampling the two completions
    max_tokens: int = Field(64, gt=0)  # online: per action

    @model_validator(mode="after")
    def _mode_inputs(self):
        if self.mode == "offline" and (self.data is None or self.envs is not None):
            raise ValueError("mode: offline trains on the pairs of `data` (generate stages or preference "
                             "datasets); `envs` is for mode: online")
        if self.mode == "online":
            if self.envs is None or self.data is not None:
                raise ValueError("mode: online samples its pairs from `envs` ({env id: weight}) every step; "
                                 "`data` is for mode: offline")
            if self.max_steps is None:
                raise ValueError("mode: online needs max_steps (it has no dataset to count epochs over)")
            if self.eval_fraction:
                raise ValueError("eval_fraction: mode: online samples new pairs every step; a held-out loss is "
                                 "measured on a dataset's pairs (mode: offline)")
        return self

    def datasets(self) -> list[str]:
        return [] if self.data is None else super().datasets()

    def env_refs(self):
        return [(f"envs.{env_id}", env_id) for env_id in self.envs or {}]

    def stage_refs(self):
        # data: generate stages, or imported preference datasets
        return [("policy", self.policy, "checkpoint"), *(self.data_refs(("rollouts", "preference dataset"))
                                                         if self.data is not None else [])]

    def check_spec(self, spec: SpecView) -> None:
        """Every prompt group of its rollouts must hold completions to pick a best and a worst from."""
        super().check_spec(spec)
        for data in self.datasets():
            if spec.stage(data).output_kind() == "rollouts":
                spec.stage(data).check_pairable(spec, self.id)
