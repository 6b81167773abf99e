"""The `rlm` env: the long `context` in a sandboxed REPL, code cells, llm_query sub-calls through the
episode's own model, FINAL / FINAL_VAR answers graded when the episode finishes; its oracle on every
task of a small catalogue through tasks/rollout/episodes.py."""

import math

import pytest
from pydantic import ValidationError

from envs.rlm import FAMILIES, RlmEnv, RlmEnvConfig, normalize
from envs.sandbox import SandboxLimits, SandboxUnavailable

ENV = RlmEnv(RlmEnvConfig(kind="rlm", tasks=40))
TASKS = ENV.all_tasks()


def task_of(family: str):
    return next(t for t in TASKS if t.info["family"] == family)


def play(task, actions, llm=None, env=ENV):
    """The observations of an episode (None for the turn that ended it) and its outcome."""
    episode, observations = env.start(task, llm), []
    try:
        for action in actions:
            turn = episode.step(action)
            observations.append(None if turn.done else turn.observation)
            if turn.done:
                break
    finally:
        outcome = episode.finish()
    return observations, outcome


@pytest.fixture(scope="module")
def tokenizer():
    from models.loading import load_tokenizer
    from models.presets import materialize

    return load_tokenizer(materialize("tiny-llama"))


def roll(tokenizer, scripts, tasks, respond=lambda prompt: ""):
    from models.sampling import SamplingParams
    from tasks.rollout.episodes import ScriptedPolicy, roll_out

    return roll_out(ScriptedPolicy(tokenizer, scripts, respond=respond), tokenizer, ENV, tasks, SamplingParams(256))


def test_the_oracle_scores_full_reward_and_a_no_op_zero_on_every_task(tokenizer):
    assert {t.info["family"] for t in TASKS} == set(FAMILIES)
    trajectories = roll(tokenizer, [ENV.oracle_actions(t) for t in TASKS], TASKS, respond=ENV.oracle_llm)
    for task, trajectory in zip(TASKS, trajectories):
        score = ENV.rubric.score(trajectory.text, task, trajectory.outcome)
        assert trajectory.finished and len(trajectory.turns) == 2, task.id
        assert score.total == ENV.rubric.reward_range[1] == 1.0, (task.id, trajectory.text)
        assert ENV.is_correct(trajectory.text, task, trajectory.outcome)
        assert ENV.is_formatted(trajectory.text, task, trajectory.outcome)
        assert score.rewards["llm_calls"] == (task.info["family"] == "ask") and score.rewards["cells"] == 1
        assert trajectory.text == ENV.reference_completion(task)
        assert len(task.prompt) + len(trajectory.text) < 900  # the tiny model's window
    no_op = roll(tokenizer, [[""] for _ in TASKS], TASKS)
    for task, trajectory in zip(TASKS, no_op):
        assert len(trajectory.turns) == 1 and trajectory.finished
        assert ENV.rubric.score(trajectory.text, task, trajectory.outcome).total == 0.0
        assert not ENV.is_correct(trajectory.text, task, trajectory.outcome)


def test_llm_query_reaches_the_episodes_model_through_the_rollout(tokenizer):
    tasks, prompts = [t for t in TASKS if t.info["family"] == "ask"], []

    def respond(prompt):
        prompts.append(prompt)
        return "castle"

    trajectories = roll(tokenizer, [ENV.oracle_actions(t) for t in tasks], tasks, respond=respond)
    assert len(prompts) == len(tasks)
    for task, trajectory, prompt in zip(tasks, trajectories, prompts):
        person = task.prompt.split()[2]  # "Where does ann want to meet?"
        assert prompt.startswith(f"Where to meet? Note from {person}:") and len(prompt) < 100
        assert trajectory.text.endswith("<output>castle</output>\nFINAL_VAR(n)")
        assert trajectory.outcome["llm_calls"] == 1
        assert trajectory.outcome["correct"] == (task.answer == "castle")


def test_the_context_never_appears_in_the_prompt():
    for task in TASKS:
        context = ENV.context(task)
        assert 20_000 <= len(context) <= 61_000 and len(task.prompt) < 300
        assert f"{len(context)} chars" in task.prompt
        assert not any(context[i:i + 30] in task.prompt for i in range(0, len(context) - 30, 15))
    assert ENV.context(TASKS[0]) == RlmEnv(RlmEnvConfig(kind="rlm", tasks=40)).context(TASKS[0])  # seeded


def test_final_answers_literally_and_final_var_reads_the_repl():
    task = task_of("lookup")
    assert play(task, [f"FINAL({task.answer})"])[1] == {"correct": 1.0, "answered": 1.0, "llm_calls": 0.0,
                                                      "cells": 0.0}
    assert play(task, [f'FINAL("{task.answer}".)'])[1]["correct"] == 1.0
    observations, outcome = play(task, [f"<repl>x = float({task.answer})</repl>", "FINAL_VAR(x)"])
    assert observations == ["\n<output></output>\n", None] and outcome["correct"] == 1.0
    observations, outcome = play(task, ["<repl>print('FINAL(3)')</repl>", "FINAL_VAR(x)"])
    assert observations == ["\n<output>FINAL(3)</output>\n", None]  # FINAL inside code is code
    assert outcome == {"correct": 0.0, "answered": 0.0, "llm_calls": 0.0, "cells": 1.0}  # x is not defined
    assert play(task, ["FINAL_VAR(__import__('os'))"])[1]["answered"] == 0.0
    assert play(task, [f"FINAL(0) FINAL({task.answer})"])[1]["correct"] == 0.0  # the first answer counts
    assert play(task, ["I give up."])[1] == {"correct": 0.0, "answered": 0.0, "llm_calls": 0.0, "cells": 0.0}
    assert normalize(" 'K7Q2X'. ") == "k7q2x" and normalize("42.0") == normalize("42") == "42"


def test_llm_query_is_limited_per_episode_and_refusals_raise_in_the_cell():
    env = RlmEnv(RlmEnvConfig(kind="rlm", tasks=16, max_llm_calls=2, query_chars=50))
    cell = ("got = []\nfor k in range(3):\n    try:\n        got.append(llm_query(f'q{k}'))\n"
            "    except RuntimeError as exc:\n        got.append(str(exc))\nprint(got)</repl>")
    observations, outcome = play(env.all_tasks()[0], ["<repl>" + cell, "<repl>llm_query('x' * 51)</repl>"],
                                 llm=lambda prompt: f"a:{prompt}", env=env)
    assert observations[0] == "\n<output>['a:q0', 'a:q1', 'llm_query limit reached: 2 calls per episode']</output>\n"
    assert observations[1] == "\n<output>[error: RuntimeError: llm_query prompt too long: 51 chars, at most 50]</output>\n"
    assert outcome["llm_calls"] == 2 and outcome["cells"] == 2
    observations, _ = play(TASKS[0], ["<repl>llm_query('hi')</repl>"])
    assert "[error: RuntimeError: llm_query is not available in this episode]" in observations[0]

    def broken(prompt):
        raise IndexError("position out of range")

    observations, outcome = play(TASKS[0], ["<repl>llm_query('hi')</repl>"], llm=broken)
    assert "llm_query failed: IndexError: position out of range" in observations[0] and outcome["llm_calls"] == 1


def test_a_failing_cell_is_an_error_observation_and_the_episode_goes_on():
    observations, outcome = play(TASKS[0], ["<repl>x = 1\n1/0</repl>", "<repl>print(x + 1)</repl>",
                                            "<repl>print('a' * 1000)</repl>", "FINAL(2)"])
    assert observations[0] == "\n<output>[error: ZeroDivisionError: division by zero]</output>\n"
    assert observations[1] == "\n<output>2</output>\n"
    assert observations[2] == f"\n<output>{'a' * 300}... [truncated]</output>\n"
    assert outcome["cells"] == 3 and outcome["answered"] == 1.0


def test_hostile_cells_end_in_errors_not_exceptions():
    env = RlmEnv(RlmEnvConfig(kind="rlm", tasks=16, sandbox=SandboxLimits(wall_seconds=1)))
    observations, _ = play(env.all_tasks()[0], ["<repl>while True: pass</repl>", "<repl>print(len(context))</repl>"],
                           env=env)
    assert observations[0].startswith("\n<output>[error: ") and "timed out" in observations[0]
    assert observations[1] == f"\n<output>{len(env.context(env.all_tasks()[0]))}</output>\n"
    observations, _ = play(TASKS[0], ["<repl>del context, _rlm_ready\n1/0</repl>", "<repl>print(len(context))</repl>"])
    assert observations[1] == f"\n<output>{len(ENV.context(TASKS[0]))}</output>\n"  # a lost namespace is seeded again
    observations, outcome = play(TASKS[0], ["<repl>import os; os._exit(3)</repl>", "<repl>print(len(context))</repl>"])
    assert outcome["cells"] == len(observations)
    if observations != [None]:  # the sandbox went on with a fresh interpreter rather than ending the episode
        assert observations[1] == f"\n<output>{len(ENV.context(TASKS[0]))}</output>\n"


def test_without_bwrap_the_episode_does_not_start(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # a machine without bwrap on its PATH
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        ENV.start(TASKS[0])


def test_the_rubric_needs_the_episodes_outcome():
    task = TASKS[0]
    score = ENV.rubric.score(ENV.reference_completion(task), task)
    assert math.isnan(score.total) and "graded by its episode" in score.errors["correct"]
    with pytest.raises(ValueError, match="graded by its episode"):
        ENV.is_correct("FINAL(1)", task)


def test_splits_are_disjoint_seeded_and_cycle():
    train, held_out = ENV.tasks("train", 35, 0), ENV.tasks("eval", 12, 3)
    base_id = lambda task: task.id.split("-r")[0]  # a repeat is `<id>-r<pass>`
    assert {base_id(t) for t in train} == {t.id for t in TASKS} - {base_id(t) for t in held_out}
    assert {t.info["family"] for t in held_out} == set(FAMILIES)
    assert len({base_id(t) for t in held_out}) == len(FAMILIES)
    assert len({t.id for t in held_out}) == 12
    assert [t.id for t in held_out] == [t.id for t in ENV.tasks("eval", 12, 3)] != [t.id for t in ENV.tasks("eval", 12, 4)]
    with pytest.raises(ValueError, match="unknown split"):
        ENV.tasks("test", 1, 0)


def test_config_errors_read_well():
    with pytest.raises(ValidationError, match="tasks"):
        RlmEnvConfig(kind="rlm", tasks=3)
    with pytest.raises(ValidationError, match="extra"):
        RlmEnvConfig(kind="rlm", context=5)
