"""Preference pairs from a stage's inputs (preference, reward_model): an imported preference
dataset's pairs as they are, or one pair per prompt group of rollouts, chosen = the best-scored
completion and rejected = the worst (ties broken towards the shorter chosen and the longer
rejected, so a looping greedy completion is the one rejected). Groups whose best and worst scores
tie, and groups with fewer than two finite scores, are dropped and counted. A reward model may take
every pair of a group instead (`rollout_pairs: all`, InstructGPT's K-choose-2 comparisons): each
completion above each one scored lower, held out by its group as a whole (`split_key`)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class PairStats:
    prompts: int = 0
    pairs: int = 0
    dropped_tied: int = 0  # best and worst completion scored the same
    dropped_unscored: int = 0  # fewer than two completions with a finite score


# joins a group's id and a pair's place in it (rollout_pairs: all): the ASCII unit separator, which
# no id of a row is expected to hold ("/pair-" would cut `prefs/pair-7`, a given pair's id, in two)
EVERY_PAIR_MARK = "\x1f"


def preference_pairs(rollouts: list[dict], min_reward_gap: float = 0.0,
                     every_pair: bool = False) -> tuple[list[dict], PairStats]:
    """One (chosen, rejected) pair per prompt group of `rollouts` (or every pair whose rewards differ
    by more than `min_reward_gap`), and what was dropped."""
    groups: dict[str, list[dict]] = {}
    for row in rollouts:
        groups.setdefault(row["prompt_id"], []).append(row)
    pairs, stats = [], PairStats(prompts=len(groups))
    for prompt_id, group in groups.items():
        scored = [row for row in group if math.isfinite(row["reward"])]
        if len(scored) < 2:
            stats.dropped_unscored += 1
            continue
        picked = group_pairs(scored, min_reward_gap, every_pair)
        if not picked:
            stats.dropped_tied += 1
        for place, (chosen, rejected) in enumerate(picked):
            pair_id = f"{prompt_id}{EVERY_PAIR_MARK}{place}" if every_pair else prompt_id
            pairs.append(pair_row(pair_id, chosen, rejected))
    stats.pairs = len(pairs)
    return pairs, stats


def group_pairs(scored: list[dict], min_reward_gap: float, every_pair: bool) -> list[tuple[dict, dict]]:
    """A group's (chosen, rejected) rows: the best and the worst, or every ordered pair apart by more
    than the gap."""
    if every_pair:
        return [(chosen, rejected) for chosen in scored for rejected in scored
                if chosen["reward"] - rejected["reward"] > min_reward_gap]
    chosen = max(scored, key=lambda row: (row["reward"], -len(row["tokens"])))
    rejected = min(scored, key=lambda row: (row["reward"], -len(row["tokens"])))
    return [(chosen, rejected)] if chosen["reward"] - rejected["reward"] > min_reward_gap else []


def pair_row(pair_id: str, chosen: dict, rejected: dict) -> dict:
    return {"id": pair_id, "prompt": chosen["prompt"],
            "chosen": chosen["completion"], "rejected": rejected["completion"],
            "chosen_score": chosen["reward"], "rejected_score": rejected["reward"],
            "chosen_tokens": [int(t) for t in chosen["tokens"]],
            "rejected_tokens": [int(t) for t in rejected["tokens"]],
            "chosen_mode": chosen["mode"], "rejected_mode": rejected["mode"],
            "rejected_doom_loop": bool(rejected["doom_loop"]),
            **({"chosen_mask": [int(m) for m in chosen["loss_mask"]],
                "rejected_mask": [int(m) for m in rejected["loss_mask"]]} if "loss_mask" in chosen else {})}


def split_key(pair: dict) -> str:
    """What a pair is held out by: its group's id, so that a group's pairs fall on one side."""
    return pair["id"].split(EVERY_PAIR_MARK, 1)[0]


def given_pairs(data: str, rows: list[dict]) -> list[dict]:
    """An imported preference dataset's rows as pairs (ids prefixed by the dataset's stage)."""
    keep = ("prompt", "chosen", "rejected", "tools", "conversational")
    return [{**{key: row[key] for key in keep if key in row}, "id": f"{data}/{row['id']}"} for row in rows]


def dataset_pairs(data: str, rows: list[dict], min_reward_gap: float,
                  every_pair: bool = False) -> tuple[list[dict], PairStats]:
    """The pairs of one input: an imported preference dataset's, or those picked from rollouts."""
    columns = set(rows[0]) if rows else set()
    if "chosen" in columns:
        return given_pairs(data, rows), PairStats(prompts=len(rows), pairs=len(rows))
    if "prompt_id" not in columns:
        raise ValueError(f"data {data!r} is neither rollouts nor a preference dataset "
                         f"({', '.join(sorted(columns))}); sft takes SFT data")
    return preference_pairs(rows, min_reward_gap, every_pair)


def input_pairs(ctx, datasets: list[str], min_reward_gap: float,
                every_pair: bool = False) -> tuple[list[dict], PairStats, list[int]]:
    """The pairs of every input dataset of a stage, what was dropped, and how many came from each."""
    from tasks.common.datasets import read_rows

    pairs, stats, sizes = [], PairStats(), []
    for data in datasets:
        found, counted = dataset_pairs(data, read_rows(ctx.fetch(data)), min_reward_gap, every_pair)
        pairs += found
        sizes.append(len(found))
        for name, value in vars(counted).items():
            setattr(stats, name, getattr(stats, name) + value)
    return pairs, stats, sizes
