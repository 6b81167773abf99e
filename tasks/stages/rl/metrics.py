"""What an rl step logs about the episodes it sampled: reward, accuracy, doom loops, per env, and
CoD's reward by position in the pack; and the samples table the trackers get."""

from __future__ import annotations

import math


def episode_metrics(sampled: list, prefix: str = "") -> dict:
    n = len(sampled)
    finite = [s.reward for s in sampled if math.isfinite(s.reward)]
    return {f"{prefix}reward": sum(finite) / max(1, len(finite)),
            f"{prefix}accuracy": sum(s.correct for s in sampled) / n,
            f"{prefix}doom_loop_rate": sum(s.doom_loop for s in sampled) / n,
            f"{prefix}truncated_rate": sum(s.trajectory.truncated for s in sampled) / n,
            f"{prefix}turns": sum(len(s.trajectory.turns) for s in sampled) / n,
            f"{prefix}reward_errors": n - len(finite)}  # a reward function raised: advantage 0, counted


def batch_metrics(sampled: list, env_ids: list[str]) -> dict:
    """Means over every episode a step sampled, overall and per env when there are several."""
    metrics = {**episode_metrics(sampled),
               "repetition": sum(s.repetition for s in sampled) / len(sampled),
               "overlong": sum(s.overlong for s in sampled) / len(sampled),
               "invalid_trace_rate": sum(not s.valid_trace for s in sampled) / len(sampled)}
    if len(env_ids) > 1:
        for env_id in env_ids:
            mine = [s for s in sampled if s.trajectory.env_id == env_id]
            if mine:
                metrics.update(episode_metrics(mine, f"{env_id}/"))
                metrics.update(position_metrics(mine, f"{env_id}/"))
    else:
        metrics.update(position_metrics(sampled))
    return metrics


def position_metrics(sampled: list, prefix: str = "") -> dict:
    """CoD's reward by position in the pack: `solve_reward_j` = the mean `position_j` of the
    episodes' outcomes (a task its pack never reached counts 0), for the positions they hold."""
    positions = sorted({int(key.removeprefix("position_")) for s in sampled for key in s.trajectory.outcome
                        if key.startswith("position_")})
    metrics = {}
    for j in positions:
        values = [s.trajectory.outcome[f"position_{j}"] for s in sampled if f"position_{j}" in s.trajectory.outcome]
        metrics[f"{prefix}solve_reward_{j}"] = sum(values) / len(values)
    return metrics


def sample_rows(sampled: list) -> list[dict]:
    """A step's episodes as rows of the trackers' samples table."""
    return [{"env": s.trajectory.env_id, "prompt": s.trajectory.task.prompt, "completion": s.trajectory.text,
             "reward": s.reward, **{f"reward_{name}": value for name, value in s.rewards.items()}} for s in sampled]
