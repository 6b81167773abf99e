"""`score_episode`, the one scorer of rl, generate and evaluate, on toy trajectories: doom loops are
read on the policy's actions, and every stage's row says what the scorer said."""

from envs.arith import ArithEnv, ArithEnvConfig
from tasks.rollout.episodes import Trajectory, TurnRecord
from tasks.rollout.scoring import score_episode
from tasks.stages.evaluate import score_rows
from tasks.stages.generate import GenerateStage, rollout_rows
from tasks.stages.rl import RlStage
from tasks.stages.rl.scoring import score_trajectory

ENV = ArithEnv(ArithEnvConfig(kind="arith", digits=2))
TASK = ENV.tasks("train", 1, 0)[0]
PASSAGE = "<information>" + "the river runs through the city. " * 12 + "</information>"


def cut_episode(actions: list[str], observations: list[str]) -> Trajectory:
    """An episode that ran out of its budget: its turns' actions, each followed by an observation."""
    turns = [TurnRecord([1], [5] * 8, [6] * bool(observation), 0.0, i == len(actions) - 1, action_logprobs=[-0.5] * 8)
             for i, (action, observation) in enumerate(zip(actions, observations))]
    text = "".join(action + observation for action, observation in zip(actions, observations))
    return Trajectory("arith", TASK, [1], turns, text, finished=False, actions=actions)


def test_a_repeating_observation_is_no_doom_loop_but_repeating_actions_are():
    quiet = cut_episode(["<search>rivers</search>", "<search>cities</search>"], [PASSAGE, PASSAGE])
    looping = cut_episode(["The answer is correct." * 6, "The answer is correct." * 6], ["", ""])
    assert not score_episode(quiet, ENV).doom_loop
    assert score_episode(looping, ENV).doom_loop


def test_generate_evaluate_and_rl_rows_carry_the_one_score():
    answer = ENV.reference_completion(TASK)
    trajectories = [cut_episode(["<search>x</search>", answer], [PASSAGE, ""]),
                    cut_episode(["The answer is correct." * 6], [""])]
    scores = [score_episode(t, ENV) for t in trajectories]
    generated = rollout_rows(ENV, [trajectories], GenerateStage(kind="generate", id="g", policy="p", env="arith",
                                                                n=1, samples=2, greedy=0))
    evaluated = score_rows(ENV, trajectories, checkpoint="p", mode="greedy")
    stage = RlStage(kind="rl", id="rl", policy="p", envs={"arith": 1.0}, steps=1)
    scored = [score_trajectory(t, ENV, stage) for t in trajectories]
    for score, generated_row, evaluated_row, rl in zip(scores, generated, evaluated, scored):
        assert generated_row["doom_loop"] == evaluated_row["doom_loop"] == rl.doom_loop == score.doom_loop
        assert generated_row["correct"] == evaluated_row["correct"] == rl.correct == score.correct
        assert generated_row["reward"] == evaluated_row["reward"] == score.reward
        assert evaluated_row["formatted"] == score.formatted
    assert [s.doom_loop for s in scores] == [False, True]
    assert generated[0]["logprobs"] == [-0.5] * 8 + [0.0] + [-0.5] * 8  # the sampler's, 0 on the env's token
