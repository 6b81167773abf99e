"""Where an rl stage's rollouts come from, step by step: the local engine (`Rollouts`), an inference
server in lockstep with the trainer (`LockstepRollouts`), or an inference server running ahead of it
(asynchronous RL, `AheadRollouts`). The stage's `rollout:` type picks one (tasks/stages/rl/config.py).

`take(step)` returns the step's collected batch; `trained(version)` tells the source the trainer has
taken `version` optimizer steps, which publishes the weights to a server when due
(tasks/stages/rl/weight_sync.py). Asynchronously, a producer thread collects the batches of steps
t+1 … t+k while the trainer trains step t, each no more than k = `max_staleness` versions behind
the weights that train on it: the batch of step s is collected once version s − k is published.
Rows older than that are dropped and counted (`stale_groups`); what a batch waited for goes in
`rollout_wait_seconds`. A stage killed and rerun resumes from its checkpoint: batches that were
in flight are collected again from the resumed weights.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Batch:
    groups: list  # the step's training groups (lists of Scored)
    sampled: list  # every episode the step sampled
    draws: int
    stale_groups: int = 0  # groups dropped for being more than max_staleness versions old
    staleness: Counter = field(default_factory=Counter)  # trained version − sampling version, per kept episode


class Rollouts:
    """The local engine (`policy` a LocalPolicy over the trained `model`): each step's batch is
    collected when the trainer asks for it."""

    def __init__(self, collect, policy, model):
        self.collect, self.policy, self.model = collect, policy, model
        self.version = 0

    def start(self, version: int) -> None:
        self.version = version

    def take(self, step: int) -> Batch:
        groups, sampled, draws = self.collect(self.policy, step)
        self.model.train()  # the local engine decodes in eval mode
        return Batch(groups, sampled, draws, staleness=Counter(self.version - s.trajectory.policy_version
                                                                for s in sampled))

    def trained(self, version: int) -> None:
        self.version = version

    def sync_metrics(self, batch: Batch, sync_seconds: float) -> dict:
        """What a step logs about weight sync and staleness: nothing, without a server."""
        return {}

    def close(self) -> None:
        """Nothing runs in the background here."""


class LockstepRollouts(Rollouts):
    """A server (`policy` a ServerPolicy) decoding each step's batch when the trainer asks for it,
    the weights published to it (`sync`) every `sync_every` optimizer steps."""

    def __init__(self, collect, policy, model, sync, sync_every: int):
        super().__init__(collect, policy, model)
        self.sync, self.sync_every = sync, sync_every

    def start(self, version: int) -> None:
        super().start(version)
        self.sync.publish(self.model, version)

    def trained(self, version: int) -> None:
        super().trained(version)
        if version % self.sync_every == 0:
            self.sync.publish(self.model, version)

    def sync_metrics(self, batch: Batch, sync_seconds: float) -> dict:
        """Seconds spent publishing, groups dropped as stale, and how many versions behind the
        trained weights the kept episodes were sampled (mean, and a count per lag)."""
        episodes = max(1, sum(batch.staleness.values()))
        return {"sync_seconds": sync_seconds, "stale_groups": batch.stale_groups,
                "staleness": sum(k * n for k, n in batch.staleness.items()) / episodes,
                **{f"staleness_{k}": n for k, n in sorted(batch.staleness.items())}}

    def close(self) -> None:
        """Older versions a request still named when they were replaced go now."""
        self.sync.retire()


class AheadRollouts(LockstepRollouts):
    """A producer thread collecting on the server up to `max_staleness` steps ahead of the trainer."""

    def __init__(self, collect, policy, model, sync, sync_every: int, max_staleness: int, steps: int):
        super().__init__(collect, policy, model, sync, sync_every)
        self.max_staleness, self.steps = max_staleness, steps
        self.published = threading.Condition()
        self.published_version = -1
        self.batches: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        # the server loads a version between two of its batches: the trainer saves it and goes on while
        # this thread announces it (in order), so a batch decoding on the server never holds the trainer up
        self.announcer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rl-weight-sync")
        self.failure: BaseException | None = None  # of the producer or an announcement: raised at the next take

    def start(self, version: int) -> None:
        super().start(version)
        self._published(version)
        self.thread = threading.Thread(target=self._produce, args=(version,), name="rl-rollouts", daemon=True)
        self.thread.start()

    def trained(self, version: int) -> None:
        self.version = version
        if version % self.sync_every == 0:
            self.announcer.submit(self._announce, version, self.sync.save(self.model, version))

    def _announce(self, version: int, saved) -> None:
        try:
            self.sync.announce(version, saved)
        except BaseException as exc:  # noqa: BLE001 - the trainer raises it at its next take
            self._fail(exc)
            return
        self._published(version)

    def _fail(self, exc: BaseException) -> None:
        self.failure = self.failure or exc
        self.stopping.set()
        with self.published:
            self.published.notify_all()

    def take(self, step: int) -> Batch:
        while True:
            if self.failure is not None:
                raise self.failure
            try:
                produced_step, produced = self.batches.get(timeout=0.5)
                break
            except queue.Empty:
                continue
        assert produced_step == step, f"rollouts of step {produced_step} arrived for step {step}"
        oldest = self.version - self.max_staleness
        kept = [group for group in produced.groups if min(s.trajectory.policy_version for s in group) >= oldest]
        produced.stale_groups = len(produced.groups) - len(kept)
        produced.groups = kept
        produced.staleness = Counter(self.version - s.trajectory.policy_version for group in kept for s in group)
        return produced

    def close(self) -> None:
        self.stopping.set()
        with self.published:
            self.published.notify_all()
        self.announcer.shutdown(wait=True)
        if self.thread is not None:
            self.thread.join(timeout=600)
        super().close()

    def _published(self, version: int) -> None:
        with self.published:
            self.published_version = version
            self.published.notify_all()

    def _produce(self, start: int) -> None:
        for step in range(start, self.steps):
            with self.published:
                while self.published_version < step - self.max_staleness and not self.stopping.is_set():
                    self.published.wait(timeout=1.0)
            if self.stopping.is_set():
                return
            try:
                groups, sampled, draws = self.collect(self.policy, step)
            except BaseException as exc:  # noqa: BLE001 - the trainer raises it at its next take
                self._fail(exc)
                return
            self.batches.put((step, Batch(groups, sampled, draws)))
