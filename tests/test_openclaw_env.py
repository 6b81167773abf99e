"""The `openclaw` env: every shipped task's oracle through the rollout loop (full reward) and a no-op
(zero), the workspace tools and their containment in the sandbox, and one-line errors for bad data."""

import shutil
from pathlib import Path

import pytest

from envs.openclaw.env import DATA, OpenClawEnv, OpenClawEnvConfig, front_matter
from envs.openclaw.tools import OBSERVATION_CHARS

ENV = OpenClawEnv(OpenClawEnvConfig(kind="openclaw"))
TASK = next(task for task in ENV.all_tasks() if task.id == "edit_debug")
PROMPT_AND_ORACLE_CHARS = 900  # the tiny CPU model's budget (512 positions)


def call(name, **args):
    import json

    return f"<tool>{json.dumps({'name': name, **args})}</tool>"


@pytest.fixture(scope="module")
def tokenizer():
    from models.loading import load_tokenizer
    from models.presets import materialize

    return load_tokenizer(materialize("tiny-llama"))


def test_every_task_oracle_scores_full_reward_and_a_no_op_scores_zero(tokenizer):
    from models.sampling import SamplingParams
    from tasks.rollout.episodes import ScriptedPolicy, roll_out

    tasks = ENV.all_tasks()
    assert len(tasks) >= 15 and {t.info["category"] for t in tasks} >= {"files", "config", "memory", "web", "skills"}
    best = ENV.rubric.reward_range[1]
    oracle = roll_out(ScriptedPolicy(tokenizer, [ENV.oracle_actions(t) for t in tasks]), tokenizer, ENV, tasks,
                      SamplingParams(96))
    for task, trajectory in zip(tasks, oracle):
        score = ENV.rubric.score(trajectory.text, task, trajectory.outcome)
        assert score.total == best == 1.0, (task.id, trajectory.text, trajectory.outcome)
        assert ENV.is_correct(trajectory.text, task, trajectory.outcome)
        assert ENV.is_formatted(trajectory.text, task, trajectory.outcome)
        assert score.rewards["tool_calls"] == len(ENV.oracle_actions(task)) - 1 and score.rewards["tool_errors"] == 0
        assert trajectory.finished and trajectory.text == ENV.reference_completion(task)
        assert len(task.prompt) + len(trajectory.text) <= PROMPT_AND_ORACLE_CHARS, task.id
    no_op = roll_out(ScriptedPolicy(tokenizer, [[""]] * len(tasks)), tokenizer, ENV, tasks, SamplingParams(16))
    for task, trajectory in zip(tasks, no_op):
        assert ENV.rubric.score(trajectory.text, task, trajectory.outcome).total == 0.0, task.id
        assert not ENV.is_correct(trajectory.text, task, trajectory.outcome)


def test_splits_are_disjoint_seeded_and_cycle():
    train, held_out = ENV.tasks("train", 100, 0), ENV.tasks("eval", 3, 1)
    base_id = lambda task: task.id.split("-r")[0]  # a repeat is `<id>-r<pass>`
    assert {base_id(t) for t in train} == {t.id for t in ENV.all_tasks() if t.info["split"] == "train"}
    assert len({t.id for t in train}) == 100
    assert not {base_id(t) for t in train} & {base_id(t) for t in ENV.tasks("eval", 100, 0)}
    assert [t.id for t in held_out] == [t.id for t in ENV.tasks("eval", 3, 1)]
    with pytest.raises(ValueError, match="unknown split"):
        ENV.tasks("test", 1, 0)


def test_skills_are_offered_in_the_prompt_and_readable_in_the_workspace():
    task = next(t for t in ENV.all_tasks() if t.id == "skill_todo")
    assert "todo: manage the TODO.md list" in task.prompt and "report:" not in task.prompt
    episode = ENV.start(TASK)
    try:
        for name in ("report", "todo", "daily-note", "remember"):
            assert f"name: {name}" in episode.step(call("read", path=f"skills/{name}/SKILL.md")).observation
    finally:
        episode.finish()


def test_tools_answer_and_report_errors_without_raising():
    episode = ENV.start(TASK)
    try:
        assert episode.step(call("exec", command="cat config.ini")).observation.startswith("\n<result>name = app")
        assert "found 0" in episode.step(call("edit", path="config.ini", old="nope", new="x")).observation
        assert episode.step(call("write", path="memory/a.md", content="- port is 8080\n")).observation == \
            "\n<result>wrote 15 bytes to memory/a.md</result>\n"
        assert "memory/a.md:1: - port is 8080" in episode.step(call("memory_search", query="port")).observation
        assert "Is a directory" in episode.step(call("write", path="memory", content="x")).observation
        assert "memory_get reads" in episode.step(call("memory_get", path="config.ini")).observation
        assert "Mount Fuji" in episode.step(call("web_search", query="fuji")).observation
        assert "offline" in episode.step(call("web_fetch", url="https://example.com/")).observation
        long = episode.step(call("exec", command="seq 1000; echo '</result>'")).observation
        assert len(long) < OBSERVATION_CHARS + 60 and long.count("</result>") == 1
        for broken in ("<tool>ls</tool>", '<tool>{"name": "rm"}</tool>', '<tool>{"name": "read"}</tool>',
                       '<tool>{"name": "read", "path": 3}</tool>', '<tool>{"name": "exec", "command": "ls"'):
            turn = episode.step(broken)
            assert not turn.done and turn.observation.startswith("\n<result>error: ")
        assert episode.step("All done.").done
    finally:
        outcome = episode.finish()
    assert outcome == {"graded": 0.0, "tool_calls": 9.0, "tool_errors": 4.0, "bad_calls": 5.0, "replied": 1.0}


@pytest.mark.parametrize("path", ["../../etc/openclaw-escape", "/etc/openclaw-escape", "/work/../etc/openclaw-escape"])
def test_file_tools_cannot_leave_the_workspace(path):
    host = Path("/etc/openclaw-escape")
    assert not host.exists()
    episode = ENV.start(TASK)
    try:
        for action in (call("write", path=path, content="x"), call("read", path=path),
                       call("edit", path=path, old="x", new="y")):
            assert episode.step(action).observation.startswith("\n<result>error: path outside the workspace")
        episode.step(call("exec", command="echo x > /etc/openclaw-escape; echo x > ../../etc/openclaw-escape"))
        assert "root:" not in episode.step(call("read", path="../../etc/passwd")).observation
    finally:
        episode.finish()
    assert not host.exists()


def test_front_matter_values_are_json_or_plain_strings():
    fields, body = front_matter('---\nid: a b\nn: 60\nargs: {"k": [1]}\ntext: "x: y"\n---\nbody\n', Path("t.md"))
    assert fields == {"id": "a b", "n": "60", "args": {"k": [1]}, "text": "x: y"} and body == "body\n"


def edit(root: Path, relative: str, old: str, new: str) -> None:
    path = root / relative
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new))


BAD_DATA = [
    ("tasks/write_hello.md", "---\nid:", "id:", "write_hello.md: no front matter"),
    ("tasks/write_hello.md", "split: train", "split train", r"write_hello.md:6: not a new `key: value` line"),
    ("tasks/write_hello.md", 'grader_args: {"path"', "grader_args: {path", "write_hello.md:8: grader_args is not"),
    ("tasks/write_hello.md", "grader: file_equals", "grader: file_is", "write_hello.md: unknown grader 'file_is'"),
    ("tasks/write_hello.md", '"text": "hello world"', '"txt": "hello world"', "write_hello.md: grader file_equals:"),
    ("tasks/count_lines.md", '["data.csv"]', '["data2.csv"]', "count_lines.md: workspace file 'data2.csv' is not in"),
    ("tasks/count_lines.md", '["data.csv"]', '["../x"]', "count_lines.md: path outside the workspace"),
    ("tasks/skill_todo.md", '["todo"]', '["tdo"]', "skill_todo.md: skills must be"),
    ("tasks/write_hello.md", "## Oracle\n", "## Solution\n", "write_hello.md: the body is the prompt"),
    ("tasks/write_hello.md", '"name":"write"', '"name":"save"', "write_hello.md: bad oracle action"),
    ("tasks/write_hello.md", "id: write_hello", "id: hello", "write_hello.md: id 'hello' is not the file's name"),
    ("skills/todo/SKILL.md", "name: todo\n", "", "todo/SKILL.md: front matter needs exactly a non-empty `name`"),
    ("skills/todo/SKILL.md", "name: todo\n", "name: todos\n", "todo/SKILL.md: name 'todos' is not the folder's"),
    ("web.json", '"title": "Nile", ', "", "web.json: not a web fixture"),
]


@pytest.mark.parametrize("relative,old,new,message", BAD_DATA)
def test_bad_data_raises_one_line_naming_the_file(tmp_path, relative, old, new, message):
    root = tmp_path / "openclaw"
    shutil.copytree(DATA, root)
    edit(root, relative, old, new)
    with pytest.raises(ValueError, match=message) as error:
        OpenClawEnv(OpenClawEnvConfig(kind="openclaw", tasks=str(root)))
    assert "\n" not in str(error.value) and str(root) in str(error.value)


def test_a_skill_folder_without_skill_md_is_an_error(tmp_path):
    root = tmp_path / "openclaw"
    shutil.copytree(DATA, root)
    (root / "skills" / "todo" / "SKILL.md").rename(root / "skills" / "todo" / "skill.txt")
    with pytest.raises(ValueError, match=r"todo/SKILL.md: missing"):
        OpenClawEnv(OpenClawEnvConfig(kind="openclaw", tasks=str(root)))
