"""`score_episode`: the one scorer of a played episode (rl, generate and evaluate).

An episode is scored on its transcript (tasks/rollout/episodes.py: the actions and what the env
answered), its graded outcome and the policy's token ids: the env rubric's rewards and weighted
total, whether it solved the task, whether it kept the env's format. A doom loop is read on the
policy's actions alone, never on what the env wrote (search passages and terminal logs repeat by
nature), and only in an episode that ran out of its budget (envs/doom.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from envs.base import Rubric, Score
from envs.doom import DoomLoopDetector

DOOM_LOOPS = DoomLoopDetector()


@dataclass
class EpisodeScore:
    score: Score  # the rubric's: each function's reward, the weighted total (NaN when one raised), errors
    correct: bool
    formatted: bool
    doom_loop: bool

    @property
    def reward(self) -> float:
        return self.score.total

    def reward_columns(self) -> dict:
        """`reward_<name>` of each rubric function, as a dataset row holds them."""
        return {f"reward_{name}": value for name, value in self.score.rewards.items()}


def score_episode(trajectory, env, rubric: Rubric | None = None) -> EpisodeScore:
    """The score of `trajectory` (a rollouts.Trajectory) in `env`, by the env's rubric unless
    another is given."""
    text, task, outcome = trajectory.text, trajectory.task, trajectory.outcome
    score = (rubric or env.rubric).score(text, task, outcome, trajectory.completion()[0])
    return EpisodeScore(score, env.is_correct(text, task, outcome), env.is_formatted(text, task, outcome),
                        DOOM_LOOPS.is_loop("".join(trajectory.actions), trajectory.truncated))


def prefetch_scores(trajectories: list, env, rubric: Rubric | None = None) -> None:
    """Let the rubric's batch scorers (a reward model, a judge) score these episodes at once,
    before `score_episode` asks for them one by one."""
    (rubric or env.rubric).prefetch([(trajectory.text, trajectory.task) for trajectory in trajectories])
