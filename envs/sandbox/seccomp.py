"""The sandbox's seccomp filter: a compiled BPF program for bwrap's `--seccomp FD`, built with libseccomp.

Everything is allowed but the system calls below, which fail with EPERM: kernel attack surface a
shell task never needs (io_uring, bpf, userfaultfd, perf events, keyrings), ways out of or around
the namespaces and mounts (mount API, unshare, setns, pivot_root, handles by inode), reading or
writing another process (ptrace, process_vm_*, pidfd_getfd), memory that no tmpfs caps (memfd) or
that outlives a command (SysV IPC), what only an administrator does (modules, kexec, swap,
reboot, accounting, clocks, quotas), and vsock sockets (a VM's channel to its host, which the
network namespace does not cover). It follows Docker's default profile, stricter where a
sandboxed command has no use for a call (ptrace, memfd, unshare). The filter is libseccomp's for the native
architecture only: a call through another ABI (i386's int 0x80, x32) kills the process.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import tempfile

LIBRARY = "libseccomp.so.2"
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_ACT_ERRNO = 0x00050000  # | errno
UNKNOWN = -1  # seccomp_syscall_resolve_name: a name this libseccomp does not know
DENIED = (
    "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "userfaultfd", "perf_event_open",
    "keyctl", "add_key", "request_key",
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd", "kcmp",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig",
    "fspick", "mount_setattr", "unshare", "setns", "open_by_handle_at", "name_to_handle_at",
    "memfd_create", "memfd_secret", "shmget", "msgget", "semget",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "create_module",
    "get_kernel_syms", "query_module", "swapon", "swapoff", "reboot", "acct", "syslog", "vhangup",
    "settimeofday", "clock_settime", "clock_adjtime", "quotactl", "quotactl_fd", "lookup_dcookie",
    "nfsservctl", "uselib", "ustat", "sysfs", "_sysctl", "ioperm", "iopl", "vm86", "vm86old", "fanotify_init",
)


SCMP_CMP_EQ = 4
AF_VSOCK = 40
# socket families refused by their first argument: vsock talks to the hypervisor (a VM host's
# channel), and a network namespace does not cover it
DENIED_SOCKET_FAMILIES = (AF_VSOCK,)


class ArgCmp(ctypes.Structure):
    """libseccomp's `struct scmp_arg_cmp`: argument `arg` compared with `op` to datum_a (and b)."""

    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def _library(name: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(name, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.c_void_p]  # not seccomp_rule_add: ctypes and varargs
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def _check(result: int, what: str) -> None:
    if result < 0:  # libseccomp returns -errno
        raise OSError(-result, f"libseccomp: {what}: {os.strerror(-result)}")


def compile_filter() -> bytes:
    """The BPF program denying DENIED with EPERM (OSError when libseccomp cannot be loaded or fails)."""
    lib = _library(LIBRARY)
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError(errno.ENOMEM, "libseccomp: seccomp_init failed")
    try:
        for name in DENIED:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number != UNKNOWN:  # unknown: newer than this libseccomp (the kernel is likely older too)
                _check(lib.seccomp_rule_add_array(ctx, SCMP_ACT_ERRNO | errno.EPERM, number, 0, None), f"deny {name}")
        socket = lib.seccomp_syscall_resolve_name(b"socket")
        for family in DENIED_SOCKET_FAMILIES:
            family_is = ArgCmp(0, SCMP_CMP_EQ, family, 0)
            _check(lib.seccomp_rule_add_array(ctx, SCMP_ACT_ERRNO | errno.EPERM, socket, 1, ctypes.byref(family_is)),
                   f"deny socket family {family}")
        with tempfile.TemporaryFile() as bpf:
            _check(lib.seccomp_export_bpf(ctx, bpf.fileno()), "export")
            bpf.seek(0)
            return bpf.read()
    finally:
        lib.seccomp_release(ctx)


@functools.cache
def program() -> bytes:
    """The filter, compiled once per process."""
    return compile_filter()


def number(name: str) -> int:
    """The system call's number on this architecture (negative: none here, or unknown to libseccomp)."""
    return _library(LIBRARY).seccomp_syscall_resolve_name(name.encode())
