"""Whether a process lives (stdlib only: the stage child's watchdog and the CLI's reaper use it)."""

from __future__ import annotations


def alive(pid: int) -> bool:
    """True while `pid` runs: False once it is gone or a zombie nobody reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot): with the pid, names one process even after the
    pid is reused. None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[19])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None
