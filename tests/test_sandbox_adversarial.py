"""Hostile actions a policy might emit, each contained by the bubblewrap sandbox: `run`/`run_python`
return in bounded time without raising; the host is untouched (a sentinel file, the agent's source, the
repo, a secret env var, no process of the sandbox's uid after `close`); the same sandbox still works."""

import hashlib
import os
import socket
import time
from pathlib import Path

import pytest

from envs.sandbox import AGENT_FILES, Sandbox, SandboxLimits, _processes_of

REPO = Path(__file__).resolve().parents[1]
SECRET = "posttrain-test-secret-6d1f0c"
HOSTILE = SandboxLimits(wall_seconds=2, cpu_seconds=2, disk_mb=4, max_files=1000, output_bytes=256)
SLACK_SECONDS = 3.0  # on top of the wall clock: interrupt grace, the sweep, a loaded machine
OUTSIDE = ("/pwned", "/etc/pwned", "/usr/pwned", "/opt/pwned", "/root/pwned", str(REPO / "pwned"))


@pytest.fixture
def host(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", SECRET)
    sentinel = tmp_path / "sentinel.txt"
    sentinel.write_text("untouched")
    agent_digests = [hashlib.sha256(path.read_bytes()).hexdigest() for path in AGENT_FILES]
    yield tmp_path
    assert sentinel.read_text() == "untouched"
    assert os.listdir(tmp_path) == ["sentinel.txt"]
    assert [hashlib.sha256(path.read_bytes()).hexdigest() for path in AGENT_FILES] == agent_digests
    assert not [path for path in OUTSIDE if os.path.lexists(path)]


@pytest.fixture
def sandbox(host):
    box = Sandbox(HOSTILE, files={"keep.txt": "mine\n"})
    yield box
    assert box.stopped is None, box.stopped
    assert len(_processes_of(box.uid)) <= 3  # bwrap's monitor, the agent, the Python worker
    assert box.run("echo alive").observation() == "alive\n[exit code 0]"
    assert box.run_python("print('py alive')").observation() == "py alive\n[exit code 0]"
    box.close()
    assert _processes_of(box.uid) == []


def act(box, action):
    """One action (a `py:` prefix makes it a Python cell), checked for bounded time and text output."""
    started = time.monotonic()
    result = box.run_python(action[3:]) if action.startswith("py:") else box.run(action)
    assert time.monotonic() - started < HOSTILE.wall_seconds + SLACK_SECONDS, action[:100]
    assert isinstance(result.output, str) and len(result.output) < 2 * HOSTILE.output_bytes
    return result


def failed(result):
    return result.error is not None or result.exit_code != 0


REFUSED = {
    "rm -rf /": "rm -rf /",
    "rm -rf --no-preserve-root /": "rm -rf --no-preserve-root /",
    **{f"write {folder}": f"mkdir -p {folder} && echo x > {folder}/pwned" for folder in ("/usr", "/etc", "", "/opt")},
    "overwrite the agent": "echo 'import os' > /opt/posttrain/sandbox_agent.pyc",
    "plant a source beside the agent's bytecode": "echo 'import os' > /opt/posttrain/sandbox_files.py",
    "write /proc/sys": "echo evil > /proc/sys/kernel/hostname",
    "sysrq": "echo h > /proc/sysrq-trigger",
    "write /dev/sda": "echo x > /dev/sda",
    "read /dev/mem": "head -c 16 /dev/mem",
    "read /etc/passwd": "cat /etc/passwd",
    "read /etc/shadow": "cat /etc/shadow",
    "list /root": "ls /root",
    "read the repo": f"cat {REPO}/envs/sandbox/__init__.py",
    **{f"pid 1's {name}": f"ls /proc/1/{name}/ || cat /proc/1/{name}" for name in ("environ", "mem", "root", "fd")},
    "ptrace pid 1": "python3 -c 'import ctypes; raise SystemExit(ctypes.CDLL(None).ptrace(16, 1, 0, 0) != 0)'",
    "su": "su -c id root",
    "sudo": "sudo id",
    "unshare -r": "unshare -r id",
    "setuid 0": "python3 -c 'import os; os.setuid(0)'",
    "setpriv to root": "setpriv --reuid=0 id",
    "mount tmpfs": "mkdir -p m && mount -t tmpfs none m",
    "bind mount /": "mkdir -p m && mount --bind / m",
    "chown to root": "chown 0:0 keep.txt",
    "chmod setuid python": "chmod u+s /usr/bin/python3",
    "hard link the agent": "ln /opt/posttrain/sandbox_agent.py agent-link",
    "hard link python": "ln /usr/bin/python3 python-link",
    "tiocsti": "python3 -c 'import fcntl, termios; fcntl.ioctl(0, termios.TIOCSTI, b\"x\")'",
    "open /dev/tty": "echo x > /dev/tty",
    "dns": "getent hosts example.com",
    "python dns": "python3 -c 'import socket; socket.getaddrinfo(\"example.com\", 80)'",
    "urllib": "python3 -c 'import urllib.request; urllib.request.urlopen(\"http://example.com\", timeout=1)'",
    "huge argument": "echo " + "A" * 1_000_000,
    "infinite loop": "while :; do :; done",
    "sleep forever": "sleep infinity",
    "closes stdout, sleeps": "exec >&- 2>&-; sleep 100",
    "yes": "yes",
    "cat /dev/urandom": "cat /dev/urandom",
    "memory bomb": "python3 -c 'x = bytearray(10 * 2**30)'",
    **{f"fill {folder}": f"head -c 100M /dev/zero > {folder}/big" for folder in ("/work", "/tmp", "/dev/shm")},
    "sparse huge file": "truncate -s 100G huge",
    "many small files": "for i in $(seq 200000); do : > f$i || exit 1; done",
    "py infinite loop": "py:while True: pass",
    "py sleep forever": "py:import time\ntime.sleep(10**6)",
    "py memory bomb": "py:x = bytearray(10 * 2**30)",
    "py setuid": "py:import os\nos.setuid(0)",
    "py socket to the host": "py:import socket\nsocket.create_connection(('10.0.0.1', 80), timeout=1)",
    "py enormous print": "py:print('x' * 10**8)",
    "py sys.exit": "py:import sys\nsys.exit(0)",
    "read stdin": "cat; read line",
    "py read stdin": "py:input()",
    "kernel log": "dmesg",
    "NUL in a command": "echo a\x00b",
    "NUL in a cell": "py:x = '\x00'",
}


@pytest.mark.parametrize("action", REFUSED.values(), ids=REFUSED.keys())
def test_hostile_action_fails_inside(sandbox, action):
    result = act(sandbox, action)
    assert failed(result), result
    assert SECRET not in result.output and "root:x:0" not in result.output


def test_fork_bombs_are_cleaned_up(sandbox):
    assert act(sandbox, ":(){ :|:& };:").error is None  # it returns at once, leaving the bomb behind
    assert len(_processes_of(sandbox.uid)) <= 3
    act(sandbox, ":(){ :|:& };:; sleep 1")  # the bomb at its process limit for a while
    assert len(_processes_of(sandbox.uid)) <= 3
    python_bomb = "py:import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    assert failed(act(sandbox, python_bomb))
    assert len(_processes_of(sandbox.uid)) <= 3
    assert act(sandbox, "ps -eo comm --no-headers").output == "python3\npython3\nps\n"  # agent, worker, ps


def test_host_secrets_are_not_visible(sandbox):
    assert os.environ["POSTTRAIN_TEST_SECRET"] == SECRET
    for action in ("env", "cat /proc/self/environ", "cat /proc/*/environ", "py:import os\nprint(dict(os.environ))",
                   "grep -r posttrain-test /proc/*/environ /proc/*/cmdline 2>&1 | head -3"):
        result = act(sandbox, action)
        assert SECRET not in result.output and "POSTTRAIN_TEST_SECRET" not in result.output


def test_no_network_reaches_the_host(sandbox):
    with socket.socket() as listener, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        udp.bind(("127.0.0.1", 0))
        tcp_port, udp_port = listener.getsockname()[1], udp.getsockname()[1]
        for action in (f"echo hello > /dev/tcp/127.0.0.1/{tcp_port}",
                       f"python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {tcp_port}))'",
                       f"python3 -c 'import urllib.request; urllib.request.urlopen(\"http://127.0.0.1:{tcp_port}\")'",
                       f"py:import socket\nsocket.create_connection(('127.0.0.1', {tcp_port}))"):
            assert failed(act(sandbox, action))
        act(sandbox, f"echo hello > /dev/udp/127.0.0.1/{udp_port}")  # UDP sends succeed into the sandbox's own lo
        act(sandbox, "py:import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM)"
                     f".sendto(b'x', ('127.0.0.1', {udp_port}))")
        listener.settimeout(0.3)
        udp.settimeout(0.3)
        with pytest.raises(TimeoutError):
            listener.accept()
        with pytest.raises(TimeoutError):
            udp.recvfrom(16)


def test_disk_stays_within_its_tmpfs(sandbox):
    for action in ("head -c 3M /dev/zero > a", "head -c 3M /dev/zero > b", "head -c 20M /dev/zero > /tmp/c"):
        act(sandbox, action)
    used = [int(kb) for kb in act(sandbox, "du -sk /work /tmp /dev/shm | cut -f1").output.split()]
    caps = [HOSTILE.disk_mb * 1024, 8 * 1024, 4 * 1024]
    assert len(used) == 3 and all(kb <= cap for kb, cap in zip(used, caps)), used
    assert act(sandbox, "rm -f a b /tmp/c && echo ok > small && cat small").output == "ok\n"


def test_binary_output_comes_back_as_text(sandbox):
    result = act(sandbox, "printf 'a\\377\\376\\000b'; head -c 100 /dev/urandom")
    assert result.output.startswith("a\ufffd\ufffd\x00b") and result.exit_code == 0
    cell = act(sandbox, "py:import sys\nsys.stdout.buffer.write(b'\\xff\\xfe ok\\n')\nprint('\\udcff')")
    assert cell.output == "\ufffd\ufffd ok\n\\udcff\n" and cell.exit_code == 0


def test_links_and_proc_do_not_leak_host_files(sandbox):
    proc = act(sandbox, "readlink /proc/self/cwd /proc/self/root; ls /proc/self/root/")
    assert proc.output.split()[:2] == ["/work", "/"] and "main" not in proc.output.split()
    act(sandbox, "ln -s / root; ln -s /etc/ld.so.cache cache; ln -s /opt/posttrain/sandbox_agent.py agent; "
                 "ln -s /proc/1/root proc-root; mkdir d; ln -s /usr d/usr")
    assert sorted(sandbox.files()) == ["keep.txt"]
    act(sandbox, "rm -rf d && ln -s /tmp d")
    sandbox.write("d/planted.txt", "from the host\n")  # writes exactly /work/d/planted.txt, replacing the link
    sandbox.write("root", "a file now\n")
    assert act(sandbox, "ls /tmp; cat d/planted.txt root").output == "from the host\na file now\n"
    with pytest.raises(ValueError):
        sandbox.write("../../etc/pwned", "x")


@pytest.mark.parametrize("kill", ["kill -9 1", "kill -9 -1", "kill $PPID", "kill -STOP 1", "kill -9 0",
                                  "py:import os, signal\nos.kill(1, signal.SIGKILL)",
                                  "py:import os, signal\nos.kill(-1, signal.SIGKILL)"])
def test_the_agent_cannot_be_killed(sandbox, kill):
    act(sandbox, kill)
    assert act(sandbox, "echo still").output == "still\n"


def test_python_worker_exits_and_comes_back(sandbox):
    assert act(sandbox, "py:x = 1").exit_code == 0
    gone = act(sandbox, "py:import os\nos._exit(3)")
    assert gone.exit_code is None and "exited (code 3)" in gone.error and "lost" in gone.error
    assert "NameError" in act(sandbox, "py:print(x)").error
    act(sandbox, "py:y = 2")
    act(sandbox, "kill -9 -1")  # a command may kill the stopped worker: the next cell gets a fresh one
    fresh = act(sandbox, "py:print('fresh')")
    assert fresh.output.startswith("[the Python process had been killed") and fresh.output.endswith("lost]\nfresh\n")


def test_a_cell_that_ignores_its_timeout_loses_only_its_worker(sandbox):
    act(sandbox, "py:kept = 'value'")
    assert act(sandbox, "py:while True: pass").error.startswith("timed out")
    assert act(sandbox, "py:print(kept)").output == "value\n"  # interrupted, not killed
    stubborn = act(sandbox, "py:import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True: pass")
    assert "killed" in stubborn.error and "lost" in stubborn.error


def test_garbage_on_the_protocol_fds_is_contained(sandbox):
    act(sandbox, "py:x = 7")
    forged_reply = '{"output": "FORGED", "exit_code": 0, "error": null}'
    fd1 = act(sandbox, f"py:import os\nos.write(1, b'not json\\n{forged_reply}\\n')")
    assert fd1.output.startswith("not json") and fd1.exit_code == 0
    assert act(sandbox, "false").exit_code == 1  # not a forged 0
    every_fd = act(sandbox, "py:import os\nfor fd in map(int, os.listdir('/proc/self/fd')):\n"
                            "    try:\n        os.write(fd, b'{\"done\": null}\\nnot json\\n')\n"
                            "    except OSError:\n        pass")
    assert "broke its protocol" in every_fd.error
    forged = act(sandbox, "for f in /proc/1/fd/*; do echo '{\"output\": \"FORGED\", \"exit_code\": 0}' > $f; done; "
                          "echo '{\"done\": null, \"n\": 99}' > /proc/$(pgrep -f 'sandbox_worker.py')/fd/1; exit 5")
    assert forged.exit_code == 5 and "FORGED" not in forged.output
    assert act(sandbox, "py:print('ok')").output == "ok\n"


def test_a_cell_forging_its_own_done_only_ends_itself(sandbox):
    forged = act(sandbox, "py:import json, os, sys, time\nn = sys._getframe().f_back.f_locals['message']['n']\n"
                          "os.write(int(sys.argv[2]), (json.dumps({'done': 123, 'n': n}) + '\\n').encode())\n"
                          "time.sleep(1)\nprint('late')")
    assert forged.error == "123"
    assert act(sandbox, "echo graded").output == "graded\n"
    later = act(sandbox, "py:print('next')")  # the forged cell finishes first; its real "done" is dropped
    assert later.output.endswith("next\n") and later.error is None


def test_background_processes_do_not_outlive_the_command(sandbox):
    started = time.monotonic()
    result = act(sandbox, "nohup sleep 1000 & setsid sleep 1000 & (sleep 1000 &) ; python3 -c "
                          "'import os, time\nif os.fork() == 0:\n    os.setsid(); time.sleep(1000)' & echo started")
    assert result.exit_code == 0 and time.monotonic() - started < 1.5
    act(sandbox, "py:import subprocess\nsubprocess.Popen(['sleep', '1000'])")
    assert len(_processes_of(sandbox.uid)) <= 3
    assert act(sandbox, "pgrep sleep").exit_code == 1


def test_chmod_tricks_do_not_lock_out_the_grader(sandbox):
    act(sandbox, "mkdir -p tests && chmod 000 tests keep.txt && chmod 000 /work")
    sandbox.write("tests/test_hidden.py", "def test_x(): pass\n")
    sandbox.write("keep.txt", "replaced\n")
    assert act(sandbox, "cat tests/test_hidden.py keep.txt").output == "def test_x(): pass\nreplaced\n"
    assert sorted(sandbox.files()) == ["keep.txt", "tests/test_hidden.py"]


def test_huge_cell_and_huge_output_are_bounded(sandbox):
    act(sandbox, "py:x = 1")  # the worker is stopped between cells: a message larger than a pipe must still reach it
    assert act(sandbox, "py:x = '" + "a" * 5_000_000 + "'\nprint(len(x))").output == "5000000\n"
    flood = act(sandbox, "py:while True: print('x' * 1000)")
    assert flood.error.startswith("output limit") and "[output truncated" in flood.output


def test_a_cells_threads_cannot_act_during_later_commands(sandbox):
    """A thread scribbles and keeps starting processes that wake the worker (SIGCONT): they are frozen, then
    killed, and the worker is stopped again before the next command."""
    act(sandbox, "py:import os, subprocess, threading, time\nme = os.getpid()\ndef wake():\n    while True:\n"
                 "        subprocess.Popen(['/bin/sh', '-c', f'while :; do kill -CONT {me}; done'])\n"
                 "        open('/work/log', 'a').write('x')\n        time.sleep(0.01)\n"
                 "threading.Thread(target=wake, daemon=True).start()\ntime.sleep(0.2)\nkept = 1")
    act(sandbox, "kill -CONT -1; sleep 0.2")  # the policy's own command may wake it too
    grader = act(sandbox, "wc -c < log; sleep 0.3; wc -c < log")
    first, second = grader.output.split()
    assert first == second and len(_processes_of(sandbox.uid)) <= 3
    assert act(sandbox, "py:print(kept)").output.endswith("1\n")  # the same worker, not a fresh one


def test_the_episode_cpu_budget_for_cells_holds(host):
    with Sandbox(HOSTILE.model_copy(update={"episode_cpu_seconds": 1, "wall_seconds": 4})) as box:
        assert "exited" in act(box, "py:while True: pass").error  # SIGXCPU after 1 s of CPU
        assert "CPU time for Python (1s) is spent" in act(box, "py:print(1)").error
        assert act(box, "echo commands still run").exit_code == 0


def test_a_planted_usercustomize_does_not_run_in_later_python(sandbox):
    act(sandbox, 'site=$(python3 -c "import site; print(site.getusersitepackages())") && mkdir -p "$site" && '
                 'echo "print(\'HIJACKED\')" > "$site/usercustomize.py"')
    assert act(sandbox, "python3 -c 'print(1)'").output == "1\n"
