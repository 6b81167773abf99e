"""An rl episode's step rewards: the episode scored as every stage scores it
(tasks/rollout/scoring.py), then shaped by the stage's own terms on the policy's actions: the
anti-doom repetition penalty, trace validation, the overlong penalty."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from envs.base import RewardFunc, Rubric
from envs.doom import overlong_excess, repetition_excess, trace_is_valid
from tasks.rollout.episodes import Trajectory, TurnRecord
from tasks.rollout.scoring import score_episode


@dataclass
class Scored:
    trajectory: Trajectory
    step_rewards: list[float]  # per turn; the last holds the rubric's shaped score (NaN if a reward raised)
    correct: bool
    doom_loop: bool
    repetition: float  # the anti-doom term before its weight (0 without anti_doom)
    overlong: float  # the overlong term before its weight (0 without overlong)
    valid_trace: bool
    rewards: dict = field(default_factory=dict)  # each reward function's value (the rubric's and the stage's)

    @property
    def reward(self) -> float:
        return sum(self.step_rewards)


def anti_doom_rubric(stage) -> Rubric:
    """The stage's own terms, scored on the policy's actions only (never on what the env wrote:
    search passages or terminal logs repeat by nature): the anti-doom repetition penalty."""
    if stage.anti_doom is None:
        return Rubric([])
    doom = stage.anti_doom

    def repetition(actions, task, outcome):
        return repetition_excess(actions, doom.ngram, doom.threshold)

    return Rubric([RewardFunc("repetition", repetition, -doom.penalty)])


def score_trajectory(trajectory: Trajectory, env, stage, rubric: Rubric | None = None) -> Scored:
    """Step rewards of an episode: the env's per-step rewards, and on the last step the env
    rubric's score (`rubric` instead, if given) plus the stage's shaping of the actions."""
    actions = "".join(trajectory.actions)
    episode = score_episode(trajectory, env, rubric)
    shaped = anti_doom_rubric(stage).score(actions, trajectory.task, trajectory.outcome)
    shaping = shaped.total
    valid = trace_is_valid(actions, trajectory.truncated)
    total = episode.reward
    if not valid and stage.anti_doom is not None and stage.anti_doom.validate_trace and math.isfinite(total):
        total = (rubric or env.rubric).penalties(episode.score)  # a raised reward stays NaN: never a silent value
    overlong = 0.0
    if stage.overlong is not None:
        overlong = max(overlong_excess(len(turn.action_ids), stage.max_tokens, stage.overlong.buffer)
                       for turn in trajectory.turns)
        shaping -= stage.overlong.penalty * overlong
    step_rewards = [turn.reward for turn in trajectory.turns]
    # an env that pays per step (cod: every solve turn; its rubric restates them as the pack's mean), and a cut
    # pack keeps what its solved tasks earned: only the stage's shaping is added there
    step_rewards[-1] += shaping + (0.0 if env.pays_per_step else total)
    repetition = repetition_excess(actions, stage.anti_doom.ngram, stage.anti_doom.threshold) \
        if stage.anti_doom is not None else 0.0
    return Scored(trajectory, step_rewards, episode.correct, episode.doom_loop, repetition, overlong, valid,
                  {**episode.score.rewards, **shaped.rewards})


def has_signal(group: list[Scored]) -> bool:
    """Whether a group's rewards differ (dynamic sampling keeps only such groups)."""
    rewards = [s.reward for s in group if math.isfinite(s.reward)]
    return len(rewards) >= 2 and max(rewards) - min(rewards) > 1e-9


def scored_data(scored: Scored) -> dict:
    """A scored episode as JSON values, without its task (every process drew the same tasks)."""
    data = asdict(scored)
    del data["trajectory"]["task"]
    return data


def scored_from_data(data: dict, task) -> Scored:
    trajectory = dict(data["trajectory"], task=task, turns=[TurnRecord(**turn) for turn in data["trajectory"]["turns"]])
    return Scored(**dict(data, trajectory=Trajectory(**trajectory)))
