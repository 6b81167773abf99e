"""End-to-end: an rl stage killed mid-stage through the real CLI resumes from its in-stage
checkpoint, keeps its promoted checkpoints and metrics history, then reruns cached."""

import json

from artifacts.store import Store
from tests.e2e.helpers import by_id, kill_once, posttrain, start, summary, tiny_spec, write

RL_STEPS = 8


def rl_spec(store) -> dict:
    pipeline = tiny_spec(f"file://{store}")
    pipeline["stages"][2:2] = [
        {"id": "rl", "kind": "rl", "policy": "sft", "envs": {"arith": 1.0}, "steps": RL_STEPS, "prompts_per_step": 2,
         "group_size": 3, "max_tokens": 16, "checkpoint_every": 2, "anti_doom": {"penalty": 0.5}}]
    # evaluated, not measured: fewer, shorter answers (two checkpoints, each greedy and sampled)
    pipeline["stages"][3].update(checkpoints=["sft", "rl"], n=8, max_new_tokens=16)
    return pipeline


def test_rl_killed_mid_stage_resumes_with_its_history_then_reruns_cached(tmp_path):
    store = tmp_path / "store"
    spec = write(tmp_path, rl_spec(store))
    # rl promotes step 2 before writing its scratch state; sft's scratch is gone once sft committed
    kill_once(start("run", spec),
              lambda: list(store.glob("artifacts/tiny/rl.step-*/*/MANIFEST.json"))
              and list(store.glob("scratch/*/step-*/DONE")),
              420, "no in-stage checkpoint of the rl stage appeared")
    assert not list(store.glob("artifacts/tiny/rl/*/MANIFEST.json"))  # the stage's own output is not there

    rerun = posttrain("run", spec, "--summary-json", tmp_path / "rerun.json")
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    stages = by_id(summary(tmp_path / "rerun.json"))
    assert [stages[s]["state"] for s in ("warmup", "sft")] == ["cached"] * 2
    rl = stages["rl"]
    resumed_from = rl["metrics"]["resumed_from_step"]
    assert rl["state"] == "completed" and resumed_from >= 2 and resumed_from % 2 == 0
    assert f"resuming from in-stage checkpoint at step {resumed_from}/{RL_STEPS}" in rerun.stdout
    assert not list(store.glob("scratch/*"))

    promoted = rl["metrics"]["promoted_checkpoints"]
    assert [ref.split("@")[0] for ref in promoted] == [f"tiny/rl.step-{n}" for n in range(2, RL_STEPS, 2)]
    artifacts = Store(f"file://{store}")
    assert all(artifacts.manifest(ref)["kind"] == "checkpoint" for ref in promoted)
    report = artifacts.fetch(rl["outputs"]["report"])
    history = [json.loads(line) for line in (report / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == list(range(1, RL_STEPS + 1))  # the steps before the kill survived
    assert {"reward", "accuracy", "entropy", "doom_loop_rate"} <= set(history[-1])
    assert (report / "curves.png").exists() and "![curves](curves.png)" in (report / "report.md").read_text()
    assert set(stages["final-eval"]["metrics"]) == {"sft", "rl"}

    again = posttrain("run", spec, "--summary-json", tmp_path / "again.json")
    assert again.returncode == 0
    run = summary(tmp_path / "again.json")
    assert [s["state"] for s in run["stages"]] == ["cached"] * 4
    assert by_id(run)["rl"]["outputs"] == rl["outputs"]
