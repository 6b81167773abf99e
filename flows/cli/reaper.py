"""`python -m flows.cli.reaper PID TOKEN`: the temporary Prefect server dies with the CLI that started it.

In ephemeral mode Prefect runs its API as a uvicorn child of the CLI and stops it on a clean exit;
a SIGKILLed CLI leaves it running, holding a port and memory. The CLI marks its environment with a
token (which the server inherits) and starts this watcher (its own session, stdlib only); once the
CLI is gone, the watcher kills every Prefect API server carrying the token, wherever it was
reparented.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time

from tasks.runtime.processes import alive

POLL_SECONDS = 0.5
SERVER_MARK = b"prefect.server.api.server:create_app"
TOKEN_VARIABLE = "POSTTRAIN_REAPER_TOKEN"


def _read(pid: str, name: str) -> bytes:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def servers_with(token: str) -> list[int]:
    """The Prefect API servers whose environment carries `token`."""
    marker = f"{TOKEN_VARIABLE}={token}".encode()
    return [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and SERVER_MARK in _read(pid, "cmdline")
            and marker in _read(pid, "environ").split(b"\0")]


def watch(parent: int, token: str) -> None:
    while alive(parent):
        time.sleep(POLL_SECONDS)
    for pid in servers_with(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start() -> None:
    """Mark this process's environment (inherited by the server Prefect starts) and start its watcher."""
    import subprocess

    token = os.environ.setdefault(TOKEN_VARIABLE, secrets.token_hex(8))
    subprocess.Popen([sys.executable, "-m", "flows.cli.reaper", str(os.getpid()), token], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2])
