"""Which of this box's GPUs a stage's child runs on: one lock file per GPU, held while it runs.

The Prefect limit `gpu` caps how many GPUs stages hold across the pool; it cannot say which.
A stage holding k slots also takes k GPUs of its box whose locks no other running stage holds
and its child sees only those (CUDA_VISIBLE_DEVICES). The locks are flocks: the kernel drops
them when their holder dies, so a killed worker leaves no GPU taken. Only the orchestrating
process (the task's) locks; torch is never imported here.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import time
from functools import lru_cache
from pathlib import Path

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
INDICES_VARIABLE = "POSTTRAIN_GPU_INDICES"  # the box's GPUs, comma-separated: replaces detection (tests)
LOCK_DIR_VARIABLE = "POSTTRAIN_GPU_LOCK_DIR"
DEFAULT_LOCK_DIR = "/tmp/posttrain-gpu-locks"
RETRY_SECONDS = 0.2  # how often a stage waiting for GPUs tries the locks again
NVIDIA_SMI_SECONDS = 20


class GpusUnavailable(Exception):
    """No GPUs of this box for the stage (too few, or none freed in time); str() is the one-line message."""


class GpuLease:
    """GPUs of this box locked for one stage until `release()` (or the end of a `with`); empty
    on a box without GPUs or for a stage that asks for none."""

    def __init__(self, locks: dict[str, int]):
        self.locks = locks  # CUDA_VISIBLE_DEVICES entry -> open lock file descriptor

    @property
    def gpus(self) -> list[str]:
        return list(self.locks)

    def child_env(self) -> dict[str, str]:
        """What the stage's child adds to its environment: only its GPUs visible (nothing without GPUs)."""
        return {VISIBLE_DEVICES: ",".join(self.locks)} if self.locks else {}

    def release(self) -> None:
        for descriptor in self.locks.values():
            os.close(descriptor)  # closing drops the flock
        self.locks = {}

    def __enter__(self) -> GpuLease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def box_gpus() -> list[str]:
    """This box's GPUs as CUDA_VISIBLE_DEVICES entries: POSTTRAIN_GPU_INDICES when set; else the
    CUDA_VISIBLE_DEVICES this worker was given (a Kubernetes pod's own devices: only those);
    else one index per GPU the driver lists."""
    for variable in (INDICES_VARIABLE, VISIBLE_DEVICES):
        if variable in os.environ:
            return visible_entries(os.environ[variable])
    return [str(index) for index in range(driver_gpu_count())]


def visible_entries(value: str) -> list[str]:
    """The devices a CUDA_VISIBLE_DEVICES value names, in order: CUDA stops at a negative index ("-1": none)."""
    entries = []
    for entry in (part.strip() for part in value.split(",")):
        if not entry or re.fullmatch(r"-\d+", entry):
            break
        entries.append(entry)
    return entries


@lru_cache(maxsize=1)
def driver_gpu_count() -> int:
    """How many GPUs the NVIDIA driver shows this process (nvidia-smi, else /proc); 0 without one."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_SECONDS,
                                     check=True).stdout
            return sum(line.startswith("GPU ") for line in listing.splitlines())
        except (OSError, subprocess.SubprocessError):
            pass  # a driver nvidia-smi cannot talk to: ask /proc
    proc = Path("/proc/driver/nvidia/gpus")
    return len(list(proc.iterdir())) if proc.is_dir() else 0


def lock_dir() -> Path:
    """Where the box's GPU locks live: shared by every worker of the box (POSTTRAIN_GPU_LOCK_DIR)."""
    folder = Path(os.environ.get(LOCK_DIR_VARIABLE) or DEFAULT_LOCK_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def lock_path(folder: Path, gpu: str) -> Path:
    """A GPU's lock file; a UUID or MIG entry (`MIG-…/1/0`) becomes a plain file name."""
    return folder / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', gpu)}.lock"


def try_lock(path: Path) -> int | None:
    """The lock's open descriptor if no one else holds it, else None. Each open file gets a lock of
    its own, so two stages of one process exclude each other too."""
    descriptor = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        return None
    return descriptor


def try_lease(count: int, gpus: list[str], folder: Path) -> GpuLease | None:
    """`count` free GPUs, the lowest first, or None (holding none: a stage holding part of what it
    needs while it waits for the rest could deadlock with another doing the same)."""
    lease = GpuLease({})
    for gpu in gpus:
        descriptor = try_lock(lock_path(folder, gpu))
        if descriptor is not None:
            lease.locks[gpu] = descriptor
            if len(lease.locks) == count:
                return lease
    lease.release()
    return None


def lease_gpus(count: int, timeout: float) -> GpuLease:
    """`count` GPUs of this box no other running stage holds, waiting up to `timeout` seconds for
    them; an empty lease when the stage asks for none or the box has none (it runs on the CPU)."""
    gpus = box_gpus()
    if count == 0 or not gpus:
        return GpuLease({})
    if count > len(gpus):
        raise GpusUnavailable(f"asks for {count} GPUs, this box has {len(gpus)} ({','.join(gpus)})")
    folder = lock_dir()
    deadline = time.monotonic() + timeout
    while True:
        lease = try_lease(count, gpus, folder)
        if lease is not None:
            return lease
        if time.monotonic() >= deadline:
            raise GpusUnavailable(f"{count} of this box's GPUs ({','.join(gpus)}) were not free within {timeout:g}s "
                                  f"(the stages holding them lock {folder})")
        time.sleep(RETRY_SECONDS)
