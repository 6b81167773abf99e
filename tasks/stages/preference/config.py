"""The preference stage's config: offline pairs from datasets, or online pairs from envs."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from models.losses import REFERENCE_FREE
from tasks.config import PLOT_MODULES, DatasetTrainStage, HeldOutLoss, SpecView

REFERENCED = ("dpo", "ln_dpo", "ipo")  # paired, against the input checkpoint as the reference
# the fields of one method only (field -> (method, default)): set for another, a one-line error; unset
# for theirs, TRL's default
METHOD_FIELDS = {"desirable_weight": ("kto", 1.0), "undesirable_weight": ("kto", 1.0), "simpo_gamma": ("simpo", 0.5),
                 "cpo_alpha": ("cpo", 1.0)}


class PreferenceStage(DatasetTrainStage, HeldOutLoss):
    """Preference alignment (the DPO family, KTO, ORPO, SimPO, CPO). `offline`: on the pairs of its datasets (best vs worst
    completion per prompt of rollouts, or a user's pairs); the input checkpoint `policy` is the
    reference, its log-probs of every pair computed once, before training, and stored with the
    pairs. `online` (TRL's online DPO): every step samples two completions per prompt of its `envs`
    from the model being trained, their rubric (a reward model, a judge, a verifier) picks the pair,
    and the reference's log-probs are computed on the spot (tasks/stages/preference/online.py).

    `method`: dpo, ln_dpo, ipo (pairs, against the reference); orpo, simpo, cpo (pairs, no reference:
    nothing is precomputed); kto (unpaired desirable/undesirable completions against the reference,
    tasks/stages/preference/kto.py; a preference dataset's or rollouts' pairs are split into rows).
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
    method: Literal["dpo", "ln_dpo", "ipo", "kto", "orpo", "simpo", "cpo"] = "dpo"
    beta: float = Field(0.1, gt=0)  # orpo: the odds-ratio term's weight (λ)
    desirable_weight: float | None = Field(None, gt=0)  # kto (1.0): weight of the desirable rows' losses
    undesirable_weight: float | None = Field(None, gt=0)  # kto (1.0): weight of the undesirable rows' losses
    simpo_gamma: float | None = Field(None, ge=0)  # simpo (0.5): the target reward margin γ
    cpo_alpha: float | None = Field(None, ge=0)  # cpo (1.0): weight of the chosen side's NLL term
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
            if self.method not in REFERENCED:
                raise ValueError(f"mode: online trains method dpo, ln_dpo or ipo (method is {self.method})")
        return self

    @model_validator(mode="after")
    def _method_fields(self):
        for name, (method, default) in METHOD_FIELDS.items():
            if getattr(self, name) is not None and method != self.method:
                raise ValueError(f"{name} is for method {method} (method is {self.method})")
            if getattr(self, name) is None and method == self.method:
                setattr(self, name, default)
        if self.method == "kto" and self.batch_size < 2:
            raise ValueError("batch_size: method kto needs at least 2 rows a step (its KL baseline pairs each "
                             "row's prompt with another row's completion)")
        if self.method == "kto" and self.eval_fraction:
            raise ValueError("eval_fraction: a held-out loss is measured for paired methods; method kto has none")
        return self

    @property
    def reference_free(self) -> bool:
        """orpo, simpo and cpo: no reference model, no reference log-probs computed."""
        return self.method in REFERENCE_FREE

    def datasets(self) -> list[str]:
        return [] if self.data is None else super().datasets()

    def env_refs(self):
        return [(f"envs.{env_id}", env_id) for env_id in self.envs or {}]

    def stage_refs(self):
        # data: generate stages, or imported preference datasets (kto: unpaired ones too)
        kinds = ("rollouts", "preference dataset") + (("unpaired preference dataset",) if self.method == "kto" else ())
        return [("policy", self.policy, "checkpoint"), *(self.data_refs(kinds) if self.data is not None else [])]

    def check_spec(self, spec: SpecView) -> None:
        """Every prompt group of its rollouts must hold completions to pick a best and a worst from."""
        super().check_spec(spec)
        for data in self.datasets():
            if spec.stage(data).output_kind() == "rollouts":
                spec.stage(data).check_pairable(spec, self.id)
