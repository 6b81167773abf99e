"""How a sandbox starts (see envs/sandbox.py): its limits and the command line that launches it."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

AGENT = Path(__file__).with_name("sandbox_agent.py")
AGENT_FILES = [AGENT, *(AGENT.with_name(name) for name in ("sandbox_proc.py", "sandbox_worker.py"))]  # what runs inside
MB = 1024 * 1024
TMP_BYTES, TMP_FILES, SHM_BYTES, SHM_FILES = 8 * MB, 2000, 4 * MB, 100
# Mounts the sandbox's tmpfs (with sizes and inode counts, which bwrap's --tmpfs cannot cap) in a
# mount namespace of their own, over an empty host folder: the host never sees them, and they go
# away with the sandbox's last process. First, in the sandbox's own IPC namespace and while still
# root, SysV shared memory, message queues and semaphores are capped at nothing: a segment would
# outlive each command for the whole episode and count against no process's memory limit.
DENY_SYSV_IPC = ('echo 0 > /proc/sys/kernel/shmall; echo 0 > /proc/sys/kernel/msgmni; '
                 'echo "0 0 0 0" > /proc/sys/kernel/sem; ')
MOUNT_TMPFS = ('set -e; ' + DENY_SYSV_IPC + 'base=$1; mount -t tmpfs -o mode=0755,size=16k posttrain "$base"; '
               'for name in work tmp shm; do mkdir "$base/$name"; mount -t tmpfs -o "$2" posttrain "$base/$name"; '
               'shift; done; shift; exec "$@"')
INSTALL_HINT = "bubblewrap (bwrap) is not installed; install it with `apt-get install bubblewrap` (Debian/Ubuntu)"


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


SANDBOX_ID = 1000  # the uid/gid the policy sees inside: the same in every sandbox, so observations
# (`id`, `ls -ln`) do not depend on which host uid this sandbox got (runs stay reproducible)

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


def bwrap_command(limits: SandboxLimits, uid: int) -> list[str]:
    """The command line up to the agent's own arguments (the host appends its two protocol fds)."""
    bwrap = _tool("bwrap", INSTALL_HINT)
    unshare, setpriv = _util_linux("unshare"), _util_linux("setpriv")
    python, python_binds = _python()
    base = _mount_point()
    return [
        unshare, "--mount", "--ipc", "--propagation", "private", "--", "/bin/sh", "-c", MOUNT_TMPFS, "sh", base,
        _tmpfs_options(limits.disk_mb * MB, limits.max_files, "0755", uid),
        _tmpfs_options(TMP_BYTES, TMP_FILES, "01777", uid), _tmpfs_options(SHM_BYTES, SHM_FILES, "01777", uid),
        setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
        # --unshare-all but IPC: the sandbox stays in the IPC namespace whose limits root wrote above
        bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
        "--uid", str(SANDBOX_ID), "--gid", str(SANDBOX_ID),
        "--disable-userns", "--die-with-parent",
        "--new-session", "--as-pid-1", "--hostname", "sandbox",
        *_system_binds(), *python_binds, "--proc", "/proc", "--dev", "/dev",
        "--bind", f"{base}/work", "/work", "--bind", f"{base}/tmp", "/tmp", "--bind", f"{base}/shm", "/dev/shm",
        *[arg for path in AGENT_FILES for arg in ("--ro-bind", str(path), f"/opt/posttrain/{path.name}")],
        "--remount-ro", "/dev", "--remount-ro", "/",  # bwrap's own tmpfs for / and /dev has no size cap
        "--chdir", "/work", "--clearenv",
        "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/work",
        "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
        "--setenv", "PYTHONNOUSERSITE", "1",  # no usercustomize.py under /work/.local runs in a grader's python
        python, "-I", "-S", f"/opt/posttrain/{AGENT.name}", limits.model_dump_json(),
    ]
