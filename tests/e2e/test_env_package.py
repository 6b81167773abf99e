"""End-to-end: an env kind from an installed package (a `posttrain.envs` entry point), installed
with pip from a local folder into a target of its own (no index, no network, the venv untouched),
listed by `posttrain envs list`, checked and run by a spec (tests/test_env_kinds.py: its version in
the cache keys)."""

import subprocess
import sys

from toy_env import write_echo_env

from tests.e2e.helpers import by_id, concurrently, posttrain, summary, write


def pip_install(source, target) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-build-isolation",
                           "--no-deps", "--target", str(target), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_installed_env_package_is_listed_and_runs_in_a_spec(tmp_path):
    site = tmp_path / "site-packages"
    pip_install(write_echo_env(tmp_path / "echo-src", "0.3.0"), site)
    env = {"PYTHONPATH": str(site)}
    store = tmp_path / "store"
    spec = write(tmp_path, {
        "name": "echo", "store": f"file://{store}", "model": {"base": "tiny-llama"}, "envs": {"words": {"kind": "echo"}},
        "defaults": {"retries": 0, "retry_delay_seconds": 0, "timeout_seconds": 600},
        "stages": [{"id": "warmup", "kind": "synthesize", "env": "words", "n": 32},
                   {"id": "sft", "kind": "sft", "data": "warmup", "max_steps": 3, "batch_size": 8},
                   {"id": "final-eval", "kind": "evaluate", "checkpoints": ["sft"], "envs": ["words"], "n": 3,
                    "max_new_tokens": 8, "sampled": None}]})
    unknown = write(tmp_path, {"name": "nope", "envs": {"x": {"kind": "ech"}},
                               "stages": [{"id": "w", "kind": "synthesize", "env": "x", "n": 1}]})
    # independent commands, each with the package on its path: the short ones beside the run
    run, listed, checked, refused = concurrently(
        lambda: posttrain("run", spec, "--summary-json", tmp_path / "run.json", env=env),
        lambda: posttrain("envs", "list", env=env), lambda: posttrain("envs", "check", "echo", env=env),
        lambda: posttrain("validate", unknown, env=env), workers=2)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[-1].split() == ["echo", "echo-env", "0.3.0", "echo_env:EchoEnv"]
    assert checked.returncode == 0 and "echo: 12/12 tasks hold" in checked.stdout, checked.stdout + checked.stderr

    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    stages = by_id(summary(tmp_path / "run.json"))
    assert [stages[s]["state"] for s in ("warmup", "sft", "final-eval")] == ["completed"] * 3
    assert stages["warmup"]["metrics"]["teacher_accuracy"] == 1.0
    assert stages["final-eval"]["metrics"]["sft"]["words"]["n"] == 3

    assert refused.returncode == 2
    assert refused.stderr.startswith("error: envs.x.kind: unknown kind 'ech' (expected one of ") and "'echo'" in refused.stderr
