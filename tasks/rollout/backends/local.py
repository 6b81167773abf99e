"""`rollout: {backend: local}` (the default): episodes decode on the stage's own engine (models/sampling.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from tasks.rollout.backends.base import RolloutBackend

REMOTE_FIELDS = ("endpoint", "model", "api_key_env", "max_model_len", "sync_every", "sync_folder",
                 "sync_folder_mode")


class LocalRollout(RolloutBackend):
    """Episodes decode on the stage's own engine; an rl stage's on the very model it trains."""

    backend: Literal["local"] = "local"

    @model_validator(mode="before")
    @classmethod
    def _no_server_fields(cls, data):
        if isinstance(data, dict):
            given = [name for name in REMOTE_FIELDS if name in data]
            if given:
                raise ValueError(f"{given[0]} is for backend server (backend is local)")
        return data

    def policy(self, folder, tokenizer, ctx, batch_size: int = 64):
        """The checkpoint in `folder`, loaded on the stage's device."""
        from models.loading import load_model
        from tasks.rollout.episodes import LocalPolicy

        return LocalPolicy(load_model(folder, ctx.model).to(ctx.device), tokenizer, batch_size)

    def trainer_policy(self, model, tokenizer, batch_size: int):
        from tasks.rollout.episodes import LocalPolicy

        return LocalPolicy(model, tokenizer, batch_size)

    def keyed(self, params: dict, remote_only: tuple[str, ...] = ()) -> dict:
        """A local rollout leaves the `rollout` field (and `remote_only` fields) out altogether, so keys
        made before these fields existed hold."""
        return {key: value for key, value in params.items() if key not in ("rollout", *remote_only)}
