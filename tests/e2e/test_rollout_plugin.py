"""End-to-end: a rollout backend from a package (declared through the `posttrain.rollouts` entry
points) is a `rollout:` variant of every stage that has one; a generate stage plays through it."""

import pandas as pd
from toy_backend import write_toy_backend

from tasks.common.datasets import read_rows

from tests.e2e.helpers import by_id, posttrain, summary, write

ANSWER = "The final answer is 6."


def test_a_packages_rollout_backend_runs_a_generate_stage(tmp_path):
    plugins = write_toy_backend(tmp_path / "site-packages")
    store = tmp_path / "store"
    spec = write(tmp_path, {
        "name": "backend", "store": f"file://{store}", "model": {"base": "tiny-llama"},
        "envs": {"arith": {"kind": "arith", "digits": 1}},
        "defaults": {"retries": 0, "retry_delay_seconds": 0, "timeout_seconds": 600},
        "stages": [{"id": "warmup", "kind": "synthesize", "env": "arith", "n": 32},
                   {"id": "sft", "kind": "sft", "data": "warmup", "max_steps": 2, "batch_size": 8},
                   {"id": "onpolicy", "kind": "generate", "policy": "sft", "env": "arith", "n": 16, "samples": 2,
                    "greedy": 0, "rollout": {"backend": "constant", "answer": ANSWER}}]})
    env = {"PYTHONPATH": str(plugins)}
    run = posttrain("run", spec, "--summary-json", tmp_path / "run.json", env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rollouts = by_id(summary(tmp_path / "run.json"))["onpolicy"]["outputs"]["rollouts"]
    name, version = rollouts.split("@")
    rows = pd.DataFrame(read_rows(store / "artifacts" / name / version))
    assert len(rows) == 32 and set(rows["completion"]) == {ANSWER}  # every episode played by the package's policy
    assert (rows["correct"] == (rows["answer"] == "6")).all()  # and scored by the env's rubric
    assert 0 < (rows["answer"] == "6").sum() < 32

    again = posttrain("run", spec, "--summary-json", tmp_path / "again.json", env=env)
    assert [s["state"] for s in summary(tmp_path / "again.json")["stages"]] == ["cached"] * 3


def test_the_backends_of_packages_are_named_in_a_spec_error(tmp_path):
    plugins = write_toy_backend(tmp_path / "site-packages")
    spec = write(tmp_path, {
        "name": "backend", "store": f"file://{tmp_path / 'store'}", "model": {"base": "tiny-llama"},
        "envs": {"arith": {"kind": "arith", "digits": 1}},
        "stages": [{"id": "warmup", "kind": "synthesize", "env": "arith", "n": 32},
                   {"id": "sft", "kind": "sft", "data": "warmup", "max_steps": 2},
                   {"id": "onpolicy", "kind": "generate", "policy": "sft", "env": "arith", "n": 4,
                    "rollout": {"backend": "constnt"}}]})
    refused = posttrain("validate", spec, env={"PYTHONPATH": str(plugins)})
    assert refused.returncode == 2
    assert refused.stderr.strip() == ("error: stages[2].rollout.backend: unknown backend 'constnt' (expected one of "
                                      "'local', 'server', 'constant')")
