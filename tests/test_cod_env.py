"""The `cod` env (Connect the Dots): packs of goals under a hidden code-word rule, solve and hint
turns, contexts restarted per task, reward by position, and a short steppo run with `credit: cod`."""

import math

import pytest

from envs.base import RESTART_SEPARATOR
from envs.cod import CodEnv, CodEnvConfig, rule_text, solve_prompt
from models.sampling import SamplingParams, chat_prompt
from tasks.rollout.episodes import ScriptedPolicy, roll_out

ENV = CodEnv(CodEnvConfig(kind="cod"))
PARAMS = SamplingParams(64)


@pytest.fixture(scope="module")
def tokenizer():
    from models.loading import load_tokenizer
    from models.presets import materialize

    return load_tokenizer(materialize("tiny-llama"))


def play(tokenizer, env, tasks, scripts):
    return roll_out(ScriptedPolicy(tokenizer, scripts), tokenizer, env, tasks, PARAMS)


def test_oracle_scores_full_reward_on_every_pack_and_a_no_op_scores_zero(tokenizer):
    tasks = ENV.all_tasks()
    oracle = play(tokenizer, ENV, tasks, [ENV.oracle_actions(t) for t in tasks])
    no_op = play(tokenizer, ENV, tasks, [[""] for _ in tasks])
    full = ENV.rubric.reward_range[1]
    for task, trajectory, idle in zip(tasks, oracle, no_op):
        size = len(task.info["goals"])
        assert trajectory.finished and len(trajectory.turns) == 2 * size - 1
        assert trajectory.text == ENV.reference_completion(task)
        score = ENV.rubric.score(trajectory.text, task, trajectory.outcome)
        assert score.total == full == 1.0 and not score.errors
        assert ENV.is_correct(trajectory.text, task, trajectory.outcome)
        assert ENV.is_formatted(trajectory.text, task, trajectory.outcome)
        assert [turn.reward for turn in trajectory.turns] == [1.0, 0.0] * (size - 1) + [1.0]
        idle_score = ENV.rubric.score(idle.text, task, idle.outcome)
        assert idle_score.total == 0.0 and not idle_score.errors and not ENV.is_correct(idle.text, task, idle.outcome)
        assert all(turn.reward == 0.0 for turn in idle.turns)


def test_each_task_of_a_pack_starts_a_fresh_context_with_only_its_goal_and_hint(tokenizer):
    task = ENV.tasks("train", 1, 0)[0]
    [trajectory] = play(tokenizer, ENV, [task], [ENV.oracle_actions(task)])
    turns = trajectory.turns
    assert [turn.kind for turn in turns] == ["solve", "hint"] * 3 + ["solve"]
    assert turns[0].context_ids == trajectory.prompt_ids
    rule, goals = task.info["rule"], task.info["goals"]
    for k in range(1, 4):
        solve, hint = turns[2 * k], turns[2 * k - 1]
        # the hint turn continues the solve's context (its attempt and the feedback) ...
        assert hint.context_ids == turns[2 * k - 2].context_ids + turns[2 * k - 2].action_ids + \
            turns[2 * k - 2].observation_ids
        assert hint.observation_ids == []  # ... and the next task restarts: no observation is appended
        assert solve.context_ids == chat_prompt(tokenizer, solve_prompt(rule, goals[k], rule_text(rule)))
        assert f"Hints: {rule_text(rule)}" in tokenizer.decode(solve.context_ids)
    # the transcript stays readable: a separator and the fresh prompt between the tasks
    contexts = (task.prompt + trajectory.text).split(RESTART_SEPARATOR)
    assert len(contexts) == 4 and all(len(context) <= 400 for context in contexts)
    for task in ENV.all_tasks():  # the longest context of any pack, with a full-length hint
        assert len(solve_prompt(task.info["rule"], (-2, -2), "x" * 120)) + 120 < 400


def test_reward_by_position_and_the_hint_length_penalty(tokenizer):
    task = ENV.tasks("train", 1, 0)[0]
    oracle = ENV.oracle_actions(task)
    long_hint = "<hints>" + "y" * 240 + "</hints>"  # twice hint_chars past the limit: the full penalty
    # wrong first attempt, a long hint, then the oracle's last two tasks
    script = ["<moves>zz</moves>", long_hint, "<moves></moves>", *oracle[3:]]
    [trajectory] = play(tokenizer, ENV, [task], [script])
    assert [turn.reward for turn in trajectory.turns] == [0.0, -0.1, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert trajectory.outcome == {"position_0": 0.0, "position_1": 0.0, "position_2": 1.0, "position_3": 1.0,
                                  "solved": 0.5, "formatted": 0.0}
    score = ENV.rubric.score(trajectory.text, task, trajectory.outcome)
    assert score.total == 0.5 and score.rewards["position_2"] == 1.0
    assert math.isnan(score.rewards["position_7"]) and not score.errors  # a train pack has 4 tasks
    # the long hint reached the next task cut to hint_chars
    assert "Hints: " + "y" * 120 + "\n" in tokenizer.decode(trajectory.turns[2].context_ids)
    assert "zz" in trajectory.text and "<feedback>reward 0." in trajectory.text


def test_broken_actions_answer_with_feedback_and_never_raise():
    task = ENV.tasks("train", 1, 0)[0]
    codes = sorted(task.info["rule"].values())
    for action in ("", "<moves>up up</moves>", "<moves>a</moves><moves>b</moves>", "<moves>" + "x " * 999,
                   "<moves>" + " ".join(codes * 3) + "</moves>", "\x00<hints>", "<hints>"):
        episode = ENV.start(task)
        turn = episode.step(action)
        assert turn.kind == "solve" and turn.reward == 0.0 and turn.observation.startswith("\n<feedback>reward 0.")
        hint = episode.step(action)
        assert hint.kind == "hint" and hint.restart is not None and hint.reward <= 0.0
        assert episode.finish()["solved"] == 0.0


def test_used_feedback_reveals_only_the_codes_the_attempt_used():
    env = CodEnv(CodEnvConfig(kind="cod", feedback="used"))
    task = env.tasks("train", 1, 0)[0]
    rule = task.info["rule"]
    turn = env.start(task).step(f"<moves>{rule['up']} {rule['up']}</moves>")
    assert f"{rule['up']}=up</feedback>" in turn.observation and "down" not in turn.observation
    assert "no known code used" in env.start(task).step("<moves>zz</moves>").observation
    full = ENV.start(ENV.tasks("train", 1, 0)[0]).step("<moves>zz</moves>")
    assert full.observation.count("=") == 4  # `rule` feedback: the whole rule


def test_ralph_repeats_one_goal_and_packs_draw_distinct_goals():
    ralph = CodEnv(CodEnvConfig(kind="cod", mode="ralph", pack_size=3))
    for task in ralph.tasks("train", 20, 0):
        assert len(task.info["goals"]) == 3 and len({tuple(g) for g in task.info["goals"]}) == 1
    for task in ENV.tasks("train", 20, 0):
        assert len({tuple(g) for g in task.info["goals"]}) == 4


def test_splits_hold_different_rules_and_eval_packs_are_longer():
    train = ENV.tasks("train", 300, 0)
    held_out = ENV.tasks("eval", 100, 0)
    assert not {t.answer for t in train} & {t.answer for t in held_out}
    assert {len(t.info["goals"]) for t in held_out} == {8} and ENV.max_turns == 15
    assert [t.prompt for t in ENV.tasks("eval", 5, 3)] == [t.prompt for t in ENV.tasks("eval", 5, 3)]
    other_world = CodEnv(CodEnvConfig(kind="cod", seed=1))
    assert [t.prompt for t in other_world.tasks("train", 5, 0)] != [t.prompt for t in train[:5]]


def test_scored_packs_are_paid_per_solve_and_credited_per_slot(tokenizer):
    from tasks.stages.rl import RlStage
    from tasks.stages.rl.batch import training_rows
    from tasks.stages.rl.metrics import batch_metrics
    from tasks.stages.rl.scoring import score_trajectory

    stage = RlStage(kind="rl", id="rl", policy="sft", envs={"cod": 1.0}, steps=1, algorithm="steppo", credit="cod")
    task = ENV.tasks("train", 1, 0)[0]
    oracle = ENV.oracle_actions(task)
    group = play(tokenizer, ENV, [task, task], [oracle, ["<moves>zz</moves>", *oracle[1:]]])
    scored = [score_trajectory(t, ENV, stage) for t in group]
    # the rubric's pack mean is not paid again on top of the solve turns
    assert scored[0].step_rewards == [1.0, 0.0] * 3 + [1.0] and scored[1].step_rewards[0] == 0.0
    assert scored[0].reward == 4.0 and scored[0].correct and not scored[1].correct
    # returns: the oracle R_0 = 1, the other R_0 = (0+1+1+1)/4 = .75; every later slot is equal
    rows = training_rows([scored], "steppo", 2, stage.scale_rewards, stage.gamma, False, stage.credit)
    assert [r.advantage for r in rows] == pytest.approx([0.125] + [0.0] * 6 + [-0.125] + [0.0] * 6)
    assert rows[2].prompt_ids == group[0].turns[2].context_ids  # the restarted context is the row's prompt
    assert batch_metrics(scored, ["cod"])["solve_reward_0"] == 0.5
    assert batch_metrics(scored, ["cod", "calc"])["cod/solve_reward_3"] == 1.0


def rl_context(tmp_path, envs):
    from artifacts.store import Store
    from models.config import ModelConfig
    from models.presets import materialize
    from tasks.common.context import StageContext

    store = Store(f"file://{tmp_path / 'store'}")
    policy = store.commit("t/sft", "checkpoint", materialize("tiny-llama"), producer={})
    return StageContext(store=store, pipeline="t", run_id="r", stage_id="rl", cache_key="k", model=ModelConfig(),
                        envs=envs, inputs={"sft": str(policy)}, workdir=tmp_path / "w", producer={"stage_id": "rl"})


def test_rl_refuses_grpo_on_restarted_contexts(tmp_path):
    from tasks.stages.rl import RlStage
    from tasks.stages.rl.stage import run

    stage = RlStage(kind="rl", id="rl", policy="sft", envs={"packs": 1.0}, steps=1)
    with pytest.raises(ValueError, match="env 'packs' restarts contexts \\(cod\\); use algorithm: steppo"):
        run(stage, rl_context(tmp_path, {"packs": CodEnvConfig(kind="cod")}))


def test_steppo_with_cod_credit_runs_and_logs_reward_by_position(tmp_path):
    import json

    from tasks.stages.rl import RlStage
    from tasks.stages.rl.stage import run

    stage = RlStage(kind="rl", id="rl", policy="sft", envs={"cod": 1.0}, steps=2, algorithm="steppo", credit="cod",
                    prompts_per_step=2, group_size=2, max_tokens=12)
    outputs = run(stage, rl_context(tmp_path, {"cod": CodEnvConfig(kind="cod", pack_size=2)}))
    history = [json.loads(line) for line in (outputs["report"].local_dir / "metrics.jsonl").read_text().splitlines()]
    for h in history:
        assert {"solve_reward_0", "solve_reward_1", "loss", "rows"} <= set(h) and h["rows"] >= 4
