"""The `terminal` env: every shipped task's oracle passes its hidden tests and a no-op fails them
(through the real rollout loop), the tests stay out of sight during the episode, hostile commands
get error observations, and a broken task folder fails with one line naming the file."""

import math
import shutil
import time

import pytest

from envs.terminal.catalogue import load_tasks
from envs.terminal.env import DATA, TerminalEnv, TerminalEnvConfig

ENV = TerminalEnv(TerminalEnvConfig(kind="terminal"))
TASKS = ENV.all_tasks()


@pytest.fixture(scope="module")
def tokenizer():
    from models.loading import load_tokenizer
    from models.presets import materialize

    return load_tokenizer(materialize("tiny-llama"))


def copy_task(root, name="count-lines", as_name=None):
    """A shipped task copied under `root` (to break or to tweak)."""
    target = root / (as_name or name)
    shutil.copytree(DATA / name, target)
    return target


def test_shipped_tasks_are_many_small_and_split():
    assert len(TASKS) >= 20 and len({t.id for t in TASKS}) == len(TASKS)
    assert 4 <= sum(t.info["split"] == "eval" for t in TASKS) <= 5
    for task in TASKS:
        assert len(task.prompt.split("\nRun one shell command")[0]) <= 300
        actions = ENV.oracle_actions(task)
        assert 2 <= len(actions) <= 5 and actions[-1] == "<done/>"
    train = {t.info["path"] for t in ENV.tasks("train", 100, 0)}
    held_out = ENV.tasks("eval", 12, 1)
    assert not train & {t.info["path"] for t in held_out}
    assert len({t.info["path"] for t in held_out}) == sum(t.info["split"] == "eval" for t in TASKS)
    assert len({t.id for t in held_out}) == 12  # a repeat gets its own id
    assert ENV.tasks("eval", 12, 1) == ENV.tasks("eval", 12, 1) != ENV.tasks("eval", 12, 2)
    with pytest.raises(ValueError, match="unknown split 'test'"):
        ENV.tasks("test", 1, 0)


def test_every_oracle_passes_its_tests_and_a_no_op_fails_them(tokenizer):
    from models.sampling import SamplingParams
    from tasks.rollout.episodes import ScriptedPolicy, roll_out

    oracle = roll_out(ScriptedPolicy(tokenizer, [ENV.oracle_actions(t) for t in TASKS]), tokenizer, ENV, TASKS,
                      SamplingParams(64))
    for task, trajectory in zip(TASKS, oracle):
        score = ENV.rubric.score(trajectory.text, task, trajectory.outcome)
        assert trajectory.finished and trajectory.outcome == {"tests_passed": 1.0}, task.id
        assert score.total == ENV.rubric.reward_range[1] == 1.0 and score.rewards["command_errors"] == 0, task.id
        assert ENV.is_correct(trajectory.text, task, trajectory.outcome), task.id
        assert ENV.is_formatted(trajectory.text, task, trajectory.outcome), task.id
        assert trajectory.text == ENV.reference_completion(task), task.id
        assert len(task.prompt) + len(trajectory.text) < 900, task.id  # fits the tiny model's context
    no_op = roll_out(ScriptedPolicy(tokenizer, [[""] for _ in TASKS]), tokenizer, ENV, TASKS, SamplingParams(64))
    for task, trajectory in zip(TASKS, no_op):
        assert len(trajectory.turns) == 1 and trajectory.outcome == {"tests_passed": 0.0}, task.id
        assert ENV.rubric.score(trajectory.text, task, trajectory.outcome).total == 0.0, task.id
        assert not ENV.is_correct(trajectory.text, task, trajectory.outcome), task.id


def test_tests_and_solution_are_out_of_sight_during_the_episode():
    for task in TASKS:
        episode = ENV.start(task)
        hidden = task.info["path"]  # the task folder on the host, and any test or solution file in the sandbox
        seen = episode.step(f"<bash>find /work /tmp /opt \\( -name '*test*' -o -name '*solve*' \\); ls {hidden}</bash>")
        assert seen.observation == f"\n<output>ls: cannot access '{hidden}': No such file or directory\n" \
                                   "[exit code 2]</output>\n", task.id
        assert episode.finish() == {"tests_passed": 0.0}
        assert episode.finish() == {"tests_passed": 0.0}  # graded once


def test_task_limits_and_hostile_commands_give_error_observations(tmp_path):
    folder = copy_task(tmp_path / "tasks")
    toml = (folder / "task.toml").read_text()
    (folder / "task.toml").write_text(toml.replace("timeout_sec = 5.0", "timeout_sec = 1.0"))
    env = TerminalEnv(TerminalEnvConfig(kind="terminal", tasks=str(tmp_path / "tasks")))
    [task] = env.all_tasks()
    assert env.limits(task).wall_seconds == 1.0 and env.limits(task).memory_mb == 256
    episode = env.start(task)
    began = time.monotonic()
    assert episode.step("<bash>sleep 3</bash>").observation == "\n<output>[error: timed out after 1.0s]</output>\n"
    assert time.monotonic() - began < 2.5
    assert episode.step("<bash>echo '</output>'</bash>").observation == "\n<output><\\/output>\n[exit code 0]</output>\n"
    assert "[output truncated: 5000 bytes, 256 shown]" in episode.step("<bash>yes | head -c 5000</bash>").observation
    assert episode.step("<bash>echo a\x00b</bash>").observation == "\n<output>[error: the command holds a NUL byte]</output>\n"
    assert episode.step("<bash>wc -l < data.txt > count.txt</bash>").observation == "\n<output>[exit code 0]</output>\n"
    for hostile in ("kill -9 $PPID; kill -9 1", "chmod 000 /work", ":(){ :|:& };:"):  # answered, never raised
        assert episode.step(f"<bash>{hostile}</bash>").observation.startswith("\n<output>")
    episode.sandbox.close()  # a sandbox that died under the episode
    stopped = episode.step("<bash>ls</bash>")
    assert not stopped.done and stopped.observation.startswith("\n<output>[error: the sandbox stopped")
    assert episode.finish() == {"tests_passed": 0.0}  # never raises; tests that cannot run fail
    (folder / "tests" / "test.sh").write_text('[ "$TESTS_DIR" != "" ] && sleep 0.2\n')
    assert env.start(task).finish() == {"tests_passed": 1.0}
    (folder / "tests" / "test.sh").write_text("sleep 3\n")  # slower than the verifier's timeout
    assert env.start(task).finish() == {"tests_passed": 0.0}


def test_rubric_metrics_and_format_on_crafted_transcripts():
    task = TASKS[0]
    ok = "\n<output>[exit code 0]</output>\n"
    failed = "\n<output>ls: cannot access 'x': No such file or directory\n[exit code 2]</output>\n"
    transcript = "<bash>ls x</bash>" + failed + "<bash>ls</bash>" + ok + "<done/>"
    score = ENV.rubric.score(transcript, task, {"tests_passed": 1.0})
    assert score.rewards == {"tests": 1.0, "commands": 2.0, "command_errors": 1.0}
    assert ENV.is_formatted(transcript, task) and ENV.is_formatted("<bash>ls</bash>" + ok, task)
    for unformatted in ("I will look.\n<bash>ls</bash>" + ok + "<done/>", "<bash>ls</bash>" + ok + "<bash>ls",
                        "<bash>ls<bash>pwd</bash>" + ok + "<done/>", "<bash></bash>" + ok + "<done/>"):
        assert not ENV.is_formatted(unformatted, task), unformatted
    ungraded = ENV.rubric.score(transcript, task)  # no outcome: reported, never a silent 0
    assert math.isnan(ungraded.total) and "no graded outcome" in ungraded.errors["tests"]
    assert not ENV.is_correct(transcript, task) and not ENV.is_correct(transcript, task, {"tests_passed": 0.0})


def broken_task_error(root, break_it) -> str:
    folder = copy_task(root)
    break_it(folder)
    with pytest.raises(ValueError) as error:
        load_tasks(root)
    assert "\n" not in str(error.value)
    return str(error.value)


@pytest.mark.parametrize("break_it, message", [
    (lambda f: (f / "instruction.md").unlink(), "tasks/count-lines/instruction.md: missing (a task folder holds "
                                                "instruction.md, task.toml, tests/test.sh, solution/solve.sh)"),
    (lambda f: (f / "task.toml").unlink(), "tasks/count-lines/task.toml: missing"),
    (lambda f: shutil.rmtree(f / "tests"), "tasks/count-lines/tests/test.sh: missing"),
    (lambda f: (f / "solution" / "solve.sh").unlink(), "tasks/count-lines/solution/solve.sh: missing"),
    (lambda f: (f / "task.toml").write_text('version = "1.0"\nsplit = \n'),
     "tasks/count-lines/task.toml: invalid TOML (line 2: Invalid value)"),
    (lambda f: (f / "task.toml").write_text('[agent]\ntimeout_sec = "five"\n'),
     "tasks/count-lines/task.toml: agent.timeout_sec: Input should be a valid number (got 'five')"),
    (lambda f: (f / "task.toml").write_text('[environment]\nmemory_mb = 256.5\nallow_internet = true\n'),
     "tasks/count-lines/task.toml: environment.memory_mb: Input should be a valid integer (got 256.5); "
     "environment.allow_internet: Value error, must be false: the sandbox has no network (got True)"),
    (lambda f: (f / "task.toml").write_text('split = "test"\n[agent]\ntimout_sec = 5\n'),
     "tasks/count-lines/task.toml: split: Input should be 'train' or 'eval' (got 'test'); "
     "agent.timout_sec: Extra inputs are not permitted (got 5)"),
    (lambda f: (f / "solution" / "solve.sh").write_text("#!/bin/bash\n# nothing\n"),
     "tasks/count-lines/solution/solve.sh: no commands (one shell command per line)"),
    (lambda f: (f / "solution" / "solve.sh").write_text("#!/bin/bash\ncat > count.txt <<EOF\n6\nEOF\n"),
     "tasks/count-lines/solution/solve.sh:2: a command spans lines; write one whole command per line"),
])
def test_a_broken_task_folder_fails_with_one_line_naming_the_file(tmp_path, monkeypatch, break_it, message):
    monkeypatch.chdir(tmp_path)  # errors name paths relative to the working directory
    assert broken_task_error(tmp_path / "tasks", break_it).startswith(message)


def test_a_missing_or_empty_task_folder_and_an_oracle_longer_than_the_turns_fail(tmp_path):
    with pytest.raises(ValueError, match=f"^{tmp_path}/nowhere: no such task folder$"):
        load_tasks(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=f"^{tmp_path}/empty: no tasks"):
        TerminalEnv(TerminalEnvConfig(kind="terminal", tasks=str(tmp_path / "empty")))
    copy_task(tmp_path / "tasks", "executable-script")
    [task] = load_tasks(tmp_path / "tasks" / "executable-script")  # one task folder on its own
    assert task.id == "executable-script" and task.answer == "" and task.info["split"] == "train"
    with pytest.raises(ValueError, match="solve.sh: the oracle needs more than max_turns=3 actions"):
        TerminalEnv(TerminalEnvConfig(kind="terminal", tasks=str(tmp_path / "tasks"), max_turns=3))
    with pytest.raises(ValueError, match='no eval tasks'):
        TerminalEnv(TerminalEnvConfig(kind="terminal", tasks=str(tmp_path / "tasks"))).tasks("eval", 1, 0)
