"""AheadRollouts' ordering and failure paths on toy collectors: batches come in step order, no more
than max_staleness versions behind, and a failure on the producer's or the sync's thread fails the
trainer's next take instead of hanging it."""

import threading

import pytest

from tasks.stages.rl.ahead import AheadRollouts


class ToySync:
    """Records what the trainer published; `fail_at` makes that version's announcement raise."""

    def __init__(self, fail_at: int | None = None):
        self.fail_at, self.announced = fail_at, []

    def save(self, model, version):
        return f"v{version}"

    def announce(self, version, saved):
        if version == self.fail_at:
            raise RuntimeError(f"the server refused v{version}")
        self.announced.append(version)

    def publish(self, model, version):
        self.announce(version, self.save(model, version))

    def retire(self):
        self.retired = True


class ToyModel:
    def train(self):
        return self


def rollouts(collect, sync, steps: int = 5) -> AheadRollouts:
    return AheadRollouts(collect, policy=None, model=ToyModel(), sync=sync, sync_every=1, max_staleness=1, steps=steps)


def test_batches_arrive_in_step_order_at_most_one_version_behind():
    seen_versions = []

    def collect(policy, step):
        seen_versions.append((step, ahead.published_version))
        return [], [], 1

    sync = ToySync()
    ahead = rollouts(collect, sync)
    ahead.start(0)
    for step in range(5):
        assert ahead.take(step).draws == 1
        ahead.trained(step + 1)
    ahead.close()
    assert all(version >= step - 1 for step, version in seen_versions)
    assert sync.announced == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("where", ["collect", "announce"])
def test_a_failure_on_another_thread_fails_the_next_take(where):
    def collect(policy, step):
        if where == "collect" and step == 2:
            raise RuntimeError("the server went away")
        return [], [], 1

    ahead = rollouts(collect, ToySync(fail_at=2 if where == "announce" else None))
    ahead.start(0)
    finished = threading.Event()
    with pytest.raises(RuntimeError, match="the server went away|the server refused v2"):
        for step in range(5):
            ahead.take(step)
            ahead.trained(step + 1)
        finished.set()
    ahead.close()
    assert not finished.is_set()
