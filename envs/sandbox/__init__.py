"""The sandbox every command and code cell of a policy runs in: bubblewrap, no fallback.

One sandbox per episode: a `bwrap` process as an unprivileged uid of its own (as root; without root,
this process's uid in a user namespace of its own), in new user, pid, net, ipc, uts and cgroup
namespaces (no network, no further user namespaces), under a seccomp filter (envs/sandbox/seccomp.py),
with /usr and the root read-only, tmpfs at /work, /tmp, /dev/shm and /grader capped in size and file
count (mounted in a private mount namespace: envs/sandbox/launch.py), a cleared environment, and as
pid 1 a stdlib agent (envs/sandbox/agent.py, files.py, proc.py, worker.py)
that runs each command, and each Python cell in a worker process, under CPU, memory, process,
file-size and wall-clock limits, truncates their output and kills whatever they leave running. The
host talks to it over a private pipe pair; if it stops answering in time, or answers out of turn,
the sandbox is killed and the episode gets an error observation. A grader's command runs by
`grade`, where the policy cannot have planted anything it would pick up.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import secrets
import select
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from envs.sandbox import cgroup as sandbox_cgroup
from envs.sandbox import launch as sandbox_launch
from envs.sandbox.launch import AGENT, AGENT_FILES, GRADER, INSTALL_HINT, SandboxLimits, SandboxUnavailable, privileged

__all__ = ["AGENT", "AGENT_FILES", "GRADER", "INSTALL_HINT", "Result", "Sandbox", "SandboxLimits",
           "SandboxUnavailable"]

SANDBOX_UIDS = itertools.count(0)
# One bwrap launch at a time in a process (the rollout loop starts episodes on several threads):
# started at once from 4 threads, about one start in 200 failed with bwrap's "Can't find source path
# <mount point>/work: Permission denied"; with the launch serialized, none in 1,200. What follows
# the launch (the agent's start, the episode's files) still overlaps.
LAUNCHING = threading.Lock()
UID_BASE, UID_SPAN = 400_000, 50_000  # each sandbox its own uid, so process limits are its own
HOST_GRACE_SECONDS = 10.0  # the agent enforces the wall clock; the host kills only a sandbox that stops answering
START_SECONDS = 30.0  # a loaded machine can take a while to start bwrap and Python
REPLY_BYTES = 1 << 24


@dataclass(frozen=True)
class Result:
    output: str
    exit_code: int | None  # None when the command was stopped (timeout, output limit) or never ran
    error: str | None = None

    def observation(self) -> str:
        """What the policy sees: the output, then the exit code or the error."""
        tail = f"[error: {self.error}]" if self.error else f"[exit code {self.exit_code}]"
        return f"{self.output.rstrip()}\n{tail}".lstrip("\n")


class Sandbox:
    """One episode's sandbox. Use as a context manager, or call `close()`."""

    def __init__(self, limits: SandboxLimits | None = None, files: Mapping[str, str | bytes] | None = None,
                 llm: Callable[[str], str] | None = None):
        self.limits = limits or SandboxLimits()
        self.llm = llm
        self.llm_calls = 0
        self.stopped: str | None = None  # why the sandbox is gone, once it is
        # as root each sandbox its own host uid; without root, this process's (in a user namespace of its own)
        own_uid = UID_BASE + (os.getpid() * 7919 + next(SANDBOX_UIDS)) % UID_SPAN
        self.uid = own_uid if privileged() else os.geteuid()
        with LAUNCHING:
            self._launch()
        self._reader = os.fdopen(self._replies, "rb")
        self._start(files or {})

    def _launch(self) -> None:
        started = sandbox_launch.launch(self.limits, self.uid)
        self.cgroup = started.cgroup
        to_agent, self._requests = os.pipe()
        self._replies, from_agent = os.pipe()
        self._bwrap_errors = tempfile.TemporaryFile()
        self._agent: tuple[int, int] | None = None  # the agent's (the sandbox's pid 1) host pid and pidfd, once ready
        try:
            self.process = subprocess.Popen([*started.command, str(to_agent), str(from_agent)],
                                            pass_fds=(to_agent, from_agent, *started.fds),
                                            stdin=started.stdin, stdout=subprocess.DEVNULL,
                                            stderr=self._bwrap_errors, start_new_session=True)
        except OSError as exc:
            os.close(self._requests)
            os.close(self._replies)
            self._bwrap_errors.close()
            sandbox_cgroup.remove(self.cgroup)
            raise SandboxUnavailable(f"bwrap could not start: {exc}") from exc
        finally:
            os.close(to_agent)
            os.close(from_agent)
            started.close_fds()

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
        if reply["error"] and not self.stopped:
            raise ValueError(f"cannot write {path}: {reply['error']}")

    def grade(self, files: Mapping[str, bytes], command: str) -> Result:
        """A grader's command, where the policy can have planted nothing: after the policy's last
        command the agent empties /grader, stops the Python worker for good and writes `files` to
        /grader/tests ($TESTS_DIR); the command runs from /grader with HOME=/grader/home and
        PYTHONSAFEPATH=1 (no python puts its working folder or its script's folder on sys.path, so a
        check that does `cd /work` imports no module of the policy's). A check that runs the
        policy's own program, which imports its neighbours, unsets it for that program only
        (`env -u PYTHONSAFEPATH python3 main.py`); one that imports helpers of its own from
        $TESTS_DIR puts them on PYTHONPATH."""
        encoded = {name: base64.b64encode(data).decode() for name, data in files.items()}
        return self._result(self._ask({"op": "grade", "files": encoded, "command": command}))

    def files(self) -> dict[str, bytes]:
        """The workspace's regular files (small ones, links not followed), for graders; empty once stopped."""
        reply = self._ask({"op": "snapshot"})
        return {path: base64.b64decode(data) for path, data in reply.get("files", {}).items()}

    def close(self) -> None:
        """Ends the sandbox; when this returns no process of it is left."""
        if self._reader.closed:
            return
        if not self.stopped:
            os.close(self._requests)  # the agent's end of input: it exits, and pid 1's exit empties the namespace
            self._requests = -1
            try:
                self.process.wait(timeout=HOST_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                pass
        self._kill("closed")  # only if still running
        self.process.wait()
        self._wait_for_agent()
        for stream in (self._reader, self._bwrap_errors):
            stream.close()
        if self._requests >= 0:
            os.close(self._requests)
        sandbox_cgroup.remove(self.cgroup)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _wait_for_agent(self) -> None:
        """After a kill, pid 1 dies asynchronously, and the rest of its pid namespace before it: the
        kernel reaps every other process of the namespace before pid 1's exit completes, so once
        pid 1's zombie is reaped too (as root, by whoever inherited it) none is left. Watching that
        one pid spares a scan of /proc (~4-7 ms) per episode."""
        pid = None  # unknown when it never said it was ready: then any process of its uid
        if self._agent is not None:
            pid, pidfd = self._agent
            select.select([pidfd], [], [], HOST_GRACE_SECONDS)
            os.close(pidfd)
            self._agent = None
        give_up = time.monotonic() + HOST_GRACE_SECONDS
        while self.uid != os.geteuid() and time.monotonic() < give_up:
            if not (_runs_as(pid, self.uid) if pid is not None else _processes_of(self.uid)):
                return
            time.sleep(0.002)

    def _start(self, files: Mapping[str, str | bytes]) -> None:
        try:
            self._read_reply(START_SECONDS)  # the agent's {"ready"}
            self._agent = _child(self.process.pid)
        except (OSError, ValueError, TimeoutError) as exc:
            self._kill(f"{type(exc).__name__}: {exc}")
        for path, data in files.items():
            self.write(path, data)
        if self.stopped:
            reason = self.stopped
            self.close()
            raise SandboxUnavailable(f"the sandbox did not start: {reason}")

    def _result(self, reply: dict) -> Result:
        if "output" not in reply:
            return Result("", None, reply["error"] or "the sandbox stopped")
        return Result(reply["output"], reply["exit_code"], reply["error"])

    def _ask(self, request: dict) -> dict:
        if self.stopped:
            return {"error": f"the sandbox stopped ({self.stopped})"}
        request_id = secrets.token_hex(8)  # a reply must echo it: one out of turn stops the sandbox
        try:
            self._send({**request, "id": request_id})
            while True:
                reply = self._read_reply(self.limits.wall_seconds + HOST_GRACE_SECONDS)
                if reply.get("id") != request_id:
                    raise ValueError("the sandbox answered out of turn")
                if "llm_query" not in reply:
                    return reply
                self._send(self._answer_llm_query(reply["llm_query"]))
        except (OSError, ValueError, TimeoutError) as exc:
            self._kill(f"{type(exc).__name__}: {exc}")
            return {"error": f"the sandbox stopped ({self.stopped})"}

    def _send(self, message: dict) -> None:
        data = (json.dumps(message) + "\n").encode()
        while data:
            data = data[os.write(self._requests, data):]

    def _read_reply(self, timeout: float) -> dict:
        timer = threading.Timer(timeout, self._kill, ("no answer in time",))
        timer.start()
        try:
            line = self._reader.readline(REPLY_BYTES)
        finally:
            timer.cancel()
        if len(line) == REPLY_BYTES:
            raise ValueError("the sandbox sent an overlong reply")
        if not line.endswith(b"\n"):
            raise TimeoutError(self.stopped or self._exit_reason())
        reply = json.loads(line)
        if not isinstance(reply, dict):
            raise ValueError("the sandbox sent a reply that is not an object")
        return reply

    def _answer_llm_query(self, prompt: str) -> dict:
        if self.llm is None:
            return {"error": "llm_query is not available in this environment"}
        self.llm_calls += 1
        try:
            return {"answer": str(self.llm(prompt))}
        except Exception as exc:  # noqa: BLE001 - the host model's failure is the cell's error, not the episode's
            return {"error": f"llm_query failed: {type(exc).__name__}: {exc}"}

    def _exit_reason(self) -> str:
        try:
            self.process.wait(timeout=1)  # its pipe closes as it exits
        except subprocess.TimeoutExpired:
            return "the sandbox closed its pipe"
        self._bwrap_errors.seek(0)
        said = self._bwrap_errors.read(4096).decode("utf-8", "replace").strip()
        return f"the sandbox exited with code {self.process.returncode}" + (f": {said}" if said else "")

    def _kill(self, reason: str) -> None:
        self.stopped = self.stopped or reason
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)  # bwrap's child dies with it (--die-with-parent)


def _child(parent: int) -> tuple[int, int] | None:
    """The pid and a pidfd of bwrap's one child, the agent (None when it has none, or the kernel
    does not list children)."""
    with contextlib.suppress(OSError):
        children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        return (int(children[0]), os.pidfd_open(int(children[0]))) if children else None
    return None


def _runs_as(pid: int, uid: int) -> bool:
    """Whether host pid `pid` exists with real uid `uid` (a non-dumpable one's /proc folder is root's,
    so read its status)."""
    try:
        return f"Uid:\t{uid}\t" in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def _processes_of(uid: int) -> list[int]:
    """Host pids whose real uid is `uid`."""
    return [int(entry.name) for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and _runs_as(int(entry.name), uid)]
