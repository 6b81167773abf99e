"""Faults a cluster has, on a real one: a real `prefect server start` on 127.0.0.1, the project's
deployments (deployments/prefect.yaml) on a process pool, real `prefect worker`s, and a stage (sft)
long enough to be hit mid-way, after its first in-stage checkpoint.

- worker_lost: a worker's whole process tree SIGKILLed; the flow sees the stage's claim go silent,
  marks its flow run Crashed, submits it again, and a second worker resumes it from its checkpoint.
- orchestrator_lost: `posttrain run` SIGKILLed; the worker finishes the stage and commits it, and the
  same command run again adopts the stage (no second run of it) instead of submitting it.
- server_restart: the Prefect server stopped and started again under a running stage; a longer outage
  fails the run in one line, and a rerun resumes.

Each stage's final checkpoint is the one an uninterrupted run makes, bit for bit.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest
from conftest import ROOT

from e2e.helpers import EPHEMERAL, by_id, posttrain, start, summary, tiny_spec, write
from e2e.prefect_server import PREFECT, PrefectServer, descendants, flow_runs, stop, wait_until

pytestmark = [pytest.mark.xdist_group("faults"), pytest.mark.timeout(1200)]

DEPLOYMENT = "post-train-stage/post-train-stage"
MAX_STEPS, EVERY = 60, 10


def spec_for(store: Path, **workers) -> dict:
    spec = tiny_spec(f"file://{store}", sft={"max_steps": MAX_STEPS, "batch_size": 8, "checkpoint_every": EVERY},
                     defaults={"retries": 1, "retry_delay_seconds": 0, "timeout_seconds": 900})
    spec["stages"] = spec["stages"][:2]  # warmup -> sft
    if workers:
        spec["workers"] = {"deployment": DEPLOYMENT, **workers}
    return spec


@pytest.fixture(scope="module")
def uninterrupted_sft(tmp_path_factory) -> dict:
    """The sft stage's record of the same spec run start to end on this machine, without workers."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    run = posttrain("run", write(folder, spec_for(folder / "store")), "--summary-json", folder / "run.json",
                    env=EPHEMERAL)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return by_id(summary(folder / "run.json"))["sft"]


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_sft) -> str:
    """Its checkpoint."""
    return uninterrupted_sft["outputs"]["checkpoint"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A Prefect server with the project's deployments on the process pool `gpu-box`."""
    server = PrefectServer(tmp_path_factory.mktemp("prefect"))
    server.start()
    env = {**os.environ, **server.env}
    try:
        subprocess.run([PREFECT, "work-pool", "create", "gpu-box", "--type", "process"], env=env, check=True,
                       capture_output=True, timeout=120)
        deployed = subprocess.run([PREFECT, "--no-prompt", "deploy", "--all", "--prefect-file",
                                   "deployments/prefect.yaml"], env=env, cwd=ROOT, capture_output=True, text=True,
                                  timeout=300)
        assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
        yield server
    finally:
        server.stop()


class Worker:
    """A `prefect worker` of the pool, logging to a file; `kill()` SIGKILLs its whole process tree."""

    def __init__(self, server: PrefectServer, log: Path, name: str):
        self.log = log
        self.process = subprocess.Popen([PREFECT, "worker", "start", "--pool", "gpu-box", "--limit", "2", "--name",
                                         name], stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT,
                                        env={**os.environ, **server.env}, start_new_session=True)

    def kill(self) -> None:
        tree = descendants(self.process.pid) | {self.process.pid}
        os.killpg(self.process.pid, signal.SIGKILL)
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()

    def stop(self) -> None:
        stop(self.process)


def sft_failed(store: Path) -> bool:
    """The run summary records sft as failed."""
    runs = list(store.glob("runs/*.json"))
    return bool(runs) and any(stage["id"] == "sft" and stage["state"] == "failed"
                              for stage in summary(runs[0])["stages"])


def checkpointed(store: Path) -> bool:
    """sft saved its first in-stage checkpoint."""
    return bool(list(store.glob("scratch/*/step-*/DONE")))


def stage_runs(server: PrefectServer, store: Path) -> dict[str, dict]:
    """The stage flow runs of pipelines on `store`, by name."""
    return {run["name"]: run for run in flow_runs(server.api, "post-train-stage")
            if run["parameters"]["request"]["store"]["uri"] == f"file://{store}"}


def test_worker_lost_mid_stage_is_submitted_again_and_resumes_on_another_worker(tmp_path, cluster, uninterrupted,
                                                                                uninterrupted_sft):
    store = tmp_path / "store"
    spec = write(tmp_path, spec_for(store, lost_after_seconds=20, pickup_timeout_seconds=300))
    first = Worker(cluster, tmp_path / "worker-a.log", "worker-a")
    second = None
    try:
        run = start("run", spec, "--summary-json", tmp_path / "run.json", env={**cluster.env})
        wait_until(lambda: checkpointed(store) or run.poll() is not None, 600, "no in-stage checkpoint")
        first.kill()
        killed = time.time()
        second = Worker(cluster, tmp_path / "worker-b.log", "worker-b")
        output, _ = run.communicate(timeout=900)
    finally:
        first.process.poll() is None and first.kill()
        second is not None and second.stop()
    assert run.returncode == 0, output[-3000:] + (tmp_path / "worker-b.log").read_text()[-3000:]
    sft = by_id(summary(tmp_path / "run.json"))["sft"]
    assert sft["state"] == "completed" and sft["attempts"] == 2
    assert sft["outputs"]["checkpoint"] == uninterrupted  # resumed, not restarted, and the same weights
    resumed = sft["metrics"]["resumed_from_step"]
    assert resumed >= EVERY and resumed % EVERY == 0
    runs = stage_runs(cluster, store)
    run_id = summary(tmp_path / "run.json")["run_id"]
    lost, again = runs[f"{run_id}-sft"], runs[f"{run_id}-sft-2"]
    assert lost["state_type"] == "CRASHED" and lost["state"]["message"].startswith("worker lost: the stage's claim")
    assert again["state_type"] == "COMPLETED"
    detected = datetime.fromisoformat(lost["state"]["timestamp"]).timestamp() - killed
    print(f"worker_lost: detected {detected:.0f} s after the kill, resumed from step {resumed}/{MAX_STEPS}, "
          f"sft took {sft['seconds'] - uninterrupted_sft['seconds']:.0f} s longer than uninterrupted")
    assert detected < 20 + 15 + 30  # lost_after + one heartbeat + polling and a busy machine


def test_orchestrator_lost_its_stage_finishes_on_the_worker_and_a_rerun_adopts_it(tmp_path, cluster, uninterrupted):
    store = tmp_path / "store"
    spec = write(tmp_path, spec_for(store, lost_after_seconds=60))
    worker = Worker(cluster, tmp_path / "worker.log", "worker")
    try:
        first = start("run", spec, env={**cluster.env})
        wait_until(lambda: checkpointed(store) or first.poll() is not None, 600, "no in-stage checkpoint")
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        rerun_started = time.time()
        rerun = posttrain("run", spec, "--summary-json", tmp_path / "rerun.json", env={**cluster.env},
                          timeout=900)
    finally:
        worker.stop()
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    sft = by_id(summary(tmp_path / "rerun.json"))["sft"]
    assert sft["state"] == "cached" and sft["outputs"]["checkpoint"] == uninterrupted  # not run again
    sft_runs = [run for name, run in stage_runs(cluster, store).items() if re.search(r"-sft(-\d+)?$", name)]
    assert [run["state_type"] for run in sft_runs] == ["COMPLETED"]  # one run of the stage: the killed run's
    if not sft.get("adopted"):  # the worker finished before the rerun looked (its start-up: 90 s at most here)
        finished = datetime.fromisoformat(sft_runs[0]["state"]["timestamp"]).timestamp()
        assert finished < rerun_started + 90, "the rerun saw the stage running but did not adopt it"


def test_server_restart_mid_stage_is_ridden_out(tmp_path, cluster, uninterrupted):
    store = tmp_path / "store"
    spec = write(tmp_path, spec_for(store, lost_after_seconds=60))
    worker = Worker(cluster, tmp_path / "worker.log", "worker")
    try:
        run = start("run", spec, "--summary-json", tmp_path / "run.json", env={**cluster.env})
        wait_until(lambda: checkpointed(store) or run.poll() is not None, 600, "no in-stage checkpoint")
        cluster.stop()
        time.sleep(60)
        cluster.start()
        output, _ = run.communicate(timeout=900)
    finally:
        worker.stop()
    assert run.returncode == 0, output[-3000:] + (tmp_path / "worker.log").read_text()[-3000:]
    sft = by_id(summary(tmp_path / "run.json"))["sft"]
    assert sft["state"] == "completed" and sft["outputs"]["checkpoint"] == uninterrupted


def test_server_restart_longer_than_the_outage_allowed_fails_in_one_line_and_a_rerun_resumes(tmp_path, cluster,
                                                                                           uninterrupted):
    store = tmp_path / "store"
    spec = write(tmp_path, spec_for(store, lost_after_seconds=60, api_outage_seconds=20))
    worker = Worker(cluster, tmp_path / "worker.log", "worker")
    try:
        run = start("run", spec, env={**cluster.env})
        wait_until(lambda: checkpointed(store) or run.poll() is not None, 600, "no in-stage checkpoint")
        cluster.stop()
        wait_until(lambda: sft_failed(store), 300, "sft did not fail")  # the outage outlasted api_outage_seconds
        cluster.start()  # back before the flow reports its end: the run ends failed, and says why
        output, _ = run.communicate(timeout=600)
        rerun = posttrain("run", spec, "--summary-json", tmp_path / "rerun.json", env={**cluster.env},
                          timeout=900)
    finally:
        worker.stop()
    assert run.returncode == 1
    assert re.search(r"^ +error: the Prefect API has not answered for \d+ s", output, re.M), output[-3000:]
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert by_id(summary(tmp_path / "rerun.json"))["sft"]["outputs"]["checkpoint"] == uninterrupted


def test_worker_lost_before_any_picks_the_stage_up_fails_it_naming_the_pool(tmp_path, cluster):
    spec = write(tmp_path, spec_for(tmp_path / "store", pickup_timeout_seconds=10))
    run = posttrain("run", spec, "--summary-json", tmp_path / "run.json", env=cluster.env)  # no worker runs
    assert run.returncode == 1
    warmup = by_id(summary(tmp_path / "run.json"))["warmup"]
    assert re.fullmatch(r"stage 'warmup': no worker of pool 'gpu-box' picked it up within \d+ s "
                        r"\(workers\.pickup_timeout_seconds; is one running\? prefect worker start --pool gpu-box\)",
                        warmup["error"]), warmup["error"]
    [cancelled] = stage_runs(cluster, tmp_path / "store").values()
    assert cancelled["state_type"] == "CANCELLED"
