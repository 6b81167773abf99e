"""A stdio MCP server run in the project's sandbox (`server: {command: [...], sandbox: true}`).

The SDK starts a stdio server as a child whose stdin and stdout are its pipes and passes it no other
fd, while bwrap reads its seccomp filter from one and the mounting shell its fstab from stdin. So
the env starts this launcher (`python -m envs.mcp.sandboxed LIMITS_JSON READ_ONLY_JSON -- COMMAND...`,
READ_ONLY_JSON `{"folders": [...], "files": [...]}`)
as the server: it moves the SDK's stdin pipe to another fd, sets the process limits the sandbox's
agent would set per command (address space, processes, file size), and runs the server under
bwrap + seccomp with the pipe as its stdin again (envs/sandbox/launch.py: launch_program). The
server sees a read-only root with the given host folders (the interpreter's, the venv) bound
read-only where they are (by the mounting root) and the given files (the server's script) copied
there (read by this process): the sandbox's uid needs no way through the folders above them
(/root). It has a tmpfs /work as its working folder, no network and no other process.
It is killed with the launcher (bwrap's --die-with-parent), and the launcher ends when the server
does, with its exit code.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

from envs.sandbox import cgroup as sandbox_cgroup
from envs.sandbox.launch import MB, SandboxLimits, launch_program, privileged

UID_BASE, UID_SPAN = 450_000, 50_000  # beside envs/sandbox's sandboxes' uids, each server its own
SERVER_STDIN = 3


def set_limits(limits: SandboxLimits) -> None:
    """The agent's per-command limits, on the whole server (inherited through bwrap)."""
    for which, value in ((resource.RLIMIT_AS, limits.memory_mb * MB), (resource.RLIMIT_NPROC, limits.processes),
                         (resource.RLIMIT_FSIZE, limits.file_size_mb * MB), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(which, (value, value))


def main(argv: list[str]) -> int:
    limits_json, read_only_json, dash, *program = argv
    if dash != "--" or not program:
        raise SystemExit("usage: python -m envs.mcp.sandboxed LIMITS_JSON READ_ONLY_JSON -- COMMAND...")
    limits = SandboxLimits.model_validate_json(limits_json)
    uid = UID_BASE + os.getpid() % UID_SPAN if privileged() else os.geteuid()
    read_only = json.loads(read_only_json)
    files = {path: Path(path).read_bytes() for path in read_only["files"]}  # read here: the sandbox's uid may not
    os.dup2(0, SERVER_STDIN)  # the SDK's pipe; the mounting shell reads the fstab on stdin first
    started = launch_program(limits, uid, program, tuple(read_only["folders"]), files, SERVER_STDIN)
    try:
        process = subprocess.Popen(started.command, pass_fds=(SERVER_STDIN, *started.fds), stdin=started.stdin,
                                   preexec_fn=lambda: set_limits(limits))
    finally:
        started.close_fds()
        os.close(SERVER_STDIN)
    signal.signal(signal.SIGTERM, lambda *_: process.kill())  # the SDK ends a server by SIGTERM, then SIGKILL
    try:
        return process.wait()
    finally:
        sandbox_cgroup.remove(started.cgroup)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
