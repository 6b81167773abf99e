"""A cgroup v2 per sandbox (memory.max, pids.max), where the host delegates one; else None.

Untested here: the development host and CI have cgroup v1 (a hybrid /sys/fs/cgroup), so every test
exercises the fallback that envs/sandbox/launch.py documents (`memory_bound`). The kernel lets
controllers be enabled only for a cgroup's children while it holds no process itself, so what is
used is the parent of this process's own cgroup: the folder a host delegates (systemd's
`Delegate=yes`, or a container's writable cgroup2 mount) with this process in a leaf of it, and
`memory` and `pids` already in the parent's cgroup.subtree_control. Sandboxes get sibling leaves.
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
WANTED = {"memory", "pids"}


def _is_cgroup2(mount_point: Path) -> bool:
    kind = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, rest = line.partition(" - ")
        if fields.split()[4] == str(mount_point):
            kind = rest.split()[0]  # the last mount at a point is the one seen
    return kind == "cgroup2"


@functools.cache
def delegated() -> Path | None:
    """The writable cgroup v2 folder sandboxes' cgroups go in, or None (then the fallback's bound holds)."""
    with contextlib.suppress(OSError, IndexError):
        if not _is_cgroup2(ROOT):
            return None
        own = next(line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))
        parent = (ROOT / own.strip().lstrip("/")).parent
        enabled = set((parent / "cgroup.subtree_control").read_text().split())
        if parent != ROOT.parent and WANTED <= enabled and os.access(parent / "cgroup.procs", os.W_OK):
            return parent
    return None


def create(name: str, memory_bytes: int, pids: int) -> Path | None:
    """A cgroup capping one sandbox (None without a delegated cgroup v2)."""
    parent = delegated()
    if parent is None:
        return None
    path = parent / name
    path.mkdir(exist_ok=True)
    (path / "memory.max").write_text(f"{memory_bytes}\n")
    (path / "pids.max").write_text(f"{pids}\n")
    with contextlib.suppress(OSError):  # no swap accounting on this host: nothing to cap
        (path / "memory.swap.max").write_text("0\n")
    return path


def enter(path: Path | None, command: list[str]) -> list[str]:
    """The command, started in the cgroup at `path` (it moves itself there before it execs)."""
    if path is None:
        return command
    return ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(path), *command]


def remove(path: Path | None) -> None:
    """Removes a sandbox's cgroup once its processes are gone."""
    if path is not None:
        with contextlib.suppress(OSError):
            path.rmdir()
