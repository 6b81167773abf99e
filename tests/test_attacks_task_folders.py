"""Symlinks in task folders (issue 20, item 3, in part): a link is never read as its target on the
host; the folder is refused with one line naming the link."""

import shutil

import pytest

from envs.openclaw import OpenClawEnv, OpenClawEnvConfig
from envs.terminal.catalogue import load_tasks
from flows.cli.main import main
from conftest import ROOT

HOST_ONLY = "host-only secret"


def host_file(tmp_path):
    secret = tmp_path / "host-only.txt"
    secret.write_text(HOST_ONLY)
    return secret


def test_a_symlink_in_a_terminal_task_is_refused(tmp_path):
    task = tmp_path / "tasks" / "count-files"
    shutil.copytree(ROOT / "envs" / "data" / "terminal" / "count-files", task)
    (task / "environment").mkdir(exist_ok=True)
    (task / "environment" / "notes.txt").symlink_to(host_file(tmp_path))
    with pytest.raises(ValueError, match=r"environment/notes.txt: a symlink \(task folders are read without "
                                         r"following links\)$"):
        load_tasks(tmp_path / "tasks")


def test_a_symlinked_openclaw_workspace_file_and_skill_file_are_refused(tmp_path):
    data = tmp_path / "openclaw"
    shutil.copytree(ROOT / "envs" / "data" / "openclaw", data)
    (data / "tasks" / "files" / "story.txt").unlink()
    (data / "tasks" / "files" / "story.txt").symlink_to(host_file(tmp_path))
    with pytest.raises(ValueError, match=r"story.txt: a symlink"):
        OpenClawEnv(OpenClawEnvConfig(kind="openclaw", tasks=str(data))).all_tasks()
    (data / "tasks" / "files" / "story.txt").unlink()
    shutil.copy(ROOT / "envs" / "data" / "openclaw" / "tasks" / "files" / "story.txt", data / "tasks" / "files")
    skill = next(path for path in (data / "skills").iterdir() if path.is_dir())
    (skill / "extra.md").symlink_to(host_file(tmp_path))
    with pytest.raises(ValueError, match=r"extra.md: a symlink"):
        OpenClawEnv(OpenClawEnvConfig(kind="openclaw", tasks=str(data))).all_tasks()


def test_sandbox_files_with_a_symlink_is_one_line(tmp_path, capsys):
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "leak.txt").symlink_to(host_file(tmp_path))
    assert main(["sandbox", "--files", str(seed), "--", "cat", "leak.txt"]) == 2
    assert capsys.readouterr().err == (f"error: --files {seed / 'leak.txt'}: a symlink (task folders are read "
                                       "without following links)\n")


def test_sysv_shared_memory_queues_and_semaphores_are_denied_in_the_sandbox():
    from envs.sandbox import Sandbox

    probe = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             "print(libc.shmget(0, 1 << 26, 0o1600), libc.msgget(0, 0o1600), libc.semget(0, 1, 0o1600))\n")
    with Sandbox() as box:
        box.write("probe.py", probe)
        assert box.run("python3 probe.py").output.strip() == "-1 -1 -1"
        assert box.run("cat /proc/sys/kernel/shmall").output.strip() == "0"
        assert box.run("echo 99999 > /proc/sys/kernel/shmall; cat /proc/sys/kernel/shmall").output.strip().endswith("0")
