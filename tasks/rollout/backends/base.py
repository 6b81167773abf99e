"""What a rollout backend implements: the config of one `rollout: {backend: NAME, ...}` variant, which
builds the policy episodes decode on (tasks/rollout/episodes.py's protocol: `act`, `complete`,
`generate_many`) and answers the few questions stages ask of it. Stages never ask which backend they
hold. Kept free of heavy imports: `posttrain validate` loads every backend."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict


class RolloutBackendError(Exception):
    """A package's rollout backend that cannot be used (one line naming it and the entry point)."""


class RolloutBackend(BaseModel):
    """A backend's config; subclasses add `backend: Literal[NAME]` and their own fields."""

    model_config = ConfigDict(extra="forbid")

    # whether another engine than the trainer samples the rows: their log-probs are that engine's, and an
    # rl stage corrects for the difference (truncated importance sampling)
    samples_elsewhere: ClassVar[bool] = False

    @classmethod
    def backend_name(cls) -> str:
        return cls.model_fields["backend"].annotation.__args__[0]

    def policy(self, folder, tokenizer, ctx, batch_size: int = 64):
        """The policy of the checkpoint in local folder `folder` (generate, evaluate)."""
        raise NotImplementedError

    def trainer_policy(self, model, tokenizer, batch_size: int):
        """The policy over `model`, being trained in this process (rl): the model itself, or a server
        that receives its weights through `publisher`."""
        raise NotImplementedError

    def publisher(self, policy, stage_id: str, lora: bool):
        """What publishes a training stage's new weights to where `policy` decodes (`every`, `publish`,
        `save`, `announce`, `retire`: tasks/rollout/weight_sync.py); None where the policy decodes on the
        trained model itself."""
        return None

    def check_use(self, publishes: bool) -> None:
        """Raise ValueError (one line) unless this config fits a stage that does (rl) or does not
        (generate, evaluate) publish weights to it."""

    def check_asynchronous(self, max_staleness: int | None) -> None:
        """Raise ValueError unless an rl stage may decode here up to `max_staleness` versions ahead of
        its trainer (None: in lockstep, always allowed)."""
        if max_staleness is not None:
            raise ValueError("asynchronous: needs rollout.backend server (rollouts decode there while this trains)")

    def check_checkpoints(self, count: int) -> None:
        """Raise ValueError unless an evaluate stage may play `count` checkpoints through this backend."""

    def keyed(self, params: dict, remote_only: tuple[str, ...] = ()) -> dict:
        """A stage's cache-key params: what decides its rows, never where a server is. By default the
        backend's own fields, without `remote_only` (fields that matter only off the trainer)."""
        return {**params, "rollout": self.model_dump()}

    def endpoints(self) -> list[tuple[str, object]]:
        """(field, endpoint config) of every server this backend talks to (`validate --check-endpoints`)."""
        return []

    def check_endpoint(self, where: str) -> str:
        """Raise EndpointError or EndpointConfigError unless the server answers as rollouts need; what
        was found, for `validate --check-endpoints` to print."""
        return ""
