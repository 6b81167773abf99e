"""Asynchronous RL (`asynchronous: {max_staleness: k}`): a producer thread collects the batches of
steps t+1 … t+k on the rollout server while the trainer trains step t, each no more than k versions
behind the weights that train on it: the batch of step s is collected once version s − k is published.
Rows older than that are dropped and counted (`stale_groups`). A stage killed and rerun resumes from
its checkpoint: batches that were in flight are collected again from the resumed weights. In
lockstep the stage samples, updates and publishes by direct calls instead (tasks/stages/rl/stage.py).
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field


@dataclass
class Batch:
    groups: list  # the step's training groups (lists of Scored)
    sampled: list  # every episode the step sampled
    draws: int
    stale_groups: int = 0  # groups dropped for being more than max_staleness versions old
    staleness: Counter = field(default_factory=Counter)  # trained version − sampling version, per kept episode


def sync_metrics(batch: Batch, sync_seconds: float) -> dict:
    """What a step logs about publishing weights to a server: seconds spent, groups dropped as stale,
    and how many versions behind the trained weights the kept episodes were sampled (mean, and a
    count per lag)."""
    episodes = max(1, sum(batch.staleness.values()))
    return {"sync_seconds": sync_seconds, "stale_groups": batch.stale_groups,
            "staleness": sum(k * n for k, n in batch.staleness.items()) / episodes,
            **{f"staleness_{k}": n for k, n in sorted(batch.staleness.items())}}


class AheadRollouts:
    """A producer thread collecting on the server (`policy`) up to `max_staleness` steps ahead of the
    trainer; `collect(policy, step)` plays and scores a step's groups, `sync` publishes `model`'s
    weights every `sync_every` optimizer steps."""

    def __init__(self, collect, policy, model, sync, sync_every: int, max_staleness: int, steps: int):
        self.collect, self.policy, self.model = collect, policy, model
        self.sync, self.sync_every = sync, sync_every
        self.version = 0
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
        """Publish the weights the stage starts from, then start producing."""
        self.version = version
        self.sync.publish(self.model, version)
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
        self.sync.retire()  # older versions a request still named when they were replaced go now

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
