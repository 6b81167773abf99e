"""Process control inside the bubblewrap sandbox, for its agent (stdlib only; see envs/sandbox/agent.py).

The agent is pid 1 of the sandbox's pid namespace, so every orphan becomes its child: it reaps them
all, and after each command or cell it freezes and kills every process but itself and the Python
worker, so nothing of the policy's runs between requests.
"""

import contextlib
import os
import resource
import select
import signal
import time

SWEEP_SECONDS = 2.0
WATCHED, EXITED = set(), {}  # children whose exit the agent waits for -> (wait status, cpu seconds)
WAKE = {}  # "fd": the read end of the pipe SIGCHLD writes to, so a select wakes up when a child exits


def watch_children():
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    WAKE["fd"] = wake_r


def set_limits(limits, cpu_seconds):
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_size_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def spawn(argv, out_fd, limits, cpu_seconds, keep=(), cwd="/work", env=None):
    """A child in its own session in `cwd`, under the limits, stdout and stderr on out_fd, stdin
    /dev/null, no fd of the agent's but `keep`, and `env` (None: the agent's). A failure to start is
    its output, exit code 127."""
    pid = os.fork()
    if pid == 0:
        try:
            signal.set_wakeup_fd(-1)
            for signum in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(signum, signal.SIG_DFL)
            os.setsid()
            os.chdir(cwd)
            os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
            os.dup2(out_fd, 1)
            os.dup2(out_fd, 2)
            for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
                if fd > 2 and fd not in keep:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            for fd in keep:
                os.set_inheritable(fd, True)
            set_limits(limits, cpu_seconds)
            os.execve(argv[0], argv, os.environ if env is None else env)
        except BaseException as exc:  # noqa: BLE001 - the child must never return into the agent
            with contextlib.suppress(BaseException):
                os.write(1, f"cannot run: {exc}\n".encode())
        os._exit(127)
    WATCHED.add(pid)
    return pid


def reap():
    """Collects every exited child; keeps the status of watched ones."""
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in WATCHED:
            EXITED[pid] = (status, usage.ru_utime + usage.ru_stime)


def wait_ready(fds, timeout):
    """The fds ready to read within timeout; returns early when a child exits."""
    ready, _, _ = select.select([*fds, WAKE["fd"]], [], [], max(0.0, min(timeout, 0.5)))
    if WAKE["fd"] in ready:
        with contextlib.suppress(BlockingIOError):
            os.read(WAKE["fd"], 4096)
    reap()
    return ready


def processes():
    """(pid, state, parent pid) of every process of the namespace but pid 1."""
    found = []
    for name in os.listdir("/proc"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if name.isdigit() and name != "1":
                state, ppid = open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()[:2]  # the name may hold ")"
                found.append((int(name), state, int(ppid)))
    return found


def freeze(give_up):
    """SIGSTOPs every process (the worker too) until none runs: a stopped process cannot fork or wake
    another (a stray's SIGCONT to the worker), so what is then killed stays dead. One in D (a vfork
    parent) stops as soon as it leaves D: the stop stays pending, and nothing runs to cancel it."""
    while time.monotonic() < give_up:
        found = processes()
        running = [pid for pid, state, _ in found if state not in "TtDZX"]
        for pid in running or [pid for pid, state, _ in found if state == "D"]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
        if not running:
            return True
        time.sleep(0.001)
    return False


def quiesce(worker_pid):
    """Leaves no process but pid 1 and the stopped worker (worker_pid 0: none). Freeze, kill the
    strays, and again, until a freeze finds nothing else: then no process is left that could wake
    the worker."""
    give_up = time.monotonic() + SWEEP_SECONDS
    while freeze(give_up):
        strays = [pid for pid, state, ppid in processes()  # the worker's zombies are only the worker's to reap
                  if pid != worker_pid and not (state == "Z" and ppid == worker_pid)]
        if not strays:
            return
        for pid in strays:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.002)
        reap()
    kill_everything()


def kill_everything():
    """The last resort: the worker dies too."""
    with contextlib.suppress(OSError):
        os.kill(-1, signal.SIGKILL)
    give_up = time.monotonic() + SWEEP_SECONDS
    while processes() and time.monotonic() < give_up:
        time.sleep(0.01)
        reap()


class Output:
    """What a command or cell printed: the first `cap` bytes kept, the rest counted up to a hard cap."""

    def __init__(self, cap):
        self.cap, self.hard_cap = cap, 64 * cap
        self.kept, self.seen = bytearray(), 0

    def read(self, fd):
        """Reads what fd holds now (a bounded amount, against a writer that never stops); False at its end."""
        for _ in range(64):
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return True
            if not chunk:
                return False
            self.seen += len(chunk)
            self.kept += chunk[:max(0, self.cap - len(self.kept))]
        return True

    def full(self):
        return self.seen > self.hard_cap

    def answer(self, exit_code, error):
        text = self.kept.decode("utf-8", "replace")
        if self.seen > len(self.kept):
            text += f"\n[output truncated: {self.seen} bytes, {len(self.kept)} shown]"
        return {"output": text, "exit_code": exit_code, "error": error}
