"""The bubblewrap sandbox's basic contract: it refuses to run without bwrap, and files, commands,
Python cells, variables and llm_query work as envs expect. Hostile actions: test_sandbox_adversarial.py."""

import os
import re
import tempfile

import pytest

from envs.sandbox import launch as sandbox_launch
from envs.sandbox import INSTALL_HINT, Sandbox, SandboxLimits, SandboxUnavailable, _processes_of
from envs.sandbox.launch import tmpfs_fstab

LIMITS = SandboxLimits(wall_seconds=5)


def test_missing_bwrap_is_unavailable_with_the_install_hint(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no bwrap on PATH
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap") as raised:
        Sandbox(LIMITS)
    assert str(raised.value) == INSTALL_HINT


def test_files_written_at_start_are_visible():
    files = {"a.txt": "hello\n", "pkg/data.bin": b"\x00\x01\xff", "/tmp/side.txt": "side\n"}
    with Sandbox(LIMITS, files=files) as sandbox:
        result = sandbox.run("cat a.txt; od -An -tx1 pkg/data.bin; cat /tmp/side.txt; pwd")
        assert result.exit_code == 0 and result.error is None
        assert result.output.split() == ["hello", "00", "01", "ff", "side", "/work"]
        snapshot = sandbox.files()
    assert snapshot == {"a.txt": b"hello\n", "pkg/data.bin": b"\x00\x01\xff"}


def test_write_outside_the_workspace_is_refused():
    with Sandbox(LIMITS) as sandbox:
        with pytest.raises(ValueError, match="not writable"):
            sandbox.write("../etc/x", "x")
        assert sandbox.run("echo ok").output == "ok\n"


def test_exit_codes_and_observations():
    with Sandbox(LIMITS) as sandbox:
        failed = sandbox.run("echo out; echo err >&2; exit 3")
        assert (failed.output, failed.exit_code) == ("out\nerr\n", 3)
        assert failed.observation() == "out\nerr\n[exit code 3]"
        cell = sandbox.run_python("1 / 0")
        assert cell.exit_code == 1 and cell.error == "ZeroDivisionError: division by zero"
        assert cell.observation() == "[error: ZeroDivisionError: division by zero]"


def test_python_namespace_persists_between_cells_and_shell_commands():
    with Sandbox(LIMITS) as sandbox:
        assert sandbox.run_python("total = 40\ndef add(x):\n    return total + x").exit_code == 0
        assert sandbox.run("echo between").exit_code == 0
        result = sandbox.run_python("print(add(2))\nimport subprocess\nprint(subprocess.run(['false']).returncode)")
        assert (result.output, result.exit_code) == ("42\n1\n", 0)


def test_set_variables_are_seen_by_cells():
    with Sandbox(LIMITS) as sandbox:
        sandbox.set_variables({"context": ["a", "b"], "n": 3})
        assert sandbox.run_python("print(context[1] * n)").output == "bbb\n"


def test_llm_query_reaches_the_host_callable_and_is_counted():
    prompts = []

    def llm(prompt):
        prompts.append(prompt)
        return prompt.upper()

    with Sandbox(LIMITS, llm=llm) as sandbox:
        result = sandbox.run_python("print(llm_query('hi'), llm_query('there'))")
        assert (result.output, result.error) == ("HI THERE\n", None)
        assert prompts == ["hi", "there"] and sandbox.llm_calls == 2


def test_llm_query_failures_are_the_cells_errors():
    def broken(prompt):
        raise ConnectionError("model down")

    with Sandbox(LIMITS, llm=broken) as sandbox:
        result = sandbox.run_python("llm_query('x')")
        assert result.error == "RuntimeError: llm_query failed: ConnectionError: model down"
        assert sandbox.run_python("print('still here')").output == "still here\n"
    with Sandbox(LIMITS) as sandbox:
        assert "not available" in sandbox.run_python("llm_query('x')").error


def test_close_leaves_no_process_and_later_calls_get_an_error():
    sandbox = Sandbox(LIMITS)
    sandbox.run_python("x = 1")  # starts the Python worker too
    assert _processes_of(sandbox.uid)
    sandbox.close()
    assert _processes_of(sandbox.uid) == []
    result = sandbox.run("echo hi")
    assert result.exit_code is None and "stopped" in result.error
    assert sandbox.files() == {}
    sandbox.close()  # twice is fine


def test_the_policy_sees_the_same_ids_in_every_sandbox():
    """Each sandbox runs as its own host uid, but `id` and `ls -ln` must not show which one:
    observations (and so rollouts) would differ from run to run."""
    seen = []
    for _ in range(2):
        with Sandbox() as box:
            seen.append(box.run("touch f; id; ls -ln f | cut -d' ' -f3,4").output)
    assert seen[0] == seen[1] and seen[0].startswith("uid=1000 gid=1000")


def test_the_tmpfs_fstab_escapes_its_folder_and_mounts_under_a_folder_with_spaces(monkeypatch):
    """All four tmpfs come from one fstab (one `mount -a`); a temporary folder with a space or a
    backslash in its name is escaped as libmount reads it, and each tmpfs keeps its cap."""
    fstab = tmpfs_fstab(LIMITS, "/tmp/a b\\c", 7)
    assert [line.split()[1] for line in fstab.splitlines()] == [
        "/tmp/a\\040b\\134c", *(f"/tmp/a\\040b\\134c/{name}" for name in ("work", "tmp", "shm", "grader"))]
    assert all(len(line.split()) == 6 for line in fstab.splitlines())
    base = tempfile.mkdtemp(prefix="posttrain mount point ")  # where the sandbox's uid can reach it, as root
    monkeypatch.setattr(sandbox_launch, "_mount_point", lambda: base)
    try:
        with Sandbox(LIMITS) as box:
            sizes = box.run("df -k --output=target,size /work /tmp /dev/shm /grader | tail -n 4").output
    finally:
        os.rmdir(base)
    assert sizes.split() == ["/work", str(LIMITS.disk_mb * 1024), "/tmp", "8192", "/dev/shm", "4096", "/grader", "8192"]


def test_the_agent_runs_from_bytecode_its_interpreter_compiled(monkeypatch, tmp_path):
    compiled = dict(sandbox_launch.agent_bytecode())
    assert sorted(compiled) == ["sandbox_agent.pyc", "sandbox_files.pyc", "sandbox_proc.pyc", "sandbox_worker.pyc"]
    with Sandbox() as sandbox:
        listed = sandbox.run("ls /opt/posttrain").output.split()
        assert listed == sorted(compiled) and sandbox.run_python("print(6 * 7)").output == "42\n"  # the worker's too
    # an interpreter that cannot compile them: the sandbox is unavailable, and the message says why
    broken = tmp_path / "python3"
    broken.write_text("#!/bin/sh\necho 'SyntaxError: nothing compiles here' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(sandbox_launch, "_python", lambda: (str(broken), []))
    sandbox_launch.agent_bytecode.cache_clear()
    try:
        expected = f"^{re.escape(str(broken))} cannot compile the sandbox's agent: SyntaxError: nothing compiles here$"
        with pytest.raises(SandboxUnavailable, match=expected):
            sandbox_launch.agent_bytecode()
    finally:
        sandbox_launch.agent_bytecode.cache_clear()


def test_a_launch_that_fails_midway_leaves_no_fd_open_and_no_cgroup(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox_launch.sandbox_cgroup, "delegated", lambda: tmp_path)
    removed = []  # a plain folder holding memory.max cannot be rmdir'ed as a cgroup's can: record the call
    monkeypatch.setattr(sandbox_launch.sandbox_cgroup, "remove", removed.append)
    made, real = [], sandbox_launch._data_fd

    def third_fails(name, data):
        if len(made) == 2:  # the fstab and the seccomp program are open by then
            raise OSError(24, "Too many open files")
        made.append(real(name, data))
        return made[-1]

    monkeypatch.setattr(sandbox_launch, "_data_fd", third_fails)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="Too many open files"):
        sandbox_launch.launch(LIMITS, os.geteuid())
    assert len(made) == 2 and set(os.listdir("/proc/self/fd")) == before
    assert removed == list(tmp_path.iterdir()) and len(removed) == 1  # the sandbox's cgroup, removed
