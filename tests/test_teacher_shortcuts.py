"""Teachers with fixable flaws (envs/shortcuts.py) in the agentic envs: on about
`teacher_shortcut_rate` of the tasks, fixed per task, the synthesize stage's oracle teacher takes
its family's shortcut, which played through a real episode (sandbox included) keeps the env's
format and fails its check; the other tasks get the oracle; the splits do not move, and the env's
oracle check still passes on the tasks whose teacher takes the shortcut."""

import pytest
from test_spec_errors import GOOD, run_cli, write_spec
from test_tool_calls import tokenizer_with

from envs.openclaw.env import OpenClawEnv, OpenClawEnvConfig
from envs.rlm import RlmEnv, RlmEnvConfig
from envs.search.env import SearchEnv, SearchEnvConfig
from envs.terminal.env import TerminalEnv, TerminalEnvConfig
from tasks.rollout.env_check import check_env, scripted_rollouts
from tasks.stages.synthesize import multi_turn_rows

RATE = 0.4


def make(kind: str, rate: float, **fields):
    if kind == "terminal":
        return TerminalEnv(TerminalEnvConfig(kind=kind, generated={"train": 30, "eval": 2},
                                             teacher_shortcut_rate=rate))
    if kind == "openclaw":
        return OpenClawEnv(OpenClawEnvConfig(kind=kind, generated={"train": 40, "eval": 2},
                                             teacher_shortcut_rate=rate, **fields))
    if kind == "search":
        return SearchEnv(SearchEnvConfig(kind=kind, teacher_shortcut_rate=rate))
    return RlmEnv(RlmEnvConfig(kind=kind, context_chars=1000, tasks=320, teacher_shortcut_rate=rate))


KINDS = ["terminal", "openclaw", "search", "rlm"]
SHORTCUT_FAMILIES = {  # the families whose teacher has a shortcut (the others keep the oracle)
    "terminal": {"count-files", "count-lines", "count-matches", "find-max", "fix-script", "find-file",
                 "rename-extension", "extract-column", "dedupe"},
    "openclaw": {"edit-config", "recall-memory", "read-field", "count-lines", "remember", "move-file"},
}


@pytest.fixture(scope="module")
def tokenizer():
    from models.loading import load_tokenizer
    from models.presets import materialize

    return load_tokenizer(materialize("tiny-llama"))


def family(task) -> str:
    return task.info["family"] if "family" in task.info else task.info["relation"]  # search: by relation


def train_pool(env) -> list:
    return env.split_tasks("train") if isinstance(env, SearchEnv) else [
        task for task in env.all_tasks() if task.info["split"] == "train"]


def one_per_family(env, tasks) -> list:
    """The first task of each family that takes its shortcut."""
    chosen = {}
    for task in tasks:
        if env.teacher_actions(task) != env.oracle_actions(task):
            chosen.setdefault(family(task), task)
    return list(chosen.values())


@pytest.mark.parametrize("kind", KINDS)
def test_the_share_is_about_the_rate_fixed_per_task_and_the_rest_is_the_oracle(kind):
    env, again, plain = make(kind, RATE), make(kind, RATE), make(kind, 0.0)
    tasks = train_pool(env)
    flawed = [task for task in tasks if env.shortcut_actions(task) is not None]
    took = [task for task in flawed if env.teacher_actions(task) != env.oracle_actions(task)]
    assert len(flawed) >= 200 and RATE - 0.08 < len(took) / len(flawed) < RATE + 0.08
    assert all(env.teacher_actions(task) == env.shortcut_actions(task) for task in took)
    assert [again.teacher_actions(task) for task in tasks] == [env.teacher_actions(task) for task in tasks]
    assert all(env.teacher_actions(task) == env.oracle_actions(task) for task in tasks if task not in took)
    assert all(plain.teacher_actions(task) == plain.oracle_actions(task) for task in tasks)
    if kind in SHORTCUT_FAMILIES:  # exactly the families named in docs/AGENTIC.md
        assert {family(task) for task in flawed} == SHORTCUT_FAMILIES[kind]
    else:  # every search question, every rlm family has one
        assert len(flawed) == len(tasks)
    assert all(make(kind, 1.0).teacher_actions(task) == env.shortcut_actions(task) for task in flawed[:20])


@pytest.mark.parametrize("kind", KINDS)
def test_the_held_out_split_is_disjoint_and_unchanged_by_the_flaw(kind):
    env, plain = make(kind, RATE), make(kind, 0.0)
    held_out = [task.id for task in plain.tasks("eval", 20, 3)]
    assert [task.id for task in env.tasks("eval", 20, 3)] == held_out
    assert [task.id for task in env.tasks("train", 50, 3)] == [task.id for task in plain.tasks("train", 50, 3)]
    assert [task.id for task in env.all_tasks()] == [task.id for task in plain.all_tasks()]
    assert not {task.id for task in train_pool(env)} & set(held_out)


@pytest.mark.parametrize("kind", KINDS)
def test_a_shortcut_played_through_a_real_episode_keeps_the_format_and_fails_the_check(kind, tokenizer):
    env = make(kind, RATE)
    tasks = one_per_family(env, train_pool(env))
    if kind in SHORTCUT_FAMILIES:
        assert {family(task) for task in tasks} == SHORTCUT_FAMILIES[kind]
    elif kind == "search":  # both of its shortcuts: one-hop and two-hop questions
        assert {task.info["hops"] for task in tasks} == {1, 2}
    else:  # every rlm family has one
        assert len(tasks) == 8
    trajectories = scripted_rollouts(env, tokenizer, tasks, [env.teacher_actions(task) for task in tasks])
    failed = [not env.is_correct(t.text, t.task, t.outcome) for t in trajectories]
    assert all(failed), [t.task.id for t, fail in zip(trajectories, failed) if not fail]
    assert all(env.is_formatted(t.text, t.task, t.outcome) for t in trajectories)  # the right move's format


@pytest.mark.parametrize("kind", KINDS)
def test_the_oracle_check_still_passes_on_the_tasks_whose_teacher_takes_the_shortcut(kind, tokenizer):
    env = make(kind, RATE)
    tasks = one_per_family(env, train_pool(env))[:3]
    assert len(tasks) == 3
    rows = check_env(env, tokenizer, tasks)
    assert all(row.ok for row in rows), [row for row in rows if not row.ok]


def test_the_synthesize_stage_writes_the_shortcut_traces_and_counts_them_unsolved(tokenizer):
    env = make("terminal", 1.0)
    fix, find, plain = (next(task for task in train_pool(env) if family(task) == name)
                        for name in ("fix-script", "find-file", "sort-lines"))
    rows, solved = multi_turn_rows(env, "term", [fix, find, plain], tokenizer)
    assert solved == 1  # the synthesize stage's teacher_accuracy: only the oracle's episode passed
    completions = [row["completion"] for row in rows]
    assert "cat " not in completions[0] and "sed -i" in completions[0]  # edits without reading
    assert "find " not in completions[1] and "cp " in completions[1]


def test_the_native_tool_format_teacher_calls_in_the_models_format_and_fails():
    env, tokenizer = make("openclaw", 1.0, tool_format="native"), tokenizer_with("qwen3")
    env.use_chat(tokenizer)
    tasks = [task for task in train_pool(env)[:40] if family(task) in ("edit-config", "move-file")][:2]
    scripts = [env.teacher_actions(task) for task in tasks]
    assert all(script[0].startswith("<tool_call>") and "<tool>" not in "".join(script) for script in scripts)
    trajectories = scripted_rollouts(env, tokenizer, tasks, scripts)
    assert not any(env.is_correct(t.text, t.task, t.outcome) for t in trajectories)


@pytest.mark.parametrize("kind, rate, message", [
    ("terminal", 1.5, "envs.box.teacher_shortcut_rate: Input should be less than or equal to 1"),
    ("openclaw", -0.1, "envs.box.teacher_shortcut_rate: Input should be greater than or equal to 0"),
    ("search", "often", "envs.box.teacher_shortcut_rate: Input should be a valid number"),
    ("rlm", 2, "envs.box.teacher_shortcut_rate: Input should be less than or equal to 1"),
])
def test_a_bad_shortcut_rate_is_one_line_naming_the_field(kind, rate, message, tmp_path, capsys):
    spec = {**GOOD, "envs": {**GOOD["envs"], "box": {"kind": kind, "teacher_shortcut_rate": rate}}}
    code, err = run_cli(capsys, "validate", write_spec(tmp_path, spec))
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
