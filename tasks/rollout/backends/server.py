"""`rollout: {backend: server, endpoint, model, ...}`: episodes decode on an inference server's
/v1/completions, token ids in and out (vLLM >= 0.10.2 or `posttrain serve-model`;
tasks/rollout/server_policy.py). An rl stage publishes its weights there every `sync_every` optimizer
steps, saved under `sync_folder`, a folder the server reads (serve-model's --lora-folder; vLLM loads
the adapter from its path): tasks/rollout/weight_sync.py."""

from __future__ import annotations

from pathlib import PurePath
from typing import ClassVar, Literal

from pydantic import Field

from tasks.config import Endpoint
from tasks.rollout.backends.base import RolloutBackend


PUBLISHING = ("sync_every", "sync_folder", "sync_folder_mode")  # the fields of a stage that publishes weights


class ServerRollout(RolloutBackend, Endpoint):
    """Episodes decode on an inference server serving the stage's input checkpoint as `model`."""

    backend: Literal["server"]
    # prompt + completion tokens the server holds; None: its /v1/models card says (vLLM's does)
    max_model_len: int | None = Field(None, gt=0)
    sync_every: int = Field(1, ge=1)  # rl: optimizer steps between two published versions
    sync_folder: str | None = None  # rl: where versions are saved for the server to read (required there)
    # rl: the sync folder and its versions private to this user (0700), or readable by the folder's group
    # too (0750: a server running as another user of that group); never writable by others
    sync_folder_mode: Literal["private", "group"] = "private"

    samples_elsewhere: ClassVar[bool] = True

    def policy(self, folder, tokenizer, ctx, batch_size: int = 64):
        """The server's policy (nothing loaded here), checked before anything runs."""
        from models.loading import vocab_size

        return self._checked(tokenizer, vocab_size(folder))

    def trainer_policy(self, model, tokenizer, batch_size: int):
        """The server's policy for a stage training `model` (rl), checked before any training."""
        return self._checked(tokenizer, model.config.vocab_size)

    def _checked(self, tokenizer, vocab: int):
        from tasks.rollout.server_policy import ServerPolicy

        return ServerPolicy.checked(self, tokenizer, vocab)

    def publisher(self, policy, stage_id: str, lora: bool):
        from tasks.rollout.weight_sync import WeightSync

        return WeightSync(policy, self.sync_folder, stage_id, lora, every=self.sync_every,
                          folder_mode=self.sync_folder_mode)

    def check_use(self, publishes: bool) -> None:
        given = [name for name in PUBLISHING if name in self.model_fields_set]
        if not publishes and given:
            raise ValueError(f"{given[0]}: only an rl stage publishes weights")
        if publishes and self.sync_folder is None:
            raise ValueError("sync_folder: an rl stage on a server publishes its weights there (a folder the "
                             "server reads: serve-model's --lora-folder)")
        if publishes and not PurePath(self.sync_folder).is_absolute():
            raise ValueError(f"sync_folder: {self.sync_folder!r} is relative; the trainer and the server each "
                             "run in their own folder, so give the absolute path of a folder both read")

    def check_asynchronous(self, max_staleness: int | None) -> None:
        if max_staleness is not None and max_staleness < self.sync_every - 1:
            raise ValueError(f"asynchronous.max_staleness ({max_staleness}) must be at least "
                             f"rollout.sync_every - 1 ({self.sync_every - 1}): rollouts wait for weights "
                             "that recent")

    def check_checkpoints(self, count: int) -> None:
        if count != 1:
            raise ValueError("rollout: a server serves one model; evaluate one checkpoint per stage through it "
                             f"(checkpoints has {count})")

    def keyed(self, params: dict, remote_only: tuple[str, ...] = ()) -> dict:
        """What decides the rows (backend, model, the weights' sync interval, the context that cuts
        episodes), not where the server is."""
        return {**params, "rollout": self.model_dump(include={"backend", "model", "sync_every", "max_model_len"})}

    def endpoints(self) -> list[tuple[str, object]]:
        return [("rollout", self)]

    def check_endpoint(self, where: str) -> str:
        """The server's start check, as a stage runs it; what it found (vLLM and its version, or another)."""
        from tasks.rollout.server_checks import described
        from tasks.rollout.server_policy import ServerPolicy

        policy = ServerPolicy.of(self, None, where)
        policy.check()
        return described(policy)
