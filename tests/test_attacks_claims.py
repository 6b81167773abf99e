"""Concurrent runs of one stage (issue 20, item 1): a create-only claim per stage cache key, so
two runs never train one stage at once in one scratch folder; the second takes the first's
result, or takes over when the first failed or died."""

import json
import subprocess
import sys
import threading
import time

import pytest

from artifacts.store import Store
from tasks.runtime import claims
from tasks.runtime.claims import Claim, ClaimTimeout, claim_path, claim_stage

KEY = "0" * 32


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setattr(claims, "POLL_SECONDS", 0.02)
    return Store(f"file://{tmp_path}/store")


def result_of(store):
    path = store.path("cache", f"{KEY}.json")
    return (lambda: store.read_json(path) if store.exists(path) else None), path


def test_the_second_run_waits_for_the_first_and_takes_its_result(store):
    cached, path = result_of(store)
    first = claim_stage(store, KEY, "run-a", 10, cached)
    assert isinstance(first, Claim)
    outcome = {}
    waiter = threading.Thread(target=lambda: outcome.update(second=claim_stage(store, KEY, "run-b", 10, cached)))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive() and "second" not in outcome  # waiting, not training alongside
    store.write_json(path, {"outputs": {"checkpoint": "t/s@v1"}, "run_id": "run-a"})
    first.release()
    waiter.join(5)
    assert outcome["second"] == {"outputs": {"checkpoint": "t/s@v1"}, "run_id": "run-a"}


def test_racing_claims_have_one_winner(store):
    cached, _ = result_of(store)
    won = []
    barrier = threading.Barrier(4)

    def race(run_id):
        barrier.wait()
        try:
            won.append(claim_stage(store, KEY, run_id, 0.3, cached))
        except ClaimTimeout:
            pass

    racers = [threading.Thread(target=race, args=(f"run-{i}",)) for i in range(4)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(5)
    assert len(won) == 1 and isinstance(won[0], Claim)


def test_a_failed_holder_releases_and_the_waiter_runs_the_stage_itself(store):
    cached, _ = result_of(store)
    first = claim_stage(store, KEY, "run-a", 10, cached)
    first.release()  # failed: no cache entry
    second = claim_stage(store, KEY, "run-b", 1, cached)
    assert isinstance(second, Claim) and second.path.endswith("/1.json")


@pytest.mark.parametrize("reaped", [True, False])  # False: a zombie, as a SIGKILLed CLI is until its parent waits
def test_a_dead_holder_on_this_host_is_taken_over_at_once(store, reaped):
    cached, _ = result_of(store)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    time.sleep(0.5)
    started = claims.start_time(dead.pid)
    if reaped:
        dead.wait()
    body = {**claims.own_claim("run-a"), "pid": dead.pid, "started": started}
    store.create_only(claim_path(store, KEY, 1), json.dumps(body).encode())
    began = time.monotonic()
    taken = claim_stage(store, KEY, "run-b", 30, cached)
    assert isinstance(taken, Claim) and taken.path.endswith("/2.json") and time.monotonic() - began < 5
    dead.wait()


def test_a_holder_elsewhere_is_waited_for_until_its_heartbeat_stops(store, monkeypatch):
    cached, _ = result_of(store)
    body = {"run_id": "run-a", "host": "another-pod", "pid": 7, "started": 1, "heartbeat": time.time()}
    store.create_only(claim_path(store, KEY, 1), json.dumps(body).encode())
    with pytest.raises(ClaimTimeout, match=r"^run run-a \(pid 7 on another-pod\) has been running this stage for "
                                           r"longer than this one may wait \(0.2s\); .*claims/0{32} holds its claim$"):
        claim_stage(store, KEY, "run-b", 0.2, cached)
    store.write_json(claim_path(store, KEY, 1), {**body, "heartbeat": time.time() - claims.STALE_SECONDS - 1})
    assert isinstance(claim_stage(store, KEY, "run-b", 0.2, cached), Claim)


@pytest.mark.parametrize("planted", [b"not json", b"[]", b'{"run_id": "x"}'])
def test_a_garbage_claim_holds_nothing(store, planted):
    cached, _ = result_of(store)
    store.create_only(claim_path(store, KEY, 3), planted)
    assert claim_stage(store, KEY, "run-b", 0.2, cached).path.endswith("/4.json")


def test_a_retry_of_the_same_run_takes_its_own_claim_back(store):
    cached, _ = result_of(store)
    body = {"run_id": "run-a", "host": "another-pod", "pid": 7, "started": 1, "heartbeat": time.time()}
    store.create_only(claim_path(store, KEY, 1), json.dumps(body).encode())
    assert isinstance(claim_stage(store, KEY, "run-a", 0.2, cached), Claim)


def test_a_holder_with_this_host_name_in_another_pid_space_is_judged_by_its_heartbeat(store):
    """Containers with host networking share the host name, not the pids: a pid missing here says
    nothing about a holder there."""
    cached, _ = result_of(store)
    body = {**claims.own_claim("run-a"), "pid": 999_999_999, "pids": "another-boot:1"}
    store.create_only(claim_path(store, KEY, 1), json.dumps(body).encode())
    with pytest.raises(ClaimTimeout):
        claim_stage(store, KEY, "run-b", 0.2, cached)


def test_a_claim_beats_until_released(store, monkeypatch):
    monkeypatch.setattr(claims, "HEARTBEAT_SECONDS", 0.05)
    cached, _ = result_of(store)
    claim = claim_stage(store, KEY, "run-a", 1, cached)
    first = store.read_json(claim.path)["heartbeat"]
    time.sleep(0.3)  # e.g. waiting for GPU slots: no child runs yet, the heartbeat goes on
    assert store.read_json(claim.path)["heartbeat"] > first
    claim.release()
    time.sleep(0.2)
    assert not store.exists(claim.path)  # and no beat wrote it back
