"""Run the real `posttrain` CLI on tiny specs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from conftest import POSTTRAIN, ROOT


def tiny_spec(store: str, *, sft: dict | None = None, storage_options: dict | None = None,
              defaults: dict | None = None, **top) -> dict:
    spec = {
        "name": "tiny",
        "store": store,
        "model": {"base": "tiny-llama"},
        "envs": {"arith": {"kind": "arith", "digits": 2}},
        "defaults": defaults or {"retries": 0, "retry_delay_seconds": 0, "timeout_seconds": 600},
        "stages": [
            {"id": "warmup", "kind": "synthesize", "env": "arith", "n": 256},
            {"id": "sft", "kind": "sft", "data": "warmup", "max_steps": 12, "batch_size": 16,
             "checkpoint_every": 5, **(sft or {})},
            {"id": "final-eval", "kind": "evaluate", "checkpoints": ["sft"], "envs": ["arith"], "n": 16,
             "max_new_tokens": 48},
        ],
        **top,
    }
    if storage_options:
        spec["storage_options"] = storage_options
    return spec


def write(tmp_path: Path, spec: dict) -> Path:
    path = tmp_path / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def environment(env: dict | None) -> dict:
    """This process's environment with `env` on top; a None value removes the variable."""
    merged = {**os.environ, **(env or {})}
    return {key: value for key, value in merged.items() if value is not None}


# Ephemeral mode: no Prefect server, the flow starts its own temporary API (and evaluates new
# checkpoints inline). The e2e tests otherwise share one real server (tests/e2e/conftest.py).
EPHEMERAL = {"PREFECT_API_URL": None}


def posttrain(*args, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([POSTTRAIN, *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          env=environment(env), timeout=timeout)


def concurrently(*calls, workers: int | None = None) -> list:
    """Independent calls (each mostly waiting on a `posttrain` process) at once, in threads; their
    results in order. A CLI's start is one core's work: on 2 cores two of them take the time of one."""
    with ThreadPoolExecutor(max_workers=workers or len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


def start(*args, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([POSTTRAIN, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT, env=environment(env), start_new_session=True)


def summary(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def by_id(run_summary: dict) -> dict:
    return {stage["id"]: stage for stage in run_summary["stages"]}


def wait_while_running(process: subprocess.Popen, ready, timeout: float, why_not: str) -> None:
    """Until `ready()` holds, failing if the `start`ed process ends first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert process.poll() is None, process.stdout.read()[-3000:]
        assert time.monotonic() < deadline, why_not
        time.sleep(0.2)


def kill_once(process: subprocess.Popen, ready, timeout: float, why_not: str) -> None:
    """SIGKILL a `start`ed run (its whole process group) as soon as `ready()` holds."""
    wait_while_running(process, ready, timeout, why_not)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    time.sleep(1)


def shortened_copy(tmp_path: Path, pipeline: str, short: dict[str, dict]) -> Path:
    """pipelines/<pipeline>.yaml and examples/ copied side by side (its sources are relative to its
    folder), its store in `tmp_path` and the stages' settings overridden by `short` (stage id -> fields)."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    (tmp_path / "pipelines").mkdir()
    spec = yaml.safe_load((ROOT / "pipelines" / f"{pipeline}.yaml").read_text())
    spec["store"] = f"file://{tmp_path / 'store'}"
    for stage in spec["stages"]:
        stage.update(short.get(stage["id"], {}))
    path = tmp_path / "pipelines" / f"{pipeline}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path
