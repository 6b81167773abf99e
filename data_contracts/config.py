"""The spec's per-stage `contract:` section and the resolved parameters of a contract."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DATASET_KINDS = ("sft", "rollouts", "preference", "eval", "text", "prompt_completion", "messages", "prompts",
                 "unpaired")


class ContractConfig(BaseModel):
    """Per-stage overrides; unset fields keep what the stage derives from the spec."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["enforce", "warn"] = "enforce"
    max_truncated_fraction: float | None = Field(None, ge=0, le=1)
    # a sampled completion may stop at once (its first token the end of turn): a share this size of
    # blank text passes; 0 refuses any, as for a user's own data
    max_blank_fraction: float | None = Field(None, ge=0, le=1)
    reward_range: tuple[float, float] | None = None
    context_length: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _ordered_range(self):
        if self.reward_range is not None and self.reward_range[0] > self.reward_range[1]:
            raise ValueError("reward_range must be [low, high] with low <= high")
        return self


@dataclass(frozen=True)
class ContractParams:
    """What a suite checks against; every value comes from the spec, none is a constant."""

    kind: str
    mode: str = "enforce"
    max_truncated_fraction: float = 0.2
    max_blank_fraction: float = 0.0
    reward_range: tuple[float, float] | None = None
    group_size: int | None = None
    context_length: int | None = None

    def overridden(self, config: ContractConfig | None) -> "ContractParams":
        if config is None:
            return self
        return replace(self, **{k: v for k, v in config.model_dump().items() if v is not None})
