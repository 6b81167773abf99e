"""Run one stage: look it up in the store's stage cache, else run it in a child process.

`run_stage` is the Prefect task every stage runs as (the flow gives it the stage's name,
retries, retry delay, timeout and tags); the per-kind logic lives in the stage modules.
"""

from __future__ import annotations

import contextlib
import hashlib

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from functools import lru_cache
from pathlib import Path
from typing import Callable

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed

from artifacts.refs import hash_value
from artifacts.store import Store
from tasks.events import emit_checkpoint_created

_PACKAGES = ("artifacts", "data_contracts", "envs", "models", "tasks")
ROOT = Path(__file__).resolve().parent.parent
ANNOUNCE_POLL_SECONDS = 0.5
CHILD_ENV_DEFAULTS = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
GPU_LIMIT = "gpu"  # the global concurrency limit capping GPU slots (`prefect gcl create gpu --limit N`)


class StageFailed(Exception):
    pass


class ContractFailed(StageFailed):
    """The stage's dataset broke its data contract: retrying cannot fix data."""


def retry_unless_contract_failed(task, task_run, state) -> bool:
    return not isinstance(state.data, ContractFailed)


@lru_cache(maxsize=1)
def code_version() -> str:
    """Hash of the source of everything a stage runs; a code change invalidates the cache."""
    sources = {}
    for package in _PACKAGES:  # sources and shipped data (env task folders)
        for path in sorted((ROOT / package).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                sources[path.relative_to(ROOT).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return hash_value(sources)[:16]


def task_folder_digest(env_config) -> str | None:
    """Hash of a user task folder's files (a changed task changes the stages that use it); None for
    envs on shipped or generated tasks, which the code version covers."""
    folder = getattr(env_config, "tasks", None)  # only the folder-based kinds have a `tasks` path
    if not isinstance(folder, str):
        return None
    files = sorted(path for path in Path(folder).rglob("*") if path.is_file())
    return hash_value({path.relative_to(folder).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
                       for path in files})


def stage_cache_key(kind: str, params: dict, inputs: dict[str, str], context: dict) -> str:
    """key = hash(stage kind, canonical params, input refs, code version, model/env configs)."""
    return hash_value({"kind": kind, "params": params, "inputs": inputs, "code": code_version(),
                       "context": context})[:32]


def cache_path(store: Store, key: str) -> str:
    return store.path("cache", f"{key}.json")


def cached_result(store: Store, key: str) -> dict | None:
    """The committed outputs of an earlier run of this exact stage, if all are still there."""
    path = cache_path(store, key)
    if not store.exists(path):
        return None
    entry = store.read_json(path)
    if not all(store.is_committed(ref) for ref in entry["outputs"].values()):
        return None
    return entry


class Announcements:
    """The checkpoints a running child announced (one JSON line each), read as they come."""

    def __init__(self, path: Path, on_checkpoint: Callable[[str, int | None], None]):
        self.path, self.on_checkpoint, self.offset, self.refs = path, on_checkpoint, 0, []

    def drain(self) -> None:
        if not self.path.exists():
            return
        with open(self.path) as handle:
            handle.seek(self.offset)
            for line in iter(handle.readline, ""):
                if not line.endswith("\n"):
                    break  # half-written: read it next time
                self.offset += len(line)
                entry = json.loads(line)
                self.refs.append(entry["ref"])
                self.on_checkpoint(entry["ref"], entry["step"])


def run_in_child(request: dict, timeout: float, on_checkpoint=lambda ref, step: None) -> dict:
    """Run the stage in `python -m tasks.child`; kill it at the timeout. `on_checkpoint(ref, step)`
    is called for every checkpoint the stage commits, while it runs; the result lists them."""
    with tempfile.TemporaryDirectory(prefix="posttrain-req-") as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        announcements = Announcements(Path(tmp) / "checkpoints.jsonl", on_checkpoint)
        request_path.write_text(json.dumps({**request, "announce_path": str(announcements.path)}))
        process = start_child(request["gpus"], request_path, result_path)
        deadline = time.monotonic() + timeout
        try:
            while process.poll() is None:
                if time.monotonic() > deadline:
                    raise StageFailed(f"stage {request['stage']['id']!r} timed out after {timeout:g}s")
                announcements.drain()
                time.sleep(ANNOUNCE_POLL_SECONDS)
        finally:
            if process.poll() is None:  # a launcher's processes exit when it does (tasks/child.py)
                process.kill()
            announcements.drain()
        if not result_path.exists():
            raise StageFailed(f"stage {request['stage']['id']!r} died (exit code {process.poll()})")
        result = json.loads(result_path.read_text())
    if "error" in result:
        raise (ContractFailed if result.get("contract_failed") else StageFailed)(result["error"])
    return {**result, "checkpoints": announcements.refs}


# What every stage child imports (~12 s on this 2-core machine): the fork server imports it once
# per orchestrator process, and each stage starts as a fork of it in a fraction of a second.
WARM_MODULES = ["torch", "transformers", "peft", "accelerate", "great_expectations", "tasks.child", "tasks.sft",
                "tasks.preference", "tasks.rl", "tasks.generate", "tasks.synthesize", "tasks.evaluate"]


class ForkedChild:
    """The stage in a process forked from the warm fork server: `tasks.child.forked_main`, with
    the environment and working folder `python -m tasks.child` would get."""

    def __init__(self, request_path: Path, result_path: Path):
        from tasks.child import forked_main

        self.process = _fork_server().Process(target=forked_main, args=(str(request_path), str(result_path),
                                                                         _child_env(), str(ROOT), os.getpid()))
        self.process.start()

    def poll(self) -> int | None:
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()
        self.process.join()


class LaunchedChild:
    """The stage under `accelerate launch` (one process per GPU)."""

    def __init__(self, gpus: int, request_path: Path, result_path: Path):
        self.process = subprocess.Popen(child_command(gpus, request_path, result_path), cwd=str(ROOT),
                                        env=_child_env(), preexec_fn=_die_with_parent)

    def poll(self) -> int | None:
        return self.process.poll()

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()


def start_child(gpus: int, request_path: Path, result_path: Path):
    return LaunchedChild(gpus, request_path, result_path) if gpus > 1 else ForkedChild(request_path, result_path)


@lru_cache(maxsize=1)
def _fork_server():
    """multiprocessing's fork server, preloaded with WARM_MODULES: a clean single-threaded process
    (not this one, which runs Prefect's threads) that every stage is forked from. It exits with
    this process; its children exit with it (their parent watchdog, tasks/child.py)."""
    import multiprocessing

    # read by huggingface_hub and transformers when they are imported, i.e. in the fork server
    for name, value in CHILD_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(WARM_MODULES)
    return context


def warm_up() -> None:
    """Start the fork server now: it imports WARM_MODULES in the background (~10 s) while the
    caller starts Prefect, so the first stage does not wait for them."""
    from multiprocessing import forkserver

    _fork_server()
    forkserver.ensure_running()


def child_command(gpus: int, request_path: Path, result_path: Path) -> list[str]:
    """A multi-GPU stage (gpus > 1) runs `tasks.child` once per GPU under `accelerate launch`
    (DDP: each process trains on its share of every batch, rank 0 commits)."""
    child = ["-m", "tasks.child", str(request_path), str(result_path)]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(gpus),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(_free_port()), *child]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """The launcher dies with the orchestrator (Linux PR_SET_PDEATHSIG); its processes, which watch
    their parent, follow. A forked child watches the orchestrator's pid itself (tasks/child.py)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def _child_env() -> dict:
    env = {**CHILD_ENV_DEFAULTS, **os.environ}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def gpu_slots(gpus: int):
    """Hold `gpus` slots of the global concurrency limit `gpu` while the stage runs, so stages wait
    for free GPUs instead of oversubscribing them. Without such a limit (a CPU machine, a server
    nobody set up) this holds nothing: the limit is the operator's choice (README, GPU cluster)."""
    if gpus == 0:
        return contextlib.nullcontext()
    from prefect.concurrency.sync import concurrency

    return concurrency(GPU_LIMIT, occupy=gpus, strict=False)


@task(cache_policy=NO_CACHE, persist_result=False, retry_condition_fn=retry_unless_contract_failed)
def run_stage(request: dict, timeout_seconds: float):
    store = Store(request["store"], request["storage_options"])
    hit = cached_result(store, request["cache_key"])
    if hit is not None:
        return Completed(name="Cached", data=hit, message=f"outputs already committed: {hit['outputs']}")
    with gpu_slots(request["gpus"]):
        result = run_in_child(request, timeout_seconds,
                              on_checkpoint=lambda ref, step: emit_checkpoint_created(ref, request, step))
    store.write_json(cache_path(store, request["cache_key"]),
                     {"stage": request["stage"]["id"], "run_id": request["run_id"], **result})
    return result
