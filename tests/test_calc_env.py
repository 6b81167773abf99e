"""The multi-turn `calc` env: its tool, its oracle through the real episode loop, and rollouts
of the local model through tasks/rollout/episodes.py (token in / token out, observations masked)."""

import pytest

from envs.calc import CalcEnv, CalcEnvConfig, evaluate_sum

ENV = CalcEnv(CalcEnvConfig(kind="calc", operands=3, digits=2))


def play(env, task, actions):
    episode, transcript = env.start(task), ""
    for action in actions:
        turn = episode.step(action)
        transcript += action + turn.observation
        if turn.done:
            break
    return transcript


def test_oracle_scores_full_reward_and_a_no_op_scores_zero_on_every_task():
    for task in ENV.tasks("train", 50, 0) + ENV.tasks("eval", 50, 0):
        oracle = play(ENV, task, ENV.oracle_actions(task))
        assert oracle == ENV.reference_completion(task)
        assert ENV.rubric.score(oracle, task).total == pytest.approx(1.2)
        assert ENV.rubric.score(oracle, task).rewards["tool_calls"] == 2
        assert ENV.rubric.score(play(ENV, task, [""]), task).total == 0.0


def test_the_tool_answers_calls_and_reports_bad_expressions():
    episode = ENV.start(ENV.tasks("train", 1, 0)[0])
    assert episode.step("<calc>27+15-2</calc>").observation == "\n<result>40</result>\n"
    bad = episode.step("<calc>27*15</calc>")
    assert not bad.done and bad.observation.startswith("\n<error>not a sum of integers: '27*15'")
    assert episode.step("The final answer is 3.").done
    assert evaluate_sum(" 1 + 2 ") == 3
    for expression in ("", "1++2", "1 2", "__import__('os')", "9" * 13):
        with pytest.raises(ValueError):
            evaluate_sum(expression)


def test_splits_are_disjoint_and_seeded():
    train = {t.prompt for t in ENV.tasks("train", 300, 0)}
    held_out = {t.prompt for t in ENV.tasks("eval", 300, 0)}
    assert not train & held_out
    assert [t.prompt for t in ENV.tasks("eval", 5, 3)] == [t.prompt for t in ENV.tasks("eval", 5, 3)]


def test_oracle_through_the_rollout_loop_chains_tokens_and_masks_what_the_env_wrote():
    from models.loading import load_tokenizer
    from models.presets import materialize
    from models.sampling import SamplingParams
    from tasks.rollout.episodes import ScriptedPolicy, roll_out

    tokenizer = load_tokenizer(materialize("tiny-llama"))
    tasks = ENV.tasks("train", 4, 0)
    oracle = ScriptedPolicy(tokenizer, [ENV.oracle_actions(t) for t in tasks])
    for task, trajectory in zip(tasks, roll_out(oracle, tokenizer, ENV, tasks, SamplingParams(32))):
        assert trajectory.finished and len(trajectory.turns) == 3
        assert trajectory.text == ENV.reference_completion(task)
        assert ENV.rubric.score(trajectory.text, task).total == pytest.approx(1.2)
        ids, mask = trajectory.completion()
        assert sum(mask) == trajectory.completion_tokens
        assert tokenizer.decode([t for t, m in zip(ids, mask) if not m]) == "\n<result>{}</result>\n".format(
            sum(task.info["operands"][:2])) + "\n<result>{}</result>\n".format(task.answer)
        assert trajectory.turns[0].context_ids == trajectory.prompt_ids
        for earlier, later in zip(trajectory.turns, trajectory.turns[1:]):  # token in / token out
            assert later.context_ids == earlier.context_ids + earlier.action_ids + earlier.observation_ids
    no_op = roll_out(ScriptedPolicy(tokenizer, [[]] * len(tasks)), tokenizer, ENV, tasks, SamplingParams(32))
    assert all(len(t.turns) == 1 and ENV.rubric.score(t.text, t.task).total == 0 for t in no_op)


def test_an_episode_that_never_answers_is_cut_at_max_turns():
    from models.loading import load_tokenizer
    from models.presets import materialize
    from models.sampling import SamplingParams
    from tasks.rollout.episodes import ScriptedPolicy, roll_out

    tokenizer = load_tokenizer(materialize("tiny-llama"))
    env = CalcEnv(CalcEnvConfig(kind="calc", max_turns=2))
    task = env.tasks("train", 1, 0)[0]
    [trajectory] = roll_out(ScriptedPolicy(tokenizer, [["<calc>1+1</calc>"] * 5]), tokenizer, env, [task],
                            SamplingParams(32))
    assert len(trajectory.turns) == 2 and trajectory.truncated
