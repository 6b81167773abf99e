"""How a sandbox starts (see envs/sandbox/__init__.py): its limits and the command line that launches it.

As root, `unshare --mount --ipc` mounts the sandbox's capped tmpfs in a mount namespace of its own
and caps SysV IPC in its IPC namespace, then setpriv drops to the sandbox's own host uid. Without
root, or root without CAP_SYS_ADMIN (a container's), where unprivileged user namespaces are
allowed, `unshare --user --map-root-user --mount --ipc` does the same as the root of a user
namespace of its own, and the sandbox runs as this process's uid: its process limit is still its own, as the kernel (5.14+) counts RLIMIT_NPROC per
user namespace. Then bwrap, with the seccomp filter of envs/sandbox/seccomp.py, runs the agent.
"""

from __future__ import annotations

import atexit
import functools
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from envs.sandbox import cgroup as sandbox_cgroup
from envs.sandbox import seccomp as sandbox_seccomp

# The programs run inside (stdlib only), each source of this package under the module name it has
# in the sandbox's /opt/posttrain: the agent imports its helpers by these names (the one place they
# are mapped; the sandbox's tests name them too).
INSIDE_NAMES = {"agent": "sandbox_agent", "files": "sandbox_files", "proc": "sandbox_proc", "worker": "sandbox_worker"}
AGENT = Path(__file__).with_name("agent.py")
AGENT_FILES = [AGENT.with_name(f"{name}.py") for name in INSIDE_NAMES]  # run inside
MB = 1024 * 1024
TMP_BYTES, TMP_FILES, SHM_BYTES, SHM_FILES = 8 * MB, 2000, 4 * MB, 100
GRADER_BYTES, GRADER_FILES = 8 * MB, 2000  # /grader: a grader's files, emptied before each grading
# Mounts the sandbox's tmpfs (with sizes and inode counts, which bwrap's --tmpfs cannot cap) in a
# mount namespace of their own, over an empty host folder: the host never sees them, and they go
# away with the sandbox's last process. One `mount -a` reads them all from an fstab on the shell's
# stdin (an anonymous host file, which libmount can read where it cannot read a pipe) and makes
# their folders: a mount and a mkdir per tmpfs cost ~30 ms of every episode's start. First, in
# the sandbox's own IPC namespace and while still root, SysV shared memory, message queues and
# semaphores are capped at nothing: a segment would outlive each command for the whole episode
# and count against no process's memory limit. That is belt and braces over the seccomp filter,
# which denies them: a read-only /proc/sys (a container's) or a kernel that keeps a user
# namespace's root from these sysctls leaves the filter alone.
DENY_SYSV_IPC = ('{ echo 0 > /proc/sys/kernel/shmall; echo 0 > /proc/sys/kernel/msgmni; '
                 'echo "0 0 0 0" > /proc/sys/kernel/sem; } 2>/dev/null || :; ')


def mount_tmpfs(stdin: str) -> str:
    """The mounting shell's script; then its stdin is redirected by `stdin` and it execs the rest."""
    return 'set -e; ' + DENY_SYSV_IPC + f'mount -a -T /dev/stdin; exec {stdin}; exec "$@"'


MOUNT_TMPFS = mount_tmpfs("</dev/null")
INSTALL_HINT = "bubblewrap (bwrap) is not installed; install it with `apt-get install bubblewrap` (Debian/Ubuntu)"
SECCOMP_HINT = "install libseccomp with `apt-get install libseccomp2` (Debian/Ubuntu)"
GRADER = "/grader"  # where Sandbox.grade runs a grader (the agent empties it first)
INSIDE = "/opt/posttrain"  # the agent's files in the sandbox's read-only root
# Run by the sandbox's own interpreter (its bytecode format is its version's): each agent file to
# an unchecked-hash .pyc, named in tracebacks by its source's path inside the sandbox.
COMPILE_AGENT = ("import py_compile, sys\n"
                 "for source, target, shown in zip(*[iter(sys.argv[1:])] * 3):\n"
                 "    py_compile.compile(source, target, shown, doraise=True,\n"
                 "                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)\n")


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot start: sandboxed envs refuse to run rather than run unsandboxed."""


class SandboxLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cpu_seconds: int = Field(5, ge=1)  # per command
    episode_cpu_seconds: int = Field(120, ge=1)  # the Python worker's (cells) over the episode
    wall_seconds: float = Field(10.0, gt=0)  # per command or cell
    memory_mb: int = Field(512, ge=64)  # address space per process
    processes: int = Field(32, ge=4)
    file_size_mb: int = Field(8, ge=1)
    disk_mb: int = Field(32, ge=1)  # /work's size
    max_files: int = Field(10_000, ge=100)  # files and folders in /work (each costs kernel memory, not disk)
    output_bytes: int = Field(1024, ge=64)  # what the policy sees of one command's output


CAPABILITIES = (6, 7, 21)  # CAP_SETGID, CAP_SETUID, CAP_SYS_ADMIN
SANDBOX_ID = 1000  # the uid/gid the policy sees inside: the same in every sandbox, so observations
# (`id`, `ls -ln`) do not depend on which host uid this sandbox got (runs stay reproducible)


def memory_bound(limits: SandboxLimits) -> int:
    """What one sandbox's processes and files can hold in memory, in bytes, without a cgroup:

        processes * memory_mb MiB + disk_mb MiB + (8 + 4 + 8) MiB

    RLIMIT_NPROC caps the sandbox's processes (and threads) at `processes` (its own host uid, or its
    own user namespace without root) and RLIMIT_AS each one's address space at `memory_mb`; the
    tmpfs at /work, /tmp, /dev/shm and /grader are capped in size and inodes; memfd and SysV IPC,
    memory no limit above covers, are denied (seccomp; SysV also by the IPC namespace's limits).
    The trusted agent and kernel memory (page tables, pipe buffers, inodes) come on top.
    With a delegated cgroup v2 (envs/sandbox/cgroup.py) memory.max is this bound.
    """
    tmpfs = limits.disk_mb * MB + TMP_BYTES + SHM_BYTES + GRADER_BYTES
    return limits.processes * limits.memory_mb * MB + tmpfs


@dataclass(frozen=True)
class Launch:
    command: list[str]
    fds: tuple[int, ...]  # what bwrap reads once (--seccomp, --file): pass them to it, then close them
    stdin: int  # the tmpfs' fstab, which the mounting shell reads as its stdin; closed with the fds
    cgroup: Path | None  # the sandbox's own cgroup, to remove once it is gone; None: the fallback bound

    def close_fds(self) -> None:
        for fd in (*self.fds, self.stdin):
            os.close(fd)


def _tool(name: str, hint: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SandboxUnavailable(hint)
    return path


def _util_linux(name: str) -> str:
    return _tool(name, f"{name} is not installed; it comes with util-linux (`apt-get install util-linux`)")


@functools.cache
def _mount_point() -> str:
    """An empty host folder the sandboxes mount their tmpfs over, each in its own mount namespace."""
    path, creator = tempfile.mkdtemp(prefix="posttrain-sandbox-"), os.getpid()
    atexit.register(lambda: os.getpid() == creator and shutil.rmtree(path, ignore_errors=True))  # not a fork's exit
    return path


def _tmpfs_options(size: int, files: int, mode: str, uid: int) -> str:
    return f"size={size},nr_inodes={files},mode={mode},uid={uid},gid={uid},nosuid,nodev"


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


def privileged() -> bool:
    """Root with the capabilities the root path needs (mount, setuid); root in a container without them,
    like any other user, takes the path through a user namespace."""
    if os.geteuid() != 0:
        return False
    status = Path("/proc/self/status").read_text()
    effective = int(next(line.split()[1] for line in status.splitlines() if line.startswith("CapEff:")), 16)
    return all(effective >> bit & 1 for bit in CAPABILITIES)


def inside_name(path: Path) -> str:
    """The module name an agent file (one of AGENT_FILES) has inside the sandbox."""
    return INSIDE_NAMES[path.stem]


@functools.cache
def agent_bytecode() -> tuple[tuple[str, bytes], ...]:
    """(file name, compiled bytes) of each agent file, compiled once per process by the sandbox's
    interpreter: the sandbox imports them sourceless, sparing every episode's start the compiling
    of ~550 lines (~4 ms of its ~35)."""
    python, _ = _python()
    names = [f"{inside_name(path)}.pyc" for path in AGENT_FILES]
    with tempfile.TemporaryDirectory(prefix="posttrain-agent-") as folder:
        arguments = [str(value) for path, name in zip(AGENT_FILES, names)
                     for value in (path, f"{folder}/{name}", f"{INSIDE}/{inside_name(path)}.py")]
        try:
            done = subprocess.run([python, "-I", "-S", "-c", COMPILE_AGENT, *arguments], capture_output=True,
                                  timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SandboxUnavailable(f"{python} cannot compile the sandbox's agent: {exc}") from exc
        if done.returncode != 0:
            last = (done.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
            raise SandboxUnavailable(f"{python} cannot compile the sandbox's agent: {last}")
        return tuple((name, Path(folder, name).read_bytes()) for name in names)


def _data_fd(name: str, data: bytes) -> int:
    """An anonymous host file holding `data`, read from its start (bwrap's --seccomp and --file read an fd)."""
    fd = os.memfd_create(name)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _data_fds(named_data: list[tuple[str, bytes]]) -> list[int]:
    """An fd per (name, data), by `_data_fd`; if one fails, those made before it are closed."""
    fds: list[int] = []
    try:
        for name, data in named_data:
            fds.append(_data_fd(name, data))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def _seccomp_program() -> bytes:
    try:
        return sandbox_seccomp.program()
    except OSError as exc:
        raise SandboxUnavailable(f"the sandbox's seccomp filter cannot be built ({exc}); {SECCOMP_HINT}") from exc


def _fstab_field(text: str) -> str:
    """`text` as one fstab field: whitespace and backslashes octal-escaped, as libmount reads them."""
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in text)


def tmpfs_fstab(limits: SandboxLimits, base: str, owner: int, read_only: tuple[str, ...] = ()) -> str:
    """The sandbox's tmpfs under `base` (itself a small tmpfs) as fstab lines, each folder made by the
    mount; then each host folder of `read_only` bound at `base/ro/<i>`, by the mount's root, which
    can reach it where the sandbox's uid may not (a folder under /root), for bwrap to bind in turn."""
    capped = {"work": _tmpfs_options(limits.disk_mb * MB, limits.max_files, "0755", owner),
              "tmp": _tmpfs_options(TMP_BYTES, TMP_FILES, "01777", owner),
              "shm": _tmpfs_options(SHM_BYTES, SHM_FILES, "01777", owner),
              "grader": _tmpfs_options(GRADER_BYTES, GRADER_FILES, "0755", owner)}
    lines = [f"posttrain {_fstab_field(base)} tmpfs mode=0755,size=16k 0 0"]
    lines += [f"posttrain {_fstab_field(f'{base}/{name}')} tmpfs X-mount.mkdir,{options} 0 0"
              for name, options in capped.items()]
    lines += [f"{_fstab_field(folder)} {_fstab_field(f'{base}/ro/{i}')} none bind,ro,X-mount.mkdir 0 0"
              for i, folder in enumerate(read_only)]
    return "".join(line + "\n" for line in lines)


def _namespaces(uid: int, root: bool, script: str = MOUNT_TMPFS) -> list[str]:
    """From the host to bwrap: the tmpfs mounted (their fstab on stdin), SysV IPC capped, and (as
    root) the drop to `uid`."""
    unshare = _util_linux("unshare")
    user = [] if root else ["--user", "--map-root-user"]
    command = [unshare, *user, "--mount", "--ipc", "--propagation", "private", "--", "/bin/sh", "-c", script, "sh"]
    if root:
        command += [_util_linux("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    return command


def launch(limits: SandboxLimits, uid: int) -> Launch:
    """The command line up to the agent's own arguments (the host appends its two protocol fds)."""
    python, python_binds = _python()
    files = tuple((f"{INSIDE}/{name}", data) for name, data in agent_bytecode())
    return _launch(limits, uid, files, [python, "-I", "-S", f"{INSIDE}/{inside_name(AGENT)}.pyc",
                                        limits.model_dump_json()], binds=python_binds)


def launch_program(limits: SandboxLimits, uid: int, program: list[str], read_only: tuple[str, ...],
                   files: dict[str, bytes], stdin_fd: int) -> Launch:
    """The command line of `program` run in the sandbox in the agent's place (an MCP server over
    stdio: envs/mcp/sandboxed.py): the host folders `read_only` bound read-only where they are
    (through the mount's root: tmpfs_fstab), `files` (path -> bytes) copied in read-only, and fd
    `stdin_fd` as its stdin. No agent runs: the caller sets the process limits before it starts."""
    return _launch(limits, uid, tuple(files.items()), program, read_only=read_only,
                   script=mount_tmpfs(f"<&{stdin_fd} {stdin_fd}<&-"))


def _launch(limits: SandboxLimits, uid: int, files: tuple[tuple[str, bytes], ...], program: list[str],
            binds: list[str] = (), read_only: tuple[str, ...] = (), script: str = MOUNT_TMPFS) -> Launch:
    bwrap = _tool("bwrap", INSTALL_HINT)
    root = privileged()
    namespaces, base, seccomp = _namespaces(uid, root, script), _mount_point(), _seccomp_program()
    owner = uid if root else 0  # without root: the user namespace's root, which bwrap maps the policy's uid onto
    name = f"posttrain-sandbox-{os.getpid()}-{secrets.token_hex(4)}"
    cgroup = sandbox_cgroup.create(name, memory_bound(limits), limits.processes + 2)  # + bwrap's monitor, the agent
    try:
        fstab, *fds = _data_fds([("posttrain-fstab", tmpfs_fstab(limits, base, owner, read_only).encode()),
                                 ("posttrain-seccomp", seccomp), *files])
    except BaseException:
        sandbox_cgroup.remove(cgroup)
        raise
    # copies in bwrap's root, not binds: /proc/self/mountinfo names no host path
    copied = [arg for (path, _), fd in zip(files, fds[1:]) for arg in ("--perms", "0444", "--file", str(fd), path)]
    bound = [arg for i, folder in enumerate(read_only) for arg in ("--ro-bind", f"{base}/ro/{i}", folder)]
    command = [
        *namespaces,
        # --unshare-all but IPC: the sandbox stays in the IPC namespace whose limits were written above
        bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
        "--uid", str(SANDBOX_ID), "--gid", str(SANDBOX_ID),
        "--disable-userns", "--die-with-parent", "--seccomp", str(fds[0]),
        "--new-session", "--as-pid-1", "--hostname", "sandbox",
        *_system_binds(), *binds, "--proc", "/proc", "--dev", "/dev",
        "--bind", f"{base}/work", "/work", "--bind", f"{base}/tmp", "/tmp", "--bind", f"{base}/shm", "/dev/shm",
        "--bind", f"{base}/grader", GRADER,
        *bound, *copied,
        "--remount-ro", "/dev", "--remount-ro", "/",  # bwrap's own tmpfs for / and /dev has no size cap
        "--chdir", "/work", "--clearenv",
        "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/work",
        "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
        "--setenv", "PYTHONNOUSERSITE", "1",  # no usercustomize.py under /work/.local runs in a grader's python
        *program,
    ]
    return Launch(sandbox_cgroup.enter(cgroup, command), tuple(fds), fstab, cgroup)
