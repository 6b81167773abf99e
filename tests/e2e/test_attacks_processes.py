"""A SIGKILLed `posttrain run` leaves nothing running (issue 20, item 2, in part): its stage children
already die with it; the temporary Prefect server it started in ephemeral mode now does too."""

import os
import signal
import time
from pathlib import Path

from e2e.helpers import EPHEMERAL, start, tiny_spec, write

from tasks.runtime.processes import alive


def servers_of(parent: int) -> list[int]:
    """The Prefect API servers among `parent`'s children."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if stat[1] == str(parent) and b"prefect.server.api.server:create_app" in command:
            found.append(int(pid))
    return found


def test_a_killed_cli_takes_its_temporary_prefect_server_with_it(tmp_path):
    spec = write(tmp_path, tiny_spec(f"file://{tmp_path / 'store'}", sft={"max_steps": 500}))
    process = start("run", spec, env=EPHEMERAL)
    try:
        deadline = time.monotonic() + 180
        while not (servers := servers_of(process.pid)):
            assert process.poll() is None and time.monotonic() < deadline, "no temporary Prefect server appeared"
            time.sleep(0.5)
        os.kill(process.pid, signal.SIGKILL)  # the CLI alone, as the OOM killer or `kill -9` would
        process.wait()
        deadline = time.monotonic() + 20
        while any(alive(pid) for pid in servers):
            assert time.monotonic() < deadline, f"the temporary Prefect server {sorted(servers)} outlived its CLI"
            time.sleep(0.2)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
