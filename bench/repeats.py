"""Comparisons that hold up: a quiet machine first, then the sides run in turn (ours, peer, ours,
peer, ...), each side's median reported with its min and max.

One run a side, ours first, is not a measurement on a shared 2-core machine: identical code
varied by 5-9% between runs, and whatever ran before a side (the other side's allocations, a
neighbour's job) lands on it. Interleaving spreads slow drift over both sides; the median drops
a single disturbed run; min-max shows how far to trust the ratio."""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from typing import Callable, TypeVar

QUIET_LOAD_1M = 0.5  # the 1-minute load average a bench waits for
QUIET_WAIT_SECONDS = 180
POLL_SECONDS = 5
DEFAULT_RUNS = 3

T = TypeVar("T")


def add_arguments(parser, runs: int | None = DEFAULT_RUNS) -> None:
    """`--no-wait`, and `--runs` (not for a bench measured once: `runs` None), the same on every bench."""
    if runs is not None:
        parser.add_argument("--runs", type=_at_least_one, default=runs,
                            help=f"runs a side, interleaved ours/peer; the median is reported (default {runs})")
    parser.add_argument("--no-wait", action="store_true",
                        help="start at once however busy the machine is (tests; the load is still recorded)")


def _at_least_one(text: str) -> int:
    import argparse

    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number, at least 1")
    return int(text)


def wait_for_quiet(no_wait: bool = False, *, threshold: float = QUIET_LOAD_1M,
                   limit_seconds: float = QUIET_WAIT_SECONDS, poll_seconds: float = POLL_SECONDS,
                   load: Callable[[], float] = lambda: os.getloadavg()[0], sleep=time.sleep,
                   clock=time.monotonic) -> dict:
    """Wait until the 1-minute load average is below `threshold`, for at most `limit_seconds`.
    Returns what was found (recorded in the result); a machine that stays busy ends the bench
    with one line on stderr and exit code 2: its figures would not hold up."""
    began = clock()
    current = load()
    if not no_wait:
        while current >= threshold:
            if clock() - began >= limit_seconds:
                print(f"bench: the machine stayed busy (1-minute load average {current:.2f}, not below "
                      f"{threshold} within {limit_seconds:.0f} s); stop the other work and run it again",
                      file=sys.stderr)
                raise SystemExit(2)
            sleep(poll_seconds)
            current = load()
    return {"load_average_1m": round(current, 2), "waited_seconds": round(clock() - began, 1),
            "threshold": threshold, "skipped": no_wait}


def interleaved(sides: dict[str, Callable[[], T]], runs: int, on_run: Callable[[str, int], None] | None = None
                ) -> dict[str, list[T]]:
    """Each side `runs` times, in turn (A B A B ...), a garbage collection before each run."""
    results: dict[str, list[T]] = {name: [] for name in sides}
    for index in range(runs):
        for name, side in sides.items():
            gc.collect()
            if on_run is not None:
                on_run(name, index)
            results[name].append(side())
    return results


def spread(values: list[float], digits: int = 4) -> dict:
    """The median of a side's runs, its min and max, and every run in order."""
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits), "runs": [round(v, digits) for v in values]}


def median_index(values: list[float]) -> int:
    """The run whose value is the (lower) median: its details stand for the side."""
    order = sorted(range(len(values)), key=values.__getitem__)
    return order[(len(values) - 1) // 2]


def paired_ratios(ours: list[float], peer: list[float], digits: int = 4) -> dict:
    """ours/peer of each interleaved pair of runs: how much the ratio itself moves."""
    return spread([a / b for a, b in zip(ours, peer, strict=True)], digits)


def measured(runs: dict[str, list], speed: Callable, details: Callable, key: str) -> tuple[float, float, dict]:
    """(ours, peer, config entries) of a comparison run by `interleaved`: each side's median
    `speed`, the `details` of its median run with the spread of all its runs under `key`, and
    the ratio of each interleaved pair."""
    speeds = {side: [speed(run) for run in results] for side, results in runs.items()}
    config = {side: {**details(results[median_index(speeds[side])]), key: spread(speeds[side], 1)}
              for side, results in runs.items()}
    config["ratio_runs"] = paired_ratios(speeds["ours"], speeds["peer"])
    return config["ours"][key]["median"], config["peer"][key]["median"], config


def protocol(runs: int, quiet: dict, one_side: bool = False) -> dict:
    """What the result's `config.repeats` says about how it was measured."""
    if one_side:
        return {"runs_per_side": runs, "order": "one side: runs in a row", "headline": "the median run's figure",
                "quiet": quiet}
    return {"runs_per_side": runs, "order": "interleaved: ours, peer, ours, peer, ... (gc before each run)",
            "headline": "median of each side's runs; ratio = median ours / median peer", "quiet": quiet}


def say(bench: str) -> Callable[[str, int], None]:
    """A progress line per run (a full `make bench` takes a while)."""
    return lambda side, index: print(f"[{bench}] {side} run {index + 1}", file=sys.stderr, flush=True)
