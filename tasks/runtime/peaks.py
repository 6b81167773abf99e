"""What a stage's process used at its peak: its resident memory and, on a GPU, what torch
allocated there; the child reports them (tasks/runtime/child.py) beside the device it ran on."""

from __future__ import annotations

import re
import resource
from pathlib import Path

GB = 1e9


def peak_rss_gb() -> float:
    """This process's peak resident memory (VmHWM), GB. Not ru_maxrss: a process started by exec
    (accelerate launch's) inherits its launcher's peak there (0.8 GB reported for a 13 MB child);
    VmHWM is its own address space's. A child forked from the warm fork server starts from the
    resident set at the fork (the modules it maps), never the server's earlier peak: the kernel
    sets a forked address space's high-water mark to its size at the fork."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:  # no procfs: ru_maxrss (kB on Linux) is all there is
        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB, 3)
    return round(int(re.search(r"^VmHWM:\s*(\d+) kB", status, re.MULTILINE).group(1)) * 1024 / GB, 3)


def stage_peaks(device: str) -> dict[str, float]:
    """The stage process's peak memory so far: resident (`peak_rss_gb`) and, on a GPU, what torch
    allocated there (`peak_gpu_gb`)."""
    peaks = {"peak_rss_gb": peak_rss_gb()}
    if device.startswith("cuda"):
        import torch

        peaks["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated(torch.device(device)) / GB, 3)
    return peaks


def max_over_ranks(peaks: dict[str, float], device: str) -> dict[str, float]:
    """Each peak's max over a multi-GPU stage's processes (every one calls this at the same point),
    while torch.distributed is up (a training stage's Accelerator started it); else (generate and
    evaluate under accelerate launch run no process group) this process's own: rank 0's."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return peaks
    values = torch.tensor(list(peaks.values()), dtype=torch.float64, device=device)  # NCCL: on the rank's GPU
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return dict(zip(peaks, (round(value, 3) for value in values.tolist())))


def highest(*measures: dict[str, float]) -> dict[str, float]:
    return {key: max(measure[key] for measure in measures) for key in measures[0]}
