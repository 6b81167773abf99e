"""The sandbox every command and code cell of a policy runs in: bubblewrap, no fallback.

One sandbox per episode: a `bwrap` process, run as an unprivileged uid of its own, with new
user/pid/net/ipc/uts namespaces (no network at all), the system's /usr read-only, a fresh
size-capped tmpfs at /work (the only writable place besides a small /tmp), a cleared
environment, and inside it a small stdlib agent (envs/sandbox_agent.py) that runs each
command under CPU-time, memory, process, file-size and wall-clock limits and truncates what
it prints. The host talks to the agent over pipes; if the agent stops answering in time the
whole sandbox is killed and the episode gets an error observation.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from pydantic import BaseModel, ConfigDict, Field

AGENT = Path(__file__).with_name("sandbox_agent.py")
SANDBOX_UIDS = itertools.count(0)
UID_BASE, UID_SPAN = 400_000, 50_000  # each sandbox its own uid, so process limits are its own
HOST_GRACE_SECONDS = 5.0  # the agent enforces the wall clock; the host kills only a sandbox that stops answering
INSTALL_HINT = "bubblewrap (bwrap) is not installed; install it with `apt-get install bubblewrap` (Debian/Ubuntu)"


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot start: sandboxed envs refuse to run rather than run unsandboxed."""


class SandboxLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cpu_seconds: int = Field(5, ge=1)  # per command
    episode_cpu_seconds: int = Field(120, ge=1)  # the agent's own (Python cells) over the episode
    wall_seconds: float = Field(10.0, gt=0)  # per command or cell
    memory_mb: int = Field(512, ge=64)  # address space per process
    processes: int = Field(32, ge=4)
    file_size_mb: int = Field(8, ge=1)
    disk_mb: int = Field(32, ge=1)  # /work's size
    output_bytes: int = Field(1024, ge=64)  # what the policy sees of one command's output


@dataclass(frozen=True)
class Result:
    output: str
    exit_code: int | None  # None when the command was stopped (timeout, output limit) or never ran
    error: str | None = None

    def observation(self) -> str:
        """What the policy sees: the output, then the exit code or the error."""
        tail = f"[error: {self.error}]" if self.error else f"[exit code {self.exit_code}]"
        return f"{self.output.rstrip()}\n{tail}".lstrip("\n")


def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable(INSTALL_HINT)
    return path


def _python() -> tuple[str, list[str]]:
    """An interpreter for the agent that lives under a read-only bind: the system's, else this one's prefix."""
    if Path("/usr/bin/python3").exists():
        return "/usr/bin/python3", []
    prefix = sys.base_prefix
    return f"{prefix}/bin/python3", ["--ro-bind", prefix, prefix]


def _system_binds() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    for name in ("/etc/alternatives", "/etc/ld.so.cache"):  # Debian's awk/python links and the loader cache
        if Path(name).exists():
            args += ["--ro-bind", name, name]
    return args


def bwrap_command(limits: SandboxLimits, uid: int) -> list[str]:
    python, python_binds = _python()
    disk = str(limits.disk_mb * 1024 * 1024)
    return [
        "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
        bwrap_path(), "--unshare-all", "--die-with-parent", "--new-session", "--hostname", "sandbox",
        *_system_binds(), *python_binds,
        "--proc", "/proc", "--dev", "/dev",
        "--size", disk, "--tmpfs", "/work", "--size", str(8 * 1024 * 1024), "--tmpfs", "/tmp",
        "--ro-bind", str(AGENT), "/opt/posttrain/agent.py",
        "--chdir", "/work", "--clearenv",
        "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/work",
        "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
        python, "-I", "-S", "/opt/posttrain/agent.py", limits.model_dump_json(),
    ]


class Sandbox:
    """One episode's sandbox. Use as a context manager, or call `close()`."""

    def __init__(self, limits: SandboxLimits | None = None, files: Mapping[str, str | bytes] | None = None,
                 llm: Callable[[str], str] | None = None):
        self.limits = limits or SandboxLimits()
        self.llm = llm
        self.llm_calls = 0
        self.stopped: str | None = None  # why the sandbox is gone, once it is
        uid = UID_BASE + (os.getpid() * 7919 + next(SANDBOX_UIDS)) % UID_SPAN
        try:
            self.process = subprocess.Popen(bwrap_command(self.limits, uid), stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                            start_new_session=True)
        except OSError as exc:
            raise SandboxUnavailable(f"bwrap could not start: {exc}") from exc
        for path, data in (files or {}).items():
            self.write(path, data)
        if self.stopped:
            raise SandboxUnavailable(f"the sandbox did not start: {self.stopped}")

    def run(self, command: str) -> Result:
        """A shell command in /work (a fresh `bash -c` each time)."""
        return self._result(self._ask({"op": "sh", "command": command}))

    def run_python(self, code: str) -> Result:
        """A cell in the episode's Python namespace (kept between cells)."""
        return self._result(self._ask({"op": "py", "code": code}))

    def set_variables(self, values: Mapping[str, object]) -> None:
        self._ask({"op": "set", "values": dict(values)})

    def write(self, path: str, data: str | bytes) -> None:
        """A file at `path` relative to /work (or absolute under /tmp), written inside the sandbox."""
        raw = data.encode() if isinstance(data, str) else data
        target = path if path.startswith("/tmp/") else f"/work/{path}"
        reply = self._ask({"op": "put", "path": target, "data": base64.b64encode(raw).decode()})
        if reply.get("error") and not self.stopped:
            raise ValueError(f"cannot write {path}: {reply['error']}")

    def files(self) -> dict[str, bytes]:
        """The workspace's files (small ones), for graders; empty once the sandbox has stopped."""
        reply = self._ask({"op": "snapshot"})
        return {path: base64.b64decode(data) for path, data in reply.get("files", {}).items()}

    def close(self) -> None:
        if self.process.poll() is None:
            self._kill("closed")
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass
        self.process.wait()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _result(self, reply: dict) -> Result:
        if "output" not in reply:
            return Result("", None, reply.get("error") or "the sandbox stopped")
        return Result(reply["output"], reply["exit_code"], reply["error"])

    def _ask(self, request: dict) -> dict:
        if self.stopped:
            return {"error": f"the sandbox stopped ({self.stopped})"}
        try:
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
            while True:
                reply = self._read_line()
                if "llm_query" not in reply:
                    return reply
                self._answer_llm_query(reply["llm_query"])
        except (OSError, ValueError, TimeoutError) as exc:
            self._kill(f"{type(exc).__name__}: {exc}")
            return {"error": f"the sandbox stopped ({self.stopped})"}

    def _read_line(self) -> dict:
        timer = threading.Timer(self.limits.wall_seconds + HOST_GRACE_SECONDS, self._kill, ("no answer in time",))
        timer.start()
        try:
            line = self.process.stdout.readline(1 << 24)
        finally:
            timer.cancel()
        if not line:
            raise TimeoutError(self.stopped or "the sandbox exited")
        return json.loads(line)

    def _answer_llm_query(self, prompt: str) -> None:
        if self.llm is None:
            reply = {"error": "llm_query is not available in this environment"}
        else:
            self.llm_calls += 1
            reply = {"answer": self.llm(prompt)}
        self.process.stdin.write((json.dumps(reply) + "\n").encode())
        self.process.stdin.flush()

    def _kill(self, reason: str) -> None:
        self.stopped = self.stopped or reason
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
