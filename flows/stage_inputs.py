"""A stage's inputs as the spec names them, and the refs they resolve to when the stage starts.

An input is a stage id (`policy: rl`: that stage's primary output), or, where a checkpoint is
read, the best evaluated checkpoint of that stage by one metric of one env
(`policy: rl@best:arith.accuracy`): among the checkpoints of the stage's run that made its output
(its in-stage ones, `rl.step-N`, and its final one, `rl`; one stage cache key), the one whose
evaluation on that env scores highest (lowest for a failure rate), ties to the later step. The
evaluations are the store's (flows/leaderboard.py), so they are read when the stage starts: in
ephemeral mode a stage's new checkpoints are evaluated inline before any stage downstream starts.

The stage's `inputs` (request, manifests, cache key) are keyed by the input as the spec writes it,
so a manifest's inputs show the selector beside the ref it chose (`{"rl@best:arith.accuracy":
"qs/rl.step-20@..."}`), and a different choice is a different cache key.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

BEST = re.compile(r"^(?P<stage>[^@]+)@best:(?P<env>[^@]+)\.(?P<metric>[A-Za-z_][A-Za-z0-9_]*)$")
# metrics where less is better: the best checkpoint has the lowest
LOWER_IS_BETTER = frozenset({"doom_loop_rate", "truncated_rate"})


class BadStageInput(ValueError):
    """An input that is neither a stage id nor `STAGE@best:<env>.<metric>`; one line."""


class NoBestCheckpoint(ValueError):
    """No checkpoint of the stage was evaluated with the selector's metric; one line."""


@dataclass(frozen=True)
class BestCheckpoint:
    """`STAGE@best:<env>.<metric>`: the best evaluated checkpoint of a stage's run by a metric."""

    stage: str
    env: str
    metric: str

    def __str__(self) -> str:
        return f"{self.stage}@best:{self.env}.{self.metric}"

    def better(self, value: float) -> float:
        """The value as a score where higher is better."""
        return -value if self.metric in LOWER_IS_BETTER else value


def parse_input(written: str) -> str | BestCheckpoint:
    """A stage id as is, or the BestCheckpoint a `@best:` input names; BadStageInput otherwise."""
    if "@" not in written:
        return written
    match = BEST.fullmatch(written)
    if match is None:
        raise BadStageInput(f"{written!r}: expected a stage id or STAGE@best:<env>.<metric> "
                            "(e.g. rl@best:arith.accuracy)")
    return BestCheckpoint(match["stage"], match["env"], match["metric"])


def input_stage(written: str) -> str:
    """The id of the stage an input reads."""
    parsed = parse_input(written)
    return parsed if isinstance(parsed, str) else parsed.stage


def resolve_inputs(written: dict[str, str], output_of: dict[str, str], store,
                   note=lambda line: None) -> dict[str, str]:
    """{input as written: ref}: a stage id gives its stage's primary output (`output_of`), a
    BestCheckpoint the best checkpoint of the run that made it (`note` gets a line saying which).
    `written` maps each input to the field naming it (`stages[2].policy`), for NoBestCheckpoint's message."""
    resolved = {}
    for text, field in written.items():
        parsed = parse_input(text)
        if isinstance(parsed, str):
            resolved[text] = output_of[parsed]
            continue
        resolved[text], value = best_checkpoint(store, output_of[parsed.stage], parsed, field)
        note(f"{field}: {text} = {resolved[text]} ({parsed.env}.{parsed.metric} {value:.4g})")
    return resolved


def best_checkpoint(store, final_ref: str, selector: BestCheckpoint, field: str) -> tuple[str, float]:
    """(ref, value) of the best evaluated checkpoint of the stage run that committed `final_ref`."""
    from flows.leaderboard import evaluations

    manifest = store.manifest(final_ref)
    cache_key, pipeline = manifest["producer"].get("cache_key"), manifest["producer"].get("pipeline")
    scored: dict[str, dict] = {}  # checkpoint -> its row with the most tasks on the env
    for row in evaluations(store, pipeline):
        value = row.get(selector.metric)
        if row["cache_key"] != cache_key or row["env"] != selector.env or not _finite(value):
            continue
        if row["checkpoint"] not in scored or row["n"] >= scored[row["checkpoint"]]["n"]:
            scored[row["checkpoint"]] = row
    if not scored:
        raise NoBestCheckpoint(f"{field}: no evaluated checkpoint of {selector.stage} has "
                               f"{selector.env}.{selector.metric}")
    best = max(scored.values(), key=lambda row: (selector.better(row[selector.metric]), row["step"] or 0))
    return best["checkpoint"], best[selector.metric]


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
