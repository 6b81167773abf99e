"""Preference pairs from a stage's inputs (preference, reward_model): an imported preference
dataset's pairs as they are, or one pair per prompt group of rollouts, chosen = the best-scored
completion and rejected = the worst (ties broken towards the shorter chosen and the longer
rejected, so a looping greedy completion is the one rejected). Groups whose best and worst scores
tie, and groups with fewer than two finite scores, are dropped and counted."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class PairStats:
    prompts: int = 0
    pairs: int = 0
    dropped_tied: int = 0  # best and worst completion scored the same
    dropped_unscored: int = 0  # fewer than two completions with a finite score


def preference_pairs(rollouts: list[dict], min_reward_gap: float = 0.0) -> tuple[list[dict], PairStats]:
    """One (chosen, rejected) pair per prompt group of `rollouts`, and what was dropped."""
    groups: dict[str, list[dict]] = {}
    for row in rollouts:
        groups.setdefault(row["prompt_id"], []).append(row)
    pairs, stats = [], PairStats(prompts=len(groups))
    for prompt_id, group in groups.items():
        scored = [row for row in group if math.isfinite(row["reward"])]
        if len(scored) < 2:
            stats.dropped_unscored += 1
            continue
        chosen = max(scored, key=lambda row: (row["reward"], -len(row["tokens"])))
        rejected = min(scored, key=lambda row: (row["reward"], -len(row["tokens"])))
        if chosen["reward"] - rejected["reward"] <= min_reward_gap:
            stats.dropped_tied += 1
            continue
        pairs.append({"id": prompt_id, "prompt": chosen["prompt"],
                      "chosen": chosen["completion"], "rejected": rejected["completion"],
                      "chosen_score": chosen["reward"], "rejected_score": rejected["reward"],
                      "chosen_tokens": [int(t) for t in chosen["tokens"]],
                      "rejected_tokens": [int(t) for t in rejected["tokens"]],
                      "chosen_mode": chosen["mode"], "rejected_mode": rejected["mode"],
                      "rejected_doom_loop": bool(rejected["doom_loop"]),
                      **({"chosen_mask": [int(m) for m in chosen["loss_mask"]],
                          "rejected_mask": [int(m) for m in rejected["loss_mask"]]} if "loss_mask" in chosen else {})})
    stats.pairs = len(pairs)
    return pairs, stats


def given_pairs(data: str, rows: list[dict]) -> list[dict]:
    """An imported preference dataset's rows as pairs (ids prefixed by the dataset's stage)."""
    keep = ("prompt", "chosen", "rejected", "tools", "conversational")
    return [{**{key: row[key] for key in keep if key in row}, "id": f"{data}/{row['id']}"} for row in rows]


def dataset_pairs(data: str, rows: list[dict], min_reward_gap: float) -> tuple[list[dict], PairStats]:
    """The pairs of one input: an imported preference dataset's, or those picked from rollouts."""
    columns = set(rows[0]) if rows else set()
    if "chosen" in columns:
        return given_pairs(data, rows), PairStats(prompts=len(rows), pairs=len(rows))
    if "prompt_id" not in columns:
        raise ValueError(f"data {data!r} is neither rollouts nor a preference dataset "
                         f"({', '.join(sorted(columns))}); sft takes SFT data")
    return preference_pairs(rows, min_reward_gap)


def input_pairs(ctx, datasets: list[str], min_reward_gap: float) -> tuple[list[dict], PairStats, list[int]]:
    """The pairs of every input dataset of a stage, what was dropped, and how many came from each."""
    from tasks.common.datasets import read_rows

    pairs, stats, sizes = [], PairStats(), []
    for data in datasets:
        found, counted = dataset_pairs(data, read_rows(ctx.fetch(data)), min_reward_gap)
        pairs += found
        sizes.append(len(found))
        for name, value in vars(counted).items():
            setattr(stats, name, getattr(stats, name) + value)
    return pairs, stats, sizes
