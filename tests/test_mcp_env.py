"""The `mcp` env on the official SDK against real servers: the example notes server over stdio (per
episode and shared with a reset tool), over streamable HTTP on 127.0.0.1, and in the bwrap sandbox;
servers that crash, hang or never start end their episode as an error, counted, and the rollout
goes on; bad configs are one line naming the field."""

import json
import math
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import mcp  # noqa: E402,F401  (the dev extra installs the SDK: missing, these fail, never skip)
import pytest
from test_spec_errors import run_cli, write_spec
from test_tool_calls import tokenizer_with

from envs.loader import ENV_CONFIG, make_env
from envs.tools import ToolCall
from flows.cli.main import main
from models.sampling import SamplingParams
from tasks.rollout.env_check import check_env
from tasks.rollout.episodes import ScriptedPolicy, roll_out

ROOT = Path(__file__).resolve().parents[1]
SERVER = str(ROOT / "examples" / "mcp_notes_server.py")
TASKS = ROOT / "examples" / "mcp_tasks.jsonl"
TOKENIZER = tokenizer_with("qwen3")
BAD_SERVER = '''
import os, time
from mcp.server.mcpserver import MCPServer

server = MCPServer("bad", log_level="WARNING")


@server.tool()
def crash() -> str:
    """Exit at once, mid-call."""
    os._exit(3)


@server.tool()
def hang() -> str:
    """Never answer."""
    time.sleep(600)
    return "late"


@server.tool()
def where() -> str:
    """Where the server runs and what it can see."""
    return f"{os.getcwd()} {os.path.exists('SECRET')} {os.getuid()}"


server.run("stdio")
'''


def about_seed_notes(row: dict) -> bool:
    """A row about one of the server's twelve seed notes (not the `--codes` notes the pipeline adds)."""
    [argument] = row["oracle_calls"][0]["arguments"].values()
    return not argument.isdigit() and " code is " not in row["answer"]


def rows(n: int | None = None) -> list[dict]:
    """The example's rows about the seed notes (a server started without `--codes` holds those)."""
    lines = [line for line in TASKS.read_text().splitlines() if about_seed_notes(json.loads(line))][:n]
    return [{"id": f"row-{i}", **json.loads(line)} for i, line in enumerate(lines)]


def mcp_env(server: dict, tasks: list[dict] | None = None, **fields):
    config = ENV_CONFIG.validate_python({"kind": "mcp", "source": str(TASKS), "server": server, **fields})
    env = make_env("notes", config)
    env.use_rows(rows(8) if tasks is None else tasks)
    env.use_chat(TOKENIZER)
    return env


def play(env, tasks, scripts):
    return roll_out(ScriptedPolicy(TOKENIZER, scripts), TOKENIZER, env, tasks, SamplingParams(256))


def call(env, name: str, **arguments) -> str:
    return env.chat.action([ToolCall(name, arguments, "call_0")])


def assert_oracle_passes(env, tasks):
    checks = check_env(env, TOKENIZER, tasks)
    assert [check.task_id for check in checks if not check.ok] == [], checks


def test_mcp_env_over_stdio_plays_the_oracle_with_a_fresh_server_per_episode():
    env = mcp_env({"command": [sys.executable, SERVER]}, eval_fraction=0.0)
    tasks = env.all_tasks()
    assert [tool["function"]["name"] for tool in tasks[0].info["tools"]] == [
        "list_notes", "read_note", "search_notes", "add_note", "delete_note", "notes_count", "reset"]
    assert_oracle_passes(env, tasks[:3])
    assert env.servers.opened == 1 + 2 * 3  # the tool list, then each oracle and no-op episode its own
    [trajectory] = play(env, tasks[:1], [[call(env, "read_note", title="nope"), call(env, "read_note"), "?"]])
    assert trajectory.outcome["tool_errors"] == 2 and trajectory.outcome["valid_call_rate"] == 1.0
    assert trajectory.outcome["turns"] == 3 and trajectory.outcome["server_error"] == 0
    assert "no note titled 'nope'" in trajectory.text and "missing required argument(s) title" in trajectory.text


def test_mcp_env_shared_server_is_reset_between_episodes_and_reused():
    read_wifi = [{"id": "row-0", "prompt": "What does my note 'wifi' say?",
                  "answer": "The guest wifi password is maple-42.",
                  "oracle_calls": [{"name": "read_note", "arguments": {"title": "wifi"}}]}]

    def delete_then_read(env):
        [deleted] = play(env, env.all_tasks(), [[call(env, "delete_note", title="wifi"), "ok"]])
        assert "deleted wifi" in deleted.text
        [read] = play(env, env.all_tasks(), [[call(env, "read_note", title="wifi"), "ok"]])
        return read.text

    reset = mcp_env({"command": ["python", SERVER], "lifetime": "shared"}, read_wifi, reset_tool="reset",
                    eval_fraction=0.0)
    assert "maple-42" in delete_then_read(reset) and reset.servers.opened == 1  # one server, its seed notes back
    assert "reset" not in [tool["function"]["name"] for tool in reset.all_tasks()[0].info["tools"]]
    kept = mcp_env({"command": ["python", SERVER], "lifetime": "shared"}, read_wifi, eval_fraction=0.0)
    assert "no note titled 'wifi'" in delete_then_read(kept)  # no reset tool: the state carries over
    reset.servers.close_all()
    kept.servers.close_all()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def http_server():
    port = free_port()
    process = subprocess.Popen([sys.executable, SERVER, "--http", str(port)], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    yield f"http://127.0.0.1:{port}/mcp"
    process.terminate()
    process.wait(10)


def test_mcp_env_over_streamable_http_plays_the_oracle_on_a_session_per_episode(http_server):
    env = mcp_env({"url": http_server}, tools=["read_note", "search_notes"], eval_fraction=0.0)
    tasks = env.all_tasks()
    assert [tool["function"]["name"] for tool in tasks[0].info["tools"]] == ["read_note", "search_notes"]
    assert_oracle_passes(env, tasks[:4])
    [trajectory] = play(env, tasks[:1], [[call(env, "delete_note", title="wifi"), "?"]])
    assert "unknown tool 'delete_note'; tools: read_note, search_notes" in trajectory.text  # not shown, not run


@pytest.fixture
def bad_server(tmp_path) -> list[str]:
    script, secret = tmp_path / "bad_server.py", tmp_path / "secret.txt"
    script.write_text(BAD_SERVER.replace("SECRET", str(secret)))
    secret.write_text("host only")
    return [sys.executable, str(script)]


@pytest.mark.parametrize("tool, seconds", [("crash", 15), ("hang", 15)])
def test_mcp_server_that_crashes_or_hangs_mid_episode_ends_it_as_an_error_counted(bad_server, tool, seconds):
    env = mcp_env({"command": bad_server}, call_seconds=2)
    tasks = env.tasks("train", 2, 0)
    started = time.monotonic()
    failed, answered = play(env, tasks, [[call(env, tool), "never read"], [call(env, "where"), "x"]])
    assert time.monotonic() - started < seconds
    assert failed.outcome["server_error"] == 1.0 and failed.finished and len(failed.turns) == 1
    score = env.rubric.score(failed.text, failed.task, failed.outcome)
    assert math.isnan(score.total) and not env.is_correct(failed.text, failed.task, failed.outcome)
    assert answered.outcome["server_error"] == 0.0 and answered.outcome["tool_calls"] == 1.0  # the rollout went on


def test_mcp_server_that_never_starts_ends_each_episode_as_an_error():
    env = mcp_env({"command": [sys.executable, "-c", "import sys; sys.exit('no server here')"]}, connect_seconds=20)
    env.schemas = []  # its tool list could not be read either: the tasks are drawn without tools
    trajectories = play(env, env.tasks("train", 3, 0), [["hello"]] * 3)
    assert [t.outcome["server_error"] for t in trajectories] == [1.0, 1.0, 1.0]


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_mcp_env_stdio_server_in_the_sandbox_sees_no_host_file(bad_server):
    env = mcp_env({"command": bad_server, "sandbox": True})
    [trajectory] = play(env, env.tasks("train", 1, 0), [[call(env, "where"), "x"]])
    assert trajectory.outcome["server_error"] == 0.0, trajectory.text
    assert "/work False 1000" in trajectory.text  # its own /work, the host's file not there, the sandbox's uid
    notes = mcp_env({"command": [sys.executable, SERVER], "sandbox": True}, eval_fraction=0.0)
    assert_oracle_passes(notes, notes.all_tasks()[:2])


@pytest.mark.parametrize("fields, message", [
    ({"server": {"command": []}}, "server.stdio.command: List should have at least 1 item"),
    ({"server": {"cmd": ["x"]}}, "server: a server is a `command:` list (stdio) or a `url:` (streamable HTTP)"),
    ({"server": {"url": "ftp://x"}}, "server.http.url: String should match pattern"),
    ({"server": {"command": ["x"], "lifetime": "forever"}},
     "server.stdio.lifetime: Input should be 'episode' or 'shared'"),
    ({"check": {"answer": "fuzzy"}}, "check.answer.answer: Input should be 'exact' or 'normalized'"),
    ({"check": {"grader": "notes_count"}, "tools": ["notes_count"]},
     "tools: notes_count is the reset or grader tool, which the model is not shown"),
])
def test_mcp_config_errors_name_the_field(fields, message, tmp_path, capsys):
    spec = {"name": "t", "store": "file://STORE",
            "envs": {"notes": {"kind": "mcp", "source": str(TASKS), "server": {"command": ["python", SERVER]},
                               **fields}},
            "stages": [{"id": "traces", "kind": "synthesize", "env": "notes", "n": 2}]}
    code, err = run_cli(capsys, "validate", write_spec(tmp_path, spec))
    assert code == 2 and err.startswith(f"error: envs.notes.{message}") and len(err.splitlines()) == 1, err


def test_mcp_envs_check_plays_the_oracle_on_the_spec_rows(tmp_path, capsys):
    spec = {"name": "t", "store": "file://STORE",
            "envs": {"notes": {"kind": "mcp", "source": str(TASKS), "limit": 3, "tool_format": "hermes",
                               "server": {"command": ["python", SERVER, "--codes", "100"], "lifetime": "shared"},
                               "reset_tool": "reset"}},
            "stages": [{"id": "traces", "kind": "synthesize", "env": "notes", "n": 2}]}
    code = main(["envs", "check", "notes", "--spec", write_spec(tmp_path, spec)])
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert code == 0 and "notes: 3/3 tasks hold (oracle = full reward 1.1, no-op = 0)" in out, out


def test_mcp_grader_tool_checks_the_server_state_after_the_episode():
    add = [{"id": "row-0", "prompt": "Save a note 'milk' saying 'buy milk'.", "answer": "13",
            "oracle_calls": [{"name": "add_note", "arguments": {"title": "milk", "text": "buy milk"}}]}]
    env = mcp_env({"command": [sys.executable, SERVER]}, add, check={"grader": "notes_count"}, eval_fraction=0.0)
    assert "notes_count" not in [tool["function"]["name"] for tool in env.all_tasks()[0].info["tools"]]
    assert_oracle_passes(env, env.all_tasks())  # 12 seed notes + the one saved: the grader reads 13
    [said_only] = play(env, env.all_tasks(), [["I saved it."]])
    assert said_only.outcome["correct"] == 0.0  # a claim without the call leaves the state as it was


def test_mcp_teacher_shortcut_answers_at_once_on_a_fixed_share_and_envs_check_plays_the_oracle():
    tasks = rows()
    env = mcp_env({"command": [sys.executable, SERVER], "lifetime": "shared"}, tasks, reset_tool="reset",
                  eval_fraction=0.0, teacher_shortcut_rate=0.4)
    every = env.all_tasks()
    shortcut = [task for task in every if env.teacher_actions(task) == [task.info["columns"]["shortcut"]]]
    assert 0.25 < len(shortcut) / len(every) < 0.55  # the share, drawn per task
    again = make_env("notes", env.config)
    again.use_rows(tasks)
    again.use_chat(TOKENIZER)
    assert [again.teacher_actions(task) for task in every] == [env.teacher_actions(task) for task in every]
    right = next(task for task in every if task not in shortcut)
    assert env.teacher_actions(right) == env.oracle_actions(right)
    [took_it] = play(env, shortcut[:1], [env.teacher_actions(shortcut[0])])
    assert took_it.outcome["correct"] == 0.0 and took_it.outcome["tool_calls"] == 0
    assert_oracle_passes(env, shortcut[:2])  # the env's checks play the oracle, never the shortcut
    no_shortcut = {key: value for key, value in tasks[0].items() if key != "shortcut"}
    env.use_rows([no_shortcut])
    assert env.teacher_actions(env.all_tasks()[0]) == env.oracle_actions(env.all_tasks()[0])
