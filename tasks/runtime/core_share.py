"""The cores of this box, shared among the stage children it runs at once.

The runner registers each child while it runs and writes every live child's share file with
`cores // children`; a child whose spec leaves `model.threads` unset follows its file
(StageContext.follow_core_share: at its progress updates). So a stage that starts beside
another gets half the cores and takes them all back once the other ends, and a stage started
beside one that turned out cached (no child at all) is never held to half. Deciding once, when
a stage starts, kept such a stage at one thread for its whole life: 58 s instead of 37 s for
300 `sft` steps on 2 cores.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path


def cores() -> int:
    """The cores this process may use (its affinity: a test worker's or a container's share)."""
    return len(os.sched_getaffinity(0))


def threads_each(children: int, available: int) -> int:
    return max(1, available // max(1, children))


class CoreShare:
    def __init__(self):
        self._lock = threading.Lock()
        self._files: list[Path] = []

    @contextlib.contextmanager
    def child(self, share_file: Path):
        """While the block runs, `share_file` holds this child's share, rewritten as others come and go."""
        with self._lock:
            self._files.append(share_file)
            self._write()
        try:
            yield share_file
        finally:
            with self._lock:
                self._files.remove(share_file)
                self._write()

    def _write(self) -> None:
        threads = threads_each(len(self._files), cores())
        for path in self._files:
            staged = path.with_name(path.name + ".new")
            staged.write_text(str(threads))
            os.replace(staged, path)  # a child never reads half a number


CORE_SHARE = CoreShare()  # one per process: the children of every stage this process runs
