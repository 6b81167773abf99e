"""`python -m flows.cli.reaper PID`: the temporary Prefect server dies with the CLI that started it.

In ephemeral mode Prefect runs its API as a uvicorn child of the CLI and stops it on a clean exit;
a SIGKILLed CLI leaves it running, holding a port and memory. This watcher (its own session, stdlib
only) remembers the CLI's uvicorn children while the CLI lives and kills them once it is gone.
"""

from __future__ import annotations

import os
import signal
import sys
import time

POLL_SECONDS = 0.5
SERVER_MARK = "prefect.server.api.server:create_app"


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name: [state, ppid, ...]; None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def servers_of(parent: int) -> dict[int, str]:
    """{pid: start time} of the Prefect API servers among `parent`'s children."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat(int(name))
        if fields is None or fields[1] != str(parent):
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as handle:
                command = handle.read().decode(errors="replace")
        except OSError:
            continue
        if SERVER_MARK in command:
            found[int(name)] = fields[19]  # start time: a reused pid is not the server
    return found


def watch(parent: int) -> None:
    servers: dict[int, str] = {}
    while _alive(parent):
        servers.update(servers_of(parent))
        time.sleep(POLL_SECONDS)
    for pid, started in servers.items():
        fields = _stat(pid)
        if fields is not None and fields[19] == started:
            os.kill(pid, signal.SIGKILL)


def start(parent: int | None = None) -> None:
    """Start the watcher of `parent` (this process by default) in a session of its own."""
    import subprocess

    subprocess.Popen([sys.executable, "-m", "flows.cli.reaper", str(parent or os.getpid())],
                     start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


if __name__ == "__main__":
    watch(int(sys.argv[1]))
