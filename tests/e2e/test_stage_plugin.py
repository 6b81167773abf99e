"""End-to-end: a stage kind from a package (its module + its config class, declared through the
`posttrain.stages` entry points) runs through `posttrain run` and feeds a built-in stage."""

from toy_stage import write_toy_stage

from artifacts.store import Store
from tests.e2e.helpers import by_id, posttrain, summary, write


def test_a_packages_stage_kind_runs_through_posttrain_run(tmp_path):
    plugins = write_toy_stage(tmp_path / "site-packages")
    store = tmp_path / "store"
    spec = write(tmp_path, {
        "name": "plugin", "store": f"file://{store}", "model": {"base": "tiny-llama"},
        "envs": {"arith": {"kind": "arith", "digits": 1}},
        "defaults": {"retries": 0, "retry_delay_seconds": 0, "timeout_seconds": 600},
        "stages": [{"id": "sums", "kind": "sums", "n": 64},
                   {"id": "sft", "kind": "sft", "data": "sums", "max_steps": 3, "batch_size": 8}]})
    run = posttrain("run", spec, "--summary-json", tmp_path / "run.json", env={"PYTHONPATH": str(plugins)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    stages = by_id(summary(tmp_path / "run.json"))
    assert [stages[s]["state"] for s in ("sums", "sft")] == ["completed", "completed"]
    assert "[sums] 64 sums written by a package's stage kind" in run.stdout  # its own process ran its `run`
    dataset = stages["sums"]["outputs"]["dataset"]
    artifacts = Store(f"file://{store}")
    manifest = artifacts.manifest(dataset)
    assert dataset.startswith("plugin/sums@") and manifest["producer"]["stage_kind"] == "sums"
    assert manifest["metrics"]["contract"]["success"] is True  # its dataset passed the sft contract
    assert artifacts.manifest(stages["sft"]["outputs"]["checkpoint"])["inputs"] == {"sums": dataset}

    again = posttrain("run", spec, "--summary-json", tmp_path / "again.json", env={"PYTHONPATH": str(plugins)})
    assert again.returncode == 0
    assert [s["state"] for s in summary(tmp_path / "again.json")["stages"]] == ["cached", "cached"]
