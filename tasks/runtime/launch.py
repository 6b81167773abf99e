"""How a stage's process starts: forked from a warm fork server (one GPU or none), or under
`accelerate launch` (one process per GPU). Both run tasks.runtime.child over the request file.

Every stage process imports torch, transformers, Great Expectations and its kind's module (~12 s
on this 2-core machine): the fork server imports them once per orchestrator process, so each
stage starts as a fork of it in a fraction of a second.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

from tasks.kinds import warm_modules
from tasks.runtime.cache import ROOT

CHILD_MODULE = "tasks.runtime.child"
ACCELERATE_CONFIG = "accelerate.yaml"  # beside the request file: the stage's accelerate config, if it has one
CHILD_ENV_DEFAULTS = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


class ForkedChild:
    """The stage in a process forked from the warm fork server: `tasks.runtime.child.forked_main`, with
    the environment and working folder `python -m tasks.runtime.child` would get."""

    def __init__(self, request_path: Path, result_path: Path, extra_env: dict[str, str] | None = None):
        from tasks.runtime.child import forked_main

        self.process = _fork_server().Process(target=forked_main, args=(str(request_path), str(result_path),
                                                                         _child_env(extra_env), str(ROOT),
                                                                         os.getpid()))
        self.process.start()

    def poll(self) -> int | None:
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()
        self.process.join()


class LaunchedChild:
    """The stage under `accelerate launch` (one process per GPU)."""

    def __init__(self, gpus: int, request_path: Path, result_path: Path, extra_env: dict[str, str] | None = None):
        self.process = subprocess.Popen(child_command(gpus, request_path, result_path), cwd=str(ROOT),
                                        env=_child_env(extra_env), preexec_fn=_die_with_parent)

    def poll(self) -> int | None:
        return self.process.poll()

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()


def start_child(gpus: int, request_path: Path, result_path: Path, extra_env: dict[str, str] | None = None):
    """The stage's process, its environment this one's plus `extra_env` (the GPUs it holds:
    tasks/runtime/devices.py)."""
    if gpus > 1:
        return LaunchedChild(gpus, request_path, result_path, extra_env)
    return ForkedChild(request_path, result_path, extra_env)


@lru_cache(maxsize=1)
def _fork_server():
    """multiprocessing's fork server, preloaded with every stage kind's imports (tasks.kinds.warm_modules): a clean single-threaded process
    (not this one, which runs Prefect's threads) that every stage is forked from. It exits with
    this process; its children exit with it (their parent watchdog, tasks/runtime/child.py)."""
    import multiprocessing

    # read by huggingface_hub and transformers when they are imported, i.e. in the fork server
    for name, value in CHILD_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(warm_modules())
    return context


def warm_up(lora: bool = True) -> None:
    """Start the fork server now: it imports the stages' modules in the background (~8 s) while the
    caller starts Prefect, so the first stage does not wait for them. `lora`: whether the run's
    model has adapters (warm_modules)."""
    from multiprocessing import forkserver

    _fork_server().set_forkserver_preload(warm_modules(lora))  # read when the server starts, below
    forkserver.ensure_running()


def child_command(gpus: int, request_path: Path, result_path: Path) -> list[str]:
    """A multi-GPU stage (gpus > 1) runs `tasks.runtime.child` once per GPU under `accelerate launch`
    (DDP: each process trains on its share of every batch, rank 0 commits), or as the stage's
    accelerate config file says (FSDP, DeepSpeed) when the runner put one beside the request
    (ACCELERATE_CONFIG). Mixed precision is the stage's own (the child's Accelerator is told)."""
    child = ["-m", CHILD_MODULE, str(request_path), str(result_path)]
    config = request_path.parent / ACCELERATE_CONFIG
    how = ["--config_file", str(config)] if config.exists() else \
        ["--multi_gpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    return [sys.executable, "-m", "accelerate.commands.launch", *how, "--num_processes", str(gpus),
            "--main_process_port", str(_free_port()), *child]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """The launcher dies with the orchestrator (Linux PR_SET_PDEATHSIG); its processes, which watch
    their parent, follow. A forked child watches the orchestrator's pid itself (tasks/runtime/child.py)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def _child_env(extra_env: dict[str, str] | None = None) -> dict:
    env = {**CHILD_ENV_DEFAULTS, **os.environ, **(extra_env or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env
