"""Checkpoint events → evaluation flows, against a real `prefect server start` on 127.0.0.1.

1. `posttrain serve` serves the evaluate-on-checkpoint trigger; a pipeline run with
   `evaluation.on_new_checkpoint` makes three checkpoints (two promoted in-stage, one final):
   exactly one evaluation flow run evaluates each checkpoint, with its results in the store
   (a second delivery of an event completes without evaluating), and the leaderboard artifact
   lists all three.
2. deployments/prefect.yaml deployed with `prefect deploy` onto a process pool; a real
   `prefect worker` runs the pipeline's stages (spec `workers.deployment`), two independent ones
   at once (`max_parallel_stages: 2`), and the triggered evaluation.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from conftest import POSTTRAIN, ROOT
from e2e.helpers import by_id, posttrain, summary, tiny_spec, write
from e2e.prefect_server import (PREFECT, automations, deployment, events, flow_runs, latest_artifact, prefect_server,
                                rest, stop_when_idle, wait_until)
from artifacts.store import Store
from flows.evaluate import DUPLICATE_DELIVERY

EVALUATION = {"on_new_checkpoint": True, "n": 8, "max_new_tokens": 16}
SIDE = {"id": "side", "kind": "synthesize", "env": "arith", "n": 64}  # a stage nothing else reads


def overlap(one: dict, other: dict, start: str, end: str) -> bool:
    """Whether two runs' [start, end] times (ISO) overlap."""
    def at(run: dict, key: str) -> datetime:
        return datetime.fromisoformat(run[key])

    return max(at(one, start), at(other, start)) < min(at(one, end), at(other, end))


def start_logged(args: list, env: dict, log: Path) -> subprocess.Popen:
    handle = open(log, "w")
    return subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **env},
                            start_new_session=True)


def completed(api: str, flow_name: str) -> list[dict]:
    return [run for run in flow_runs(api, flow_name) if run["state_type"] == "COMPLETED"]


def failed(api: str, flow_name: str) -> list[dict]:
    return [run for run in flow_runs(api, flow_name) if run["state_type"] in ("FAILED", "CRASHED")]


def redeliver(api: str, run: dict) -> str:
    """A second run of the evaluate deployment for the event of `run`, as a second delivery of
    that event would start it; its id."""
    response = rest("POST", f"{api}/deployments/{run['deployment_id']}/create_flow_run",
                    json={"parameters": run["parameters"]})
    response.raise_for_status()
    return response.json()["id"]


def state_of(api: str, run_id: str) -> dict:
    return rest("GET", f"{api}/flow_runs/{run_id}").json()["state"]


def forge_checkpoint_event(server: dict, checkpoint: str, store: Path, elsewhere: Path) -> Path:
    """What anyone who can post events could send: the event of a real checkpoint, pointing at
    another store (a copy of the real one, so only the allow-list stands in the way)."""
    shutil.copytree(store, elsewhere)
    event = {"event": "posttrain.checkpoint.created",
             "resource": {"prefect.resource.id": f"posttrain.checkpoint.{checkpoint}", "posttrain.evaluate": "true"},
             "payload": {"ref": checkpoint, "store": f"file://{elsewhere}", "storage_options": {},
                         "pipeline": "tiny", "stage": "sft", "step": None}}
    code = f"from prefect.events import emit_event; emit_event(**{event!r})"
    subprocess.run([sys.executable, "-c", code], env={**os.environ, **server}, check=True, timeout=120)
    return elsewhere


def eval_results(store: Path, checkpoint: str) -> list[str]:
    """Committed `<checkpoint name>.eval` versions whose input is this checkpoint."""
    from artifacts.store import Store

    artifact_store = Store(f"file://{store}")
    name = checkpoint.split("@")[0] + ".eval"
    refs = []
    for version in artifact_store.listdir(artifact_store.path("artifacts", name)):
        ref = f"{name}@{version}"
        if artifact_store.is_committed(ref) and checkpoint in artifact_store.manifest(ref)["inputs"].values():
            refs.append(ref)
    return refs


@pytest.mark.timeout(900)
def test_serve_evaluates_every_new_checkpoint_once_with_a_local_lm_eval_task(tmp_path):
    store = tmp_path / "store"
    # each evaluation also runs a local lm-eval task: its folder, beside the spec, kept in the store by the run
    shutil.copytree(ROOT / "tests" / "data" / "lm_eval_tasks", tmp_path / "lm_eval_tasks")
    lm_eval = {"tasks": ["arith_mc"], "include_path": "lm_eval_tasks", "limit": 4, "apply_chat_template": True}
    spec = tiny_spec(f"file://{store}", sft={"max_steps": 10, "checkpoint_every": 4},
                     evaluation={**EVALUATION, "lm_eval": lm_eval})
    spec["stages"] = spec["stages"][:2]  # warmup, sft: checkpoints sft.step-4, sft.step-8 and sft
    path = write(tmp_path, spec)
    with prefect_server(tmp_path / "prefect") as server:
        api = server["PREFECT_API_URL"]
        serve = start_logged([POSTTRAIN, "serve"], {**server, "POSTTRAIN_ALLOWED_STORES": f"file://{store}"},
                             tmp_path / "serve.log")
        try:
            wait_until(lambda: deployment(api, "evaluate", "evaluate-on-checkpoint") and automations(api), 180,
                       lambda: f"not served: {(tmp_path / 'serve.log').read_text()[-3000:]}")
            run = posttrain("run", path, "--summary-json", tmp_path / "run.json", env=server)
            assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
            assert "checkpoint events go to" in run.stdout
            sft = by_id(summary(tmp_path / "run.json"))["sft"]
            checkpoints = {sft["outputs"]["checkpoint"], *sft["metrics"]["promoted_checkpoints"]}
            assert len(checkpoints) == 3
            wait_until(lambda: {r["parameters"]["checkpoint_ref"] for r in completed(api, "evaluate")} == checkpoints,
                       600, lambda: f"evaluations: {[(r['name'], r['state_type']) for r in flow_runs(api, 'evaluate')]}"
                                    f"\n{(tmp_path / 'serve.log').read_text()[-4000:]}", interval=3)
            first = next(r for r in completed(api, "evaluate")
                         if r["parameters"]["checkpoint_ref"] == sft["outputs"]["checkpoint"])
            redelivered = redeliver(api, first)
            wait_until(lambda: state_of(api, redelivered)["type"] == "COMPLETED", 300,
                       lambda: f"redelivered event: {(tmp_path / 'serve.log').read_text()[-4000:]}", interval=3)
            forged = forge_checkpoint_event(server, sft["outputs"]["checkpoint"], store, tmp_path / "elsewhere")
            copied = sorted(forged.rglob("*"))
            wait_until(lambda: failed(api, "evaluate"), 300,
                       lambda: f"forged event: {(tmp_path / 'serve.log').read_text()[-4000:]}", interval=3)
        finally:
            stop_when_idle(serve)
        # an event naming a store the server does not allow (a copy of the real one) evaluates nothing
        [refused] = failed(api, "evaluate")
        assert refused["parameters"]["store"] == f"file://{forged}"
        assert f"store: file://{forged} is not in POSTTRAIN_ALLOWED_STORES" in refused["state"]["message"]
        assert sorted(forged.rglob("*")) == copied  # nothing written there
        # the server persists events in batches: a trigger can fire before its event is listed
        expected = len(checkpoints) + 1  # each checkpoint's event and the forged one
        wait_until(lambda: len(events(api, "posttrain.checkpoint.created")) >= expected, 30,
                   lambda: f"events listed: {events(api, 'posttrain.checkpoint.created')}", interval=1)
        created = events(api, "posttrain.checkpoint.created")
        assert sorted(e["resource"]["prefect.resource.id"] for e in created) == \
            sorted(f"posttrain.checkpoint.{ref}" for ref in [*checkpoints, sft["outputs"]["checkpoint"]])
        assert {(e["payload"]["store"], e["payload"]["pipeline"], e["payload"]["stage"]) for e in created} == \
            {(f"file://{store}", "tiny", "sft"), (f"file://{forged}", "tiny", "sft")}
        assert sorted(e["payload"]["step"] or 0 for e in created) == [0, 0, 4, 8]
        # a second delivery of an event (Prefect delivers at least once) completes without evaluating
        assert state_of(api, redelivered)["message"] == \
            f"{DUPLICATE_DELIVERY} {first['parameters']['event_id']}: flow run {first['name']} evaluates it"
        runs = [run for run in flow_runs(api, "evaluate") if run["id"] != refused["id"]
                and not (run["state"]["message"] or "").startswith(DUPLICATE_DELIVERY)]
        assert sorted(r["parameters"]["checkpoint_ref"] for r in runs) == sorted(checkpoints), \
            (tmp_path / "serve.log").read_text()[-4000:]
        assert all(r["state_type"] == "COMPLETED" for r in runs), [(r["name"], r["state_name"]) for r in runs]
        assert all(r["parameters"]["store"] == f"file://{store}" for r in runs)
        for checkpoint in checkpoints:
            assert len(eval_results(store, checkpoint)) == 1
            [result] = eval_results(store, checkpoint)
            label = checkpoint.split("@")[0].removeprefix("tiny/")  # `sft`, `sft.step-4`
            scores = Store(f"file://{store}").manifest(result)["metrics"][label]
            assert set(scores) == {"arith", "lm_eval.arith_mc"} and scores["lm_eval.arith_mc"]["n"] == 4
            assert 0 <= scores["lm_eval.arith_mc"]["acc"] <= 1
        board = latest_artifact(api, "tiny-leaderboard")
        assert board is not None and board["type"] == "table"
        rows = board["data"] if isinstance(board["data"], list) else __import__("json").loads(board["data"])
        assert {row["checkpoint"] for row in rows} == checkpoints
        assert all("arith accuracy" in row and "lm_eval.arith_mc acc" in row for row in rows)


@pytest.mark.timeout(900)
def test_prefect_yaml_on_a_process_pool_runs_stages_and_evaluations_through_a_worker(tmp_path):
    store = tmp_path / "store"
    spec = tiny_spec(f"file://{store}", sft={"max_steps": 4, "checkpoint_every": 100, "gpus": 1}, evaluation=EVALUATION,
                     workers={"deployment": "post-train-stage/post-train-stage"}, max_parallel_stages=2)
    spec["stages"] = [*spec["stages"][:2], SIDE]  # side: a branch beside warmup -> sft, run at once with warmup
    spec["model"]["base"] = "${POSTTRAIN_TEST_BASE}"  # filled on the worker, not in the flow run's parameters
    spec["model"]["device"] = "cpu"  # sft holds a GPU slot, and trains on this CPU as meant
    path = write(tmp_path, spec)
    with prefect_server(tmp_path / "prefect") as prefect_env:
        api = prefect_env["PREFECT_API_URL"]
        # the triggered evaluation reads the spec back from the store: it fills only the variables allowed;
        # the stages go to the worker signed with the request key both sides hold
        server = {**prefect_env, "POSTTRAIN_TEST_BASE": "tiny-llama", "POSTTRAIN_ALLOWED_STORES": f"file://{store}",
                  "POSTTRAIN_ALLOWED_VARIABLES": "POSTTRAIN_TEST_BASE", "POSTTRAIN_REQUEST_KEY": "k" * 64}
        env = {**os.environ, **server}
        for command in (["work-pool", "create", "gpu-box", "--type", "process"], ["gcl", "create", "gpu", "--limit", "1"]):
            subprocess.run([PREFECT, *command], env=env, check=True, capture_output=True, timeout=120)
        deployed = subprocess.run([PREFECT, "--no-prompt", "deploy", "--all", "--prefect-file",
                                   "deployments/prefect.yaml"], env=env, cwd=ROOT, capture_output=True, text=True,
                                  timeout=300)
        assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
        for flow_name, name in (("post-train", "post-train"), ("post-train-stage", "post-train-stage"),
                                ("evaluate", "evaluate-on-checkpoint")):
            assert deployment(api, flow_name, name)["work_pool_name"] == "gpu-box"
        worker = start_logged([PREFECT, "worker", "start", "--pool", "gpu-box", "--limit", "2"], server,
                              tmp_path / "worker.log")
        try:
            run = posttrain("run", path, "--summary-json", tmp_path / "run.json", env=server)
            assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:] + \
                (tmp_path / "worker.log").read_text()[-3000:]
            checkpoint = by_id(summary(tmp_path / "run.json"))["sft"]["outputs"]["checkpoint"]
            wait_until(lambda: completed(api, "evaluate"), 600,
                       lambda: f"no evaluation: {(tmp_path / 'worker.log').read_text()[-4000:]}", interval=3)
        finally:
            stop_when_idle(worker)
        stages = completed(api, "post-train-stage")
        assert sorted(r["name"].rsplit("-", 1)[-1] for r in stages) == ["sft", "side", "warmup"]
        # max_parallel_stages: 2 ran the two independent branches at once, as the flow saw them and on the worker
        first = summary(tmp_path / "run.json")
        assert overlap(*(by_id(first)[stage_id] for stage_id in ("warmup", "side")), "started", "finished")
        assert overlap(*(run for run in stages if run["name"].endswith(("-warmup", "-side"))), "start_time", "end_time")
        assert all(r["work_pool_name"] == "gpu-box" for r in stages + completed(api, "evaluate"))
        assert all(r["parameters"]["request"]["model"]["base"] == "${POSTTRAIN_TEST_BASE}" for r in stages)
        assert all(len(r["parameters"]["request_signature"]) == 64 for r in stages)  # signed, and ran
        assert not any("tiny-llama" in json.dumps(r["parameters"]) for r in stages)  # nor derived from it
        [pipeline_run] = flow_runs(api, "post-train")
        assert "base: ${POSTTRAIN_TEST_BASE}" in pipeline_run["parameters"]["spec_text"]
        # the sft stage (gpus: 1) held a slot of the global concurrency limit `gpu`
        assert [e["resource"]["prefect.resource.name"] for e in events(api, "prefect.concurrency-limit.acquired")] \
            == ["gpu"]
        [evaluation] = flow_runs(api, "evaluate")
        assert evaluation["parameters"]["checkpoint_ref"] == checkpoint
        assert len(eval_results(store, checkpoint)) == 1
        # a rerun finds every stage in the store: the flow submits none of them to a worker (no pod would
        # start just to read a cache entry), and nothing new means no new evaluation
        worker = start_logged([PREFECT, "worker", "start", "--pool", "gpu-box", "--limit", "2"], server,
                              tmp_path / "worker2.log")
        try:
            again = posttrain("run", path, "--summary-json", tmp_path / "again.json", env=server)
        finally:
            stop_when_idle(worker)
        assert again.returncode == 0, again.stdout[-3000:] + (tmp_path / "worker2.log").read_text()[-3000:]
        assert {s["id"]: s["state"] for s in summary(tmp_path / "again.json")["stages"]} == \
            {"warmup": "cached", "side": "cached", "sft": "cached"}
        assert len(flow_runs(api, "post-train-stage")) == 3 and len(flow_runs(api, "evaluate")) == 1
