"""Runs inside the bubblewrap sandbox as its pid 1 (stdlib only, started by envs/sandbox/__init__.py).

The agent is trusted code and never runs the policy's code in its own process. As pid 1 of the
sandbox's pid namespace nothing inside can signal it; it makes itself non-dumpable, so nothing
inside can ptrace it or open its /proc/1/fd; it talks to the host over a private pipe pair that
no child inherits. The host sends one JSON request per line, each with an "id" the answer echoes:
- {"op": "sh", "command"}: `bash -c command` in /work under the limits;
- {"op": "py", "code"}: a cell, run by the Python worker (envs/sandbox/worker.py, a child that keeps
  the episode's namespace); a cell's `llm_query(prompt)` is relayed to the host ({"llm_query"} out,
  {"answer"} or {"error"} in);
- {"op": "set", "values"}: variables of the worker's namespace (RLM's `context`);
- {"op": "put", "path", "data"}: writes a file (base64) under /work or /tmp;
- {"op": "snapshot"}: the regular files under /work (base64, small ones), for graders;
- {"op": "grade", "files", "command"}: a grader's command, run from a folder the policy cannot have
  planted anything in (see Sandbox.grade).
Sh, py and grade answer {"output", "exit_code", "error"}, the others {"error"} and their own fields.
Between requests nothing of the policy's runs: after each command or cell every other process is
killed and the worker is stopped (SIGSTOP) until its next cell, so the policy can neither act
during a grader's command nor race a `put` or a snapshot.
"""

import contextlib
import ctypes
import json
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # -I leaves the script's folder out
# the helpers by their names inside the sandbox (envs/sandbox/files.py, proc.py, worker.py; INSIDE_NAMES of launch.py)
from sandbox_files import GRADER, empty, put, snapshot
from sandbox_proc import EXITED, WATCHED, Output, quiesce, reap, spawn, wait_ready, watch_children

PR_SET_DUMPABLE = 4
INTERRUPT_GRACE = 1.0  # seconds a cell gets to unwind after SIGALRM before its worker is killed
MESSAGE_BYTES = 1 << 22  # the longest line the worker may send (an llm_query prompt)
# beside the agent, compiled like it (envs/sandbox/launch.py ships .pyc files; sources under these names run too)
WORKER_SCRIPT = os.path.join(HERE, "sandbox_worker" + os.path.splitext(__file__)[1])
LOST = "its variables are lost"


class Worker:
    """The agent's handle on the Python worker: its pipes, and the number of the last message sent."""

    def __init__(self, cpu_seconds):
        to_worker_r, self.to_worker = os.pipe()
        self.from_worker, from_worker_w = os.pipe()
        self.out, out_w = os.pipe()
        argv = [sys.executable, "-I", "-S", WORKER_SCRIPT, str(to_worker_r), str(from_worker_w)]
        self.pid = spawn(argv, out_w, LIMITS, cpu_seconds, keep=(to_worker_r, from_worker_w))
        for fd in (to_worker_r, from_worker_w, out_w):
            os.close(fd)
        for fd in (self.from_worker, self.out):
            os.set_blocking(fd, False)
        self.pending, self.sent = b"", 0

    def send(self, message):
        data = (json.dumps(message) + "\n").encode()
        while data:
            data = data[os.write(self.to_worker, data):]

    def messages(self):
        """Whole lines the worker sent; ValueError when it broke the protocol (a cell can write there)."""
        with contextlib.suppress(BlockingIOError):
            self.pending += os.read(self.from_worker, MESSAGE_BYTES)
        *lines, self.pending = self.pending.split(b"\n")
        if len(self.pending) > MESSAGE_BYTES:
            raise ValueError("an overlong message")
        messages = [json.loads(line) for line in lines]
        if not all(isinstance(message, dict) for message in messages):
            raise ValueError("a message that is not an object")
        return messages

    def drain(self):
        """Drops what earlier cells' threads left in the pipes."""
        for fd in (self.out, self.from_worker):
            with contextlib.suppress(BlockingIOError):
                while os.read(fd, 65536):
                    pass
        self.pending = b""

    def exited(self):
        return self.pid in EXITED

    def kill(self):
        if not self.exited():
            os.kill(self.pid, signal.SIGKILL)
            while not self.exited():
                wait_ready([], 0.01)

    def close(self):
        for fd in (self.to_worker, self.from_worker, self.out):
            os.close(fd)


def worker_pid():
    return WORKER.pid if WORKER is not None and not WORKER.exited() else 0


def start_worker():
    """The worker (a fresh one if need be, while the episode's CPU time lasts), and a note for the
    policy when the last one died between cells (a command killed it) and nothing said so yet."""
    global WORKER
    note = ""
    reap()
    if WORKER is not None and WORKER.exited():
        forget_worker()
        note = f"[the Python process had been killed; this cell runs in a fresh one: {LOST}]\n"
    budget = int(LIMITS["episode_cpu_seconds"] - CPU_SPENT[0])
    if WORKER is None and budget >= 1:
        WORKER = Worker(budget)
    return WORKER, note


def forget_worker():
    """Drops a dead worker, counting its CPU time against the episode's."""
    global WORKER
    CPU_SPENT[0] += EXITED.pop(WORKER.pid)[1]
    WATCHED.discard(WORKER.pid)
    WORKER.close()
    WORKER = None


def shell(command, cwd="/work", env=None):
    out_r, out_w = os.pipe()
    os.set_blocking(out_r, False)
    pid = spawn(["/bin/bash", "-c", command], out_w, LIMITS, LIMITS["cpu_seconds"], cwd=cwd, env=env)
    os.close(out_w)
    output, error, is_open = Output(LIMITS["output_bytes"]), None, True
    deadline = time.monotonic() + LIMITS["wall_seconds"]
    while pid not in EXITED:  # bash's exit ends the command, even if a child still holds the pipe
        if time.monotonic() >= deadline:
            error = f"timed out after {LIMITS['wall_seconds']}s"
            break
        if out_r in wait_ready([out_r] if is_open else [], deadline - time.monotonic()):
            is_open = output.read(out_r)
        if output.full():
            error = f"output limit: more than {output.hard_cap} bytes"
            break
    if error is None:
        output.read(out_r)  # what it wrote just before exiting
    os.close(out_r)
    quiesce(worker_pid())  # nothing a command started outlives it, and a worker it woke sleeps again
    WATCHED.discard(pid)
    status, _ = EXITED.pop(pid, (0, 0.0))
    return output.answer(None if error else os.waitstatus_to_exitcode(status), error)


def in_worker(request_id, message):
    """Runs one message (a cell or variables) in the worker: its output, exit code and error."""
    (worker, note), output = start_worker(), Output(LIMITS["output_bytes"])
    output.kept += note.encode()
    output.seen += len(output.kept)
    if worker is None:
        return output.answer(None, f"the episode's CPU time for Python ({LIMITS['episode_cpu_seconds']}s) is spent")
    worker.drain()
    worker.sent += 1
    os.kill(worker.pid, signal.SIGCONT)  # before a message longer than the pipe holds
    try:
        worker.send({**message, "n": worker.sent})
    except BrokenPipeError:  # a command killed it just now: start_worker replaces it
        worker.kill()
        return in_worker(request_id, message)
    error, done, interrupted = None, False, False
    deadline = time.monotonic() + LIMITS["wall_seconds"]
    while not done and not worker.exited():
        if time.monotonic() >= deadline or (output.full() and not interrupted):
            if interrupted:
                worker.kill()
                error += f"; the Python process was killed, {LOST}"
                break
            error = (f"output limit: more than {output.hard_cap} bytes" if output.full()
                     else f"timed out after {LIMITS['wall_seconds']}s")
            os.kill(worker.pid, signal.SIGALRM)  # the worker raises it in the cell
            interrupted, deadline = True, time.monotonic() + INTERRUPT_GRACE
        ready = wait_ready([worker.out, worker.from_worker], deadline - time.monotonic())
        if worker.out in ready:
            output.read(worker.out)
        if worker.from_worker in ready:
            try:
                messages = worker.messages()
            except ValueError as exc:
                worker.kill()
                error = f"the Python process broke its protocol ({exc}); {LOST}"
                break
            for reply in messages:
                if "llm_query" in reply:
                    asked = time.monotonic()
                    worker.send(relay_llm_query(request_id, reply["llm_query"]))
                    deadline += time.monotonic() - asked  # the host's model time is not the cell's
                elif "done" in reply and reply.get("n") == worker.sent:  # the cell's own error, or None
                    error, done = error or (None if reply["done"] is None else str(reply["done"])), True
    output.read(worker.out)
    if worker.exited():
        if not done and LOST not in (error or ""):
            exited = f"the Python process exited (code {os.waitstatus_to_exitcode(EXITED[worker.pid][0])}); {LOST}"
            error = f"{error}; {exited}" if error else exited
        forget_worker()
    quiesce(worker_pid())
    exit_code = None if interrupted or not done else (0 if error is None else 1)
    return output.answer(exit_code, error)


def relay_llm_query(request_id, prompt):
    send_host({"id": request_id, "llm_query": str(prompt)})
    reply = json.loads(HOST["in"].readline())
    return {"error": reply["error"]} if "error" in reply else {"answer": str(reply["answer"])}


def grade(files, command):
    """The grader's files in /grader/tests, its command run from /grader, nothing of the policy's in reach:
    not its files (PYTHONSAFEPATH: no python puts /work first on sys.path), not its worker."""
    if WORKER is not None:
        WORKER.kill()
        forget_worker()
    empty(GRADER)
    for folder in ("tests", "home"):
        os.mkdir(f"{GRADER}/{folder}")
    for name, data in files.items():
        error = put(f"{GRADER}/tests/{name}", data)["error"]
        if error:
            return {"output": "", "exit_code": None, "error": error}
    env = {**os.environ, "HOME": f"{GRADER}/home", "TESTS_DIR": f"{GRADER}/tests", "PYTHONSAFEPATH": "1"}
    return shell(command, cwd=GRADER, env=env)


def handle(request):
    op = request["op"]
    if op == "sh":
        return shell(request["command"])
    if op == "py":
        return in_worker(request["id"], {"code": request["code"]})
    if op == "set":
        return {"error": in_worker(request["id"], {"values": request["values"]})["error"]}
    if op == "put":
        return put(request["path"], request["data"])
    if op == "grade":
        return grade(request["files"], request["command"])
    return snapshot()


def send_host(message):
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(HOST["out"], data):]


def not_dumpable():
    """Without this a process of the policy (same uid) could ptrace pid 1 or open its fds."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE) failed")


def main(limits_json, host_in_fd, host_out_fd):
    global LIMITS, WORKER
    not_dumpable()
    LIMITS, WORKER = json.loads(limits_json), None
    HOST["in"], HOST["out"] = os.fdopen(host_in_fd, "rb"), host_out_fd
    for fd in (host_in_fd, host_out_fd):
        os.set_inheritable(fd, False)
    watch_children()
    send_host({"ready": True})
    for line in HOST["in"]:
        request = json.loads(line)
        try:
            os.chmod("/work", 0o755)  # a `chmod 000 /work` must not stop every later command
            reply = handle(request)
        except Exception as exc:  # noqa: BLE001 - one bad request must not end the episode's sandbox
            reply = {"output": "", "exit_code": None, "error": f"sandbox agent: {type(exc).__name__}: {exc}"}
            quiesce(worker_pid())
        send_host({**reply, "id": request["id"]})


LIMITS, WORKER, HOST, CPU_SPENT = {}, None, {}, [0.0]  # set by main; CPU_SPENT: by dead workers

if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    # the host closed its pipe: pid 1's exit ends the rest; the interpreter's teardown would add
    # ~5 ms to every episode's end
    os._exit(0)
