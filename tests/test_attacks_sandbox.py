"""Issue 20, item 3: attacks on the sandbox itself, each run from inside, each asserting the harmless
outcome. The seccomp filter (denied calls fail with EPERM), the memory and process caps across the
commands of one episode, graders the policy cannot shadow a module of, no host path in the mount
table, and the same sandbox without root."""

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

from envs.sandbox import cgroup as sandbox_cgroup
from envs.sandbox import seccomp as sandbox_seccomp
from envs.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
from envs.sandbox.launch import GRADER_BYTES, MB, SHM_BYTES, TMP_BYTES, memory_bound
from envs.terminal.env import DATA, TerminalEnv, TerminalEnvConfig

REPO = Path(__file__).resolve().parents[1]
LIMITS = SandboxLimits(wall_seconds=3, cpu_seconds=2, disk_mb=4, max_files=1000, processes=12, output_bytes=2048)
# (name, arguments): each call would succeed (or fail otherwise than EPERM) without the filter
CALLS = {"memfd_create": "b'x', 0", "io_uring_setup": "1, buffer", "userfaultfd": "0", "bpf": "0, buffer, 72",
         "keyctl": "0, -3, 0", "ptrace": "0, 0, 0, 0", "unshare": "0", "mount": "b'none', b'/tmp', b'tmpfs', 0, None",
         "shmget": "0, 4096, 0o1600", "msgget": "0, 0o1600", "semget": "0, 1, 0o1600", "setns": "0, 0",
         "process_vm_readv": "1, None, 0, None, 0, 0", "perf_event_open": "buffer, 0, -1, -1, 0",
         "socket": "40, 1, 0"}  # AF_VSOCK, SOCK_STREAM: the hypervisor's channel, outside the network namespace


@pytest.fixture(scope="module")
def box():
    with Sandbox(LIMITS) as sandbox:
        yield sandbox
        assert sandbox.stopped is None, sandbox.stopped


@pytest.fixture
def fresh(box):
    yield box
    assert box.run("echo alive").output == "alive\n"  # every attack leaves the sandbox working


def test_denied_system_calls_fail_with_eperm(fresh):
    numbers = {name: sandbox_seccomp.number(name) for name in CALLS}
    calls = "".join(f"ctypes.set_errno(0)\nprint({name!r}, libc.syscall({number}, {CALLS[name]}), "
                    "ctypes.get_errno())\n" for name, number in numbers.items())
    script = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nbuffer = ctypes.create_string_buffer(256)\n"
    script += calls
    fresh.write("calls.py", script)
    for run in (fresh.run("python3 calls.py"), fresh.run_python(script)):  # a command, and a cell in the worker
        assert run.output.splitlines() == [f"{name} -1 1" for name in CALLS], run.output
    assert fresh.run("python3 -c 'import os; os.memfd_create(\"x\")'").output.endswith(
        "PermissionError: [Errno 1] Operation not permitted\n")
    x32 = fresh.run("python3 -c 'import ctypes; ctypes.CDLL(None).syscall(0x40000000 | 319, b\"x\", 0); print(1)'")
    assert x32.exit_code in (-signal.SIGSYS, 128 + signal.SIGSYS) and x32.output == ""  # another ABI: killed


def test_ordinary_programs_still_work_under_the_filter(fresh):
    result = fresh.run("python3 -c 'import multiprocessing as m, subprocess; q = m.Queue(); "
                       "p = m.Process(target=q.put, args=(7,)); p.start(); print(q.get()); p.join(); "
                       "print(subprocess.run([\"sort\", \"-r\"], input=b\"a\\nb\\n\", capture_output=True).stdout)'; "
                       "timeout 1 sleep 3; echo $? | tr -d '\\n' | wc -c; grep -c Seccomp:.2 /proc/self/status")
    assert result.output == "7\nb'b\\na\\n'\n3\n1\n", result.output


def test_without_libseccomp_there_is_no_sandbox(monkeypatch):
    monkeypatch.setattr(sandbox_seccomp, "LIBRARY", "libseccomp-missing.so.0")
    sandbox_seccomp.program.cache_clear()
    with pytest.raises(SandboxUnavailable, match=r"apt-get install libseccomp2"):
        Sandbox(LIMITS)
    sandbox_seccomp.program.cache_clear()


def test_disk_caps_hold_across_commands(fresh):
    caps = {"/work": LIMITS.disk_mb * MB, "/tmp": TMP_BYTES, "/dev/shm": SHM_BYTES, "/grader": GRADER_BYTES}
    for folder, cap in caps.items():
        for part in range(3):  # each command writes 60% of the cap: the second one already hits it
            fresh.run(f"head -c {cap * 6 // 10} /dev/zero > {folder}/part{part}")
        used = int(fresh.run(f"du -sb {folder} | cut -f1").output)
        assert cap // 2 < used <= cap, (folder, used)
        fresh.run(f"rm -rf {folder}/part*")


def test_processes_do_not_accumulate_across_commands(fresh):
    forks = ("python3 -c 'import os, time\nstarted = 0\nfor _ in range(40):\n    try:\n        if os.fork() == 0:\n"
             "            time.sleep(100)\n            os._exit(0)\n        started += 1\n    except OSError:\n"
             "        break\nprint(started)'")
    started = [int(fresh.run(forks).output) for _ in range(3)]  # each command's sleepers are killed after it
    assert 0 < started[0] < LIMITS.processes and started == [started[0]] * 3, started


def test_the_fallback_bound_and_a_delegated_cgroup(monkeypatch, tmp_path):
    assert memory_bound(LIMITS) == (12 * 512 + 4 + 8 + 4 + 8) * MB
    monkeypatch.setattr(sandbox_cgroup, "delegated", lambda: tmp_path)  # the kernel's part is untested here
    with Sandbox(LIMITS) as sandbox:
        assert sandbox.cgroup.parent == tmp_path and sandbox.run("echo in").output == "in\n"
        assert (sandbox.cgroup / "memory.max").read_text() == f"{memory_bound(LIMITS)}\n"
        assert (sandbox.cgroup / "pids.max").read_text() == f"{LIMITS.processes + 2}\n"
        assert int((sandbox.cgroup / "cgroup.procs").read_text()) == sandbox.process.pid


def test_no_host_path_in_the_mount_table(fresh):
    fresh.run("cat /proc/self/mountinfo /proc/mounts > mounts.txt; ls /opt/posttrain >> mounts.txt")
    seen = fresh.files()["mounts.txt"].decode()
    assert "sandbox_agent.pyc" in seen and " /work " in seen
    for host_path in (str(REPO), sys.prefix, "posttrain-sandbox", tempfile.gettempdir() + "/"):
        assert host_path not in seen


def test_the_grader_folder_is_emptied_before_grading(fresh):
    fresh.run("mkdir -p /grader/tests/deep /grader/home && echo planted > /grader/tests/check.py && "
              "ln -s /work /grader/tests/work && ln -s /usr /grader/usr && chmod 000 /grader/tests/deep /grader/tests /grader")
    seen = fresh.grade({"test.sh": b"exit 0\n"}, 'ls -A /grader /grader/tests /grader/home; pwd; echo "$HOME"')
    assert seen.output == "/grader:\nhome\ntests\n\n/grader/home:\n\n/grader/tests:\ntest.sh\n/grader\n/grader/home\n"


CHECK = ("set -e\ncd /work\npython3 -c 'import json, sys; sys.exit(json.load(open(\"answer.json\"))[\"n\"] != 42)'\n"
         "python3 -m unittest discover -s \"$TESTS_DIR\" -p 'check_*.py'\n")


def answer_task(root: Path) -> TerminalEnv:
    """A terminal task whose check imports json and runs unittest from /work, as graders often do."""
    folder = root / "answer"
    shutil.copytree(DATA / "python-sum", folder)
    (folder / "solution" / "solve.sh").write_text("echo '{\"n\": 42}' > answer.json\n")
    (folder / "tests" / "test.sh").write_text(CHECK)
    (folder / "tests" / "check_answer.py").write_text(
        "import json, unittest\n\nclass Answer(unittest.TestCase):\n    def test_n(self):\n"
        "        self.assertEqual(json.load(open('/work/answer.json')), {'n': 42})\n")
    return TerminalEnv(TerminalEnvConfig(kind="terminal", tasks=str(root)))


PLANTS = [  # a wrong answer, then modules and configs that would make the check pass if a grader picked them up
    "echo '{\"n\": 0}' > answer.json && printf 'def load(f):\\n    return {\"n\": 42}\\n' > json.py",
    ("printf 'import os\\nos._exit(0)\\n' | tee unittest.py pytest.py conftest.py sitecustomize.py usercustomize.py "
     "/tmp/json.py /tmp/unittest.py /tmp/conftest.py > /dev/null"),
    "printf '[pytest]\\naddopts = -p no:cacheprovider\\n' > /tmp/pytest.ini",
    ('site=$(python3 -c "import site; print(site.getusersitepackages())") && mkdir -p "$site" && '
     "echo 'import os; os._exit(0)' > \"$site/zz.pth\" && cp unittest.py \"$site/\""),
    "mkdir -p /grader/tests && cp unittest.py /grader/tests/check_answer.py && cp unittest.py json.py /grader/",
]
SHADOWED = "cd /work && " + " && ".join(CHECK.splitlines()[2:])  # the check's lines, as the policy's own command


@pytest.mark.parametrize("solve", [False, True], ids=["plants only", "oracle and plants"])
def test_planted_modules_do_not_change_the_grade(tmp_path, solve):
    env = answer_task(tmp_path)
    task = env.all_tasks()[0]
    episode = env.start(task)
    for plant in PLANTS:
        assert "[exit code 0]" in episode.step(f"<bash>{plant}</bash>").observation, plant
    unguarded = episode.step(f"<bash>{SHADOWED}</bash>").observation  # the check, run as the policy: it passes
    assert unguarded.endswith("[exit code 0]</output>\n")
    if solve:
        episode.step(env.oracle_actions(task)[0])
    assert episode.finish() == {"tests_passed": float(solve)}


DROP = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def rootless_python(home: str) -> list[str] | None:
    """How uid 65534 runs this checkout's Python with its packages (None when it cannot)."""
    drop = [*DROP, "env", "-i", f"HOME={home}", f"TMPDIR={home}", "PATH=/usr/local/bin:/usr/bin:/bin",
            "PYTHONDONTWRITEBYTECODE=1", f"PYTHONPATH={REPO}:{sysconfig.get_paths()['purelib']}"]
    same = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for python in (sys.executable, f"/usr/bin/{same}", f"/usr/local/bin/{same}"):  # a venv's own may be unreadable
        imports = [*drop, python, "-c", "import envs.sandbox"]
        if os.path.exists(python) and not subprocess.run(imports, cwd=home, capture_output=True,
                                                         check=False).returncode:
            return [*drop, python]
    return None


ROOTLESS = """
import json
from envs.sandbox import Sandbox, SandboxLimits
with Sandbox(SandboxLimits(disk_mb=2, processes=8, wall_seconds=3)) as box:
    print(json.dumps({"uid": box.uid, "inside": box.run("id -u").output,
                      "disk": box.run("head -c 3M /dev/zero > big 2>/dev/null; du -sk /work | cut -f1").output,
                      "memfd": box.run_python("import os\\ntry:\\n    os.memfd_create('x')\\nexcept OSError as e:\\n"
                                              "    print(e.errno)").output,
                      "forks": box.run("for i in 1 2 3; do sleep 0.1 & done; wait; echo ok").output,
                      "graded": box.grade({"test.sh": b"pwd"}, 'bash "$TESTS_DIR/test.sh"').output,
                      "mounts": box.run("grep -c -e posttrain-sandbox -e REPO /proc/self/mountinfo").output}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="not root: every sandbox test here already runs without root")
def test_the_sandbox_works_without_root():
    """As uid 65534, with more processes of its own than the sandbox's cap (which counts per user namespace)."""
    if shutil.which("setpriv") is None or subprocess.run([*DROP, "unshare", "--user", "--map-root-user", "true"],
                                                         capture_output=True, check=False).returncode:
        pytest.skip("no setpriv, or no unprivileged user namespaces on this host")
    home = tempfile.mkdtemp(prefix="rootless-")
    try:
        os.chown(home, 65534, 65534)
        command = rootless_python(home)
        if command is None:
            pytest.skip(f"uid 65534 cannot import envs.sandbox from {REPO} with {sys.executable} (not readable)")
        sleepers = [subprocess.Popen([*DROP, "sleep", "30"]) for _ in range(10)]
        try:
            done = subprocess.run([*command, "-c", ROOTLESS.replace("REPO", str(REPO))], cwd=home,
                                  capture_output=True, text=True, timeout=60, check=False)
        finally:
            for sleeper in sleepers:
                sleeper.kill()
                sleeper.wait()
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout) == {"uid": 65534, "inside": "1000\n", "disk": "2048\n", "memfd": "1\n",
                                           "forks": "ok\n", "graded": "/grader\n", "mounts": "0\n"}
    finally:
        shutil.rmtree(home, ignore_errors=True)
