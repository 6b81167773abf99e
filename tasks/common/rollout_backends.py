"""Where a stage's episodes decode: the spec's `rollout:`, one type per backend.

`local` decodes on the stage's own engine (models/sampling.py); `server` on an inference server's
/v1/completions, token ids in and out (vLLM >= 0.10.2 or `posttrain serve-model`;
tasks/common/server_policy.py). Each type builds its own policy, says what it adds to a stage's
cache key and which endpoints `validate --check-endpoints` probes; stages never ask which backend
they hold. An rl stage's server also receives the trained weights (tasks/stages/rl/config.py adds
those fields). Kept free of heavy imports: `posttrain validate` loads these.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from tasks.config import Endpoint

SERVER_FIELDS = ("endpoint", "model", "api_key_env", "max_model_len", "sync_every", "sync_folder")


class LocalRollout(BaseModel):
    """Episodes decode on the stage's own engine."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["local"] = "local"

    # the trainer's own engine sampled the rows: their log-probs are the trainer's, no correction needed
    samples_elsewhere: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _no_server_fields(cls, data):
        if isinstance(data, dict):
            given = [name for name in SERVER_FIELDS if name in data]
            if given:
                raise ValueError(f"{given[0]} is for backend server (backend is local)")
        return data

    def policy(self, folder, tokenizer, ctx, batch_size: int = 64):
        """The checkpoint in `folder`, loaded on the stage's device."""
        from models.loading import load_model
        from tasks.common.rollouts import LocalPolicy

        return LocalPolicy(load_model(folder, ctx.model).to(ctx.device), tokenizer, batch_size)

    def trainer_policy(self, model, tokenizer, batch_size: int):
        """The policy over a model being trained in this process (rl): that model itself."""
        from tasks.common.rollouts import LocalPolicy

        return LocalPolicy(model, tokenizer, batch_size)

    def keyed(self, params: dict, server_only: tuple[str, ...] = ()) -> dict:
        """A stage's cache-key params: a local rollout leaves the `rollout` field (and `server_only`
        fields) out altogether, so keys made before these fields existed hold."""
        return {key: value for key, value in params.items() if key not in ("rollout", *server_only)}

    def endpoints(self) -> list[tuple[str, object]]:
        return []

    def check_checkpoints(self, count: int) -> None:
        """The local engine loads each checkpoint in turn: any number."""


class ServerRollout(Endpoint):
    """Episodes decode on an inference server serving the stage's input checkpoint as `model`."""

    backend: Literal["server"]
    # prompt + completion tokens the server holds; None: its /v1/models card says (vLLM's does)
    max_model_len: int | None = Field(None, gt=0)

    # another engine sampled the rows: the trainer corrects for its log-probs (truncated importance sampling)
    samples_elsewhere: ClassVar[bool] = True

    @model_validator(mode="before")
    @classmethod
    def _no_sync_fields(cls, data):
        if isinstance(data, dict) and cls is ServerRollout:
            given = [name for name in ("sync_every", "sync_folder") if name in data]
            if given:
                raise ValueError(f"{given[0]}: only an rl stage publishes weights")
        return data

    def policy(self, folder, tokenizer, ctx, batch_size: int = 64):
        """The server's policy (nothing loaded here), checked before anything runs."""
        from models.loading import vocab_size
        from tasks.common.server_policy import ServerPolicy

        return ServerPolicy.checked(self, tokenizer, vocab_size(folder))

    def trainer_policy(self, model, tokenizer, batch_size: int):
        """The server's policy for a stage training `model` (rl), checked before any training."""
        from tasks.common.server_policy import ServerPolicy

        return ServerPolicy.checked(self, tokenizer, model.config.vocab_size)

    def keyed(self, params: dict, server_only: tuple[str, ...] = ()) -> dict:
        """What decides the rows (backend, model, the weights' sync interval, the context that cuts
        episodes), not where the server is."""
        return {**params, "rollout": self.model_dump(include={"backend", "model", "sync_every", "max_model_len"})}

    def endpoints(self) -> list[tuple[str, object]]:
        return [("rollout", self)]

    def check_checkpoints(self, count: int) -> None:
        if count != 1:
            raise ValueError("rollout: a server serves one model; evaluate one checkpoint per stage through it "
                             f"(checkpoints has {count})")


def backend_of(data) -> str | None:
    """The variant a `rollout:` mapping (or model) names, `local` when it names none; None for
    anything else (pydantic then refuses it)."""
    if isinstance(data, dict):
        return data.get("backend", "local")
    return data.backend if isinstance(data, (LocalRollout, ServerRollout)) else None


def rollout_union(local: type[LocalRollout], server: type[ServerRollout]):
    """The `rollout:` field's type: `local` or `server`, chosen by `backend` (default local)."""
    return Annotated[Union[Annotated[local, Tag("local")], Annotated[server, Tag("server")]],
                     Discriminator(backend_of)]


Rollout = rollout_union(LocalRollout, ServerRollout)
