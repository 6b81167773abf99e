"""End-to-end: the real CLI runs real (tiny) pipelines through Prefect's local API."""

import json
import os
import re
import shutil
import signal
import time

import pandas as pd
from transformers import AutoModelForCausalLM

from artifacts.store import Store
from tasks.runtime.processes import alive
from tests.e2e.helpers import (by_id, concurrently, kill_once, posttrain, start, summary, tiny_spec,
                               wait_while_running, write)
from tests.e2e.prefect_server import descendants, flow_run_named, rest


def task_run_ids(run_id: str, stage_id: str) -> list[str]:
    """The ids of stage `stage_id`'s task runs in pipeline run `run_id`, from the Prefect API."""
    api = os.environ["PREFECT_API_URL"]
    body = {"flow_runs": {"id": {"any_": [flow_run_named(api, run_id)["id"]]}}, "task_runs": {"name": {"any_": [stage_id]}}}
    return [run["id"] for run in rest("POST", f"{api}/task_runs/filter", json=body).json()]


def task_run_logs(run_id: str, stage_id: str) -> list[str]:
    body = {"logs": {"task_run_id": {"any_": task_run_ids(run_id, stage_id)}}, "limit": 200}
    return [log["message"] for log in rest("POST", f"{os.environ['PREFECT_API_URL']}/logs/filter", json=body).json()]


def progress_artifacts(run_id: str, stage_id: str) -> list[dict]:
    body = {"artifacts": {"type": {"any_": ["progress"]}, "task_run_id": {"any_": task_run_ids(run_id, stage_id)}}}
    return rest("POST", f"{os.environ['PREFECT_API_URL']}/artifacts/filter", json=body).json()


def test_run_then_rerun_is_all_cached_with_same_refs(tmp_path):
    store = tmp_path / "store"
    pipeline = tiny_spec(f"file://{store}")
    pipeline["stages"].append({"id": "onpolicy", "kind": "generate", "policy": "sft", "env": "arith", "n": 4,
                               "samples": 2, "greedy": 1, "max_tokens": 24,
                               "contract": {"max_truncated_fraction": 1.0}})  # a 12-step model rarely ends
    spec = write(tmp_path, pipeline)
    first = posttrain("run", spec, "--summary-json", tmp_path / "first.json")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run1 = summary(tmp_path / "first.json")
    assert [s["state"] for s in run1["stages"]] == ["completed"] * 4
    for stage in run1["stages"]:
        assert set(stage) >= {"id", "kind", "state", "outputs", "metrics", "seconds"}
    evaluation = by_id(run1)["final-eval"]["metrics"]
    assert set(evaluation) == {"sft"}
    assert set(evaluation["sft"]["arith"]) >= {"accuracy", "format_rate", "doom_loop_rate", "mean_completion_tokens"}
    assert (store / "runs" / f"{run1['run_id']}.json").exists()
    assert "checkpoint" in first.stdout and "accuracy" in first.stdout  # the metrics table
    assert "WARNING" not in first.stdout + first.stderr  # a clean run says nothing to worry about
    # each stage's lines are in its task run's logs on the Prefect server, with the progress lines
    assert "[warmup] 256 examples" in " ".join(task_run_logs(run1["run_id"], "warmup"))
    assert any(re.match(r"\[sft\] step 12/12 ", line) for line in task_run_logs(run1["run_id"], "sft"))
    assert [a["data"] for a in progress_artifacts(run1["run_id"], "sft")] == [100.0]  # live while it ran
    manifests = Store(f"file://{store}")
    rollouts = pd.read_parquet(manifests.fetch(by_id(run1)["onpolicy"]["outputs"]["rollouts"]) / "data.parquet")
    assert len(rollouts) == 12 and set(rollouts.groupby("prompt_id").size()) == {3}
    assert all(len(t) == len(lp) > 0 for t, lp in zip(rollouts["tokens"], rollouts["logprobs"]))
    for stage, key in (("warmup", "dataset"), ("final-eval", "results"), ("onpolicy", "rollouts")):
        contract = manifests.manifest(by_id(run1)[stage]["outputs"][key])["metrics"]["contract"]  # datasets carry it
        assert contract["success"] is True and contract["expectations"] >= 5

    began = time.monotonic()
    second = posttrain("run", spec, "--summary-json", tmp_path / "second.json")
    rerun_seconds = time.monotonic() - began
    run2 = summary(tmp_path / "second.json")
    assert second.returncode == 0
    assert [s["state"] for s in run2["stages"]] == ["cached"] * 4
    assert [s["outputs"] for s in run2["stages"]] == [s["outputs"] for s in run1["stages"]]
    assert "[sft] step" not in second.stdout  # nothing was computed
    print(f"cached rerun took {rerun_seconds:.1f}s")

    # the read-only commands on the store are independent: two at a time (each a CLI start, a core's work)
    sft_ref = by_id(run1)["sft"]["outputs"]["checkpoint"]
    status, one, lineage, verified = concurrently(
        lambda: posttrain("status", "--store", f"file://{store}"),
        lambda: posttrain("status", run2["run_id"], "--store", f"file://{store}"),
        lambda: posttrain("lineage", sft_ref, "--store", f"file://{store}"),
        lambda: posttrain("verify", sft_ref, "--store", f"file://{store}"), workers=2)
    assert run1["run_id"] in status.stdout and run2["run_id"] in status.stdout
    assert "cached" in one.stdout and "final-eval" in one.stdout

    # a checkpoint copied out of the store loads with plain transformers
    copied = shutil.copytree(Store(f"file://{store}").fetch(sft_ref), tmp_path / "copied")
    model = AutoModelForCausalLM.from_pretrained(str(copied))
    assert model.config.model_type == "llama"

    assert lineage.returncode == 0
    assert lineage.stdout.splitlines()[0].startswith(sft_ref)
    assert by_id(run1)["warmup"]["outputs"]["dataset"] in lineage.stdout
    assert "spec tiny" in lineage.stdout and "base model preset:tiny-llama" in lineage.stdout

    assert verified.returncode == 0 and "ok" in verified.stdout
    name, version = sft_ref.split("@")
    (store / "artifacts" / name / version / "config.json").write_text("{}")
    tampered = posttrain("verify", sft_ref, "--store", f"file://{store}")
    assert tampered.returncode == 1 and "config.json: sha256" in tampered.stdout


# The kill lands a few steps after the first in-stage checkpoint (step 10; the runs seen: before step
# 20); the steps left are margin, and the rerun trains them all.
MAX_STEPS = 80


def test_sigkill_during_sft_then_rerun_resumes_mid_stage(tmp_path):
    store = tmp_path / "store"
    pipeline = tiny_spec(f"file://{store}", sft={"max_steps": MAX_STEPS, "batch_size": 8, "checkpoint_every": 10})
    pipeline["stages"] = pipeline["stages"][:2]  # warmup -> sft: nothing after the resumed stage to wait for
    spec = write(tmp_path, pipeline)
    shown = []

    def checkpoint_and_status() -> bool:
        """An in-stage checkpoint exists, and `posttrain status` shows the running stage's step."""
        runs = list(store.glob("runs/*.json"))
        if not list(store.glob("scratch/*/step-*/DONE")) or not runs:
            return False
        status = posttrain("status", runs[0].stem, "--store", f"file://{store}")
        shown.append(status.stdout)
        return bool(re.search(rf"^sft +running +step \d+/{MAX_STEPS} \(\d+%\)(, ETA \S+)?$", status.stdout, re.M))

    kill_once(start("run", spec), checkpoint_and_status, 300, "no in-stage checkpoint, or no running step shown")
    assert not list(store.glob("artifacts/tiny/sft/*/MANIFEST.json")), shown[-1:]  # no committed sft yet

    rerun = posttrain("run", spec, "--summary-json", tmp_path / "rerun.json")
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    stages = by_id(summary(tmp_path / "rerun.json"))
    assert stages["warmup"]["state"] == "cached"
    assert stages["sft"]["state"] == "completed"
    resumed_from = stages["sft"]["metrics"]["resumed_from_step"]
    assert resumed_from >= 10 and resumed_from % 10 == 0
    assert f"resuming from in-stage checkpoint at step {resumed_from}/{MAX_STEPS}" in rerun.stdout
    assert not list(store.glob("scratch/*"))  # in-stage checkpoints are dropped once committed


def test_sigterm_stops_the_run_its_stage_and_every_process_of_it(tmp_path):
    """What an orchestrator (Kubernetes, systemd) sends to stop a run: SIGTERM, to the CLI alone.
    The running stage's child is killed, the CLI exits at once and leaves no process behind, and
    its flow run ends Crashed instead of showing Running."""
    store = tmp_path / "store"
    pipeline = tiny_spec(f"file://{store}", sft={"max_steps": 100000, "checkpoint_every": 10})
    pipeline["stages"] = pipeline["stages"][:2]
    run = start("run", write(tmp_path, pipeline))
    wait_while_running(run, lambda: list(store.glob("scratch/*/step-*/DONE")), 300, "sft never checkpointed")
    processes = descendants(run.pid)
    os.kill(run.pid, signal.SIGTERM)
    began = time.monotonic()
    printed = run.communicate(timeout=120)[0]
    assert time.monotonic() - began < 60, printed[-3000:]
    assert run.returncode != 0
    time.sleep(2)
    assert not [pid for pid in processes if alive(pid)], printed[-3000:]  # the stage, the fork server, the API: gone
    run_id = re.search(r"^run (\S+)", printed, re.M).group(1)
    flow_run = flow_run_named(os.environ["PREFECT_API_URL"], run_id)
    assert flow_run["state_type"] == "CRASHED", flow_run["state"]
    assert not list(store.glob("artifacts/tiny/sft/*/MANIFEST.json"))


def test_timeout_stops_the_stage_and_everything_downstream(tmp_path):
    store = tmp_path / "store"
    spec = write(tmp_path, tiny_spec(f"file://{store}", sft={"max_steps": 100000, "timeout_seconds": 5}))
    began = time.monotonic()
    result = posttrain("run", spec, "--summary-json", tmp_path / "run.json")
    assert result.returncode == 1
    assert time.monotonic() - began < 120
    run = summary(tmp_path / "run.json")
    stages = by_id(run)
    assert run["state"] == "failed" and stages["sft"]["state"] == "failed"
    assert "timed out after 5s" in stages["sft"]["error"]
    assert run["not_run"] == ["final-eval"]
    status = posttrain("status", run["run_id"], "--store", f"file://{store}")
    assert "timed out after 5s" in status.stdout and "not run" in status.stdout
    assert not list(store.glob("artifacts/tiny/sft/*"))


def test_quickstart_shape_on_s3_via_moto_server(s3_run):
    result, run, s3_endpoint, env = s3_run.result, s3_run.summary, s3_run.endpoint, s3_run.env
    assert run["store"] == "s3://posttrain-test/e2e"
    sft_ref = by_id(run)["sft"]["outputs"]["checkpoint"]
    lineage = posttrain("lineage", sft_ref, "--store", "s3://posttrain-test/e2e", env={
        **env, "AWS_ENDPOINT_URL_S3": s3_endpoint})
    assert lineage.returncode == 0, lineage.stderr
    lines = lineage.stdout.splitlines()
    assert lines[0].startswith(sft_ref) and "tiny/warmup@" in lineage.stdout and "spec tiny" in lineage.stdout
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    store = Store("s3://posttrain-test/e2e", {"endpoint_url": s3_endpoint})
    texts = [result.stdout, result.stderr, json.dumps(run)]
    texts += [json.dumps(store.manifest(ref)) for stage in run["stages"] for ref in stage["outputs"].values()]
    assert all(secret not in text for text in texts)
