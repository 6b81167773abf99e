"""`python -m bench.table`: the README's benchmark table, read from bench/results/*.json (no
figure without a file behind it). Prints markdown; runs nothing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.common import RESULTS_DIR

HEADER = ("| bench | metric | ours | peer | ratio (min–max of the paired runs) | runs a side | measured |\n"
          "|---|---|---|---|---|---|---|")


def number(value: float | None, unit: str = "") -> str:
    if value is None:
        return "–"
    text = f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    return f"{text} {unit}".rstrip()


def row(name: str, result: dict) -> str:
    config = result["config"]
    ratio = number(result["ratio"])
    if "ratio_runs" in config:
        ratio += f" ({config['ratio_runs']['min']:.2f}–{config['ratio_runs']['max']:.2f})"
    runs = config["repeats"]["runs_per_side"] if "repeats" in config else 1
    unit = "" if result["peer"] is not None else result["unit"]
    return (f"| `{name}` | {result['metric']} | {number(result['ours'], unit)} | "
            f"{number(result['peer'])} {result['peer_name'] or ''} | {ratio} | {runs} | "
            f"{result['machine']['date'][:10]} |").replace("  |", " |")


def table(results_dir: Path = RESULTS_DIR, names: list[str] | None = None) -> str:
    from bench.__main__ import BENCHES

    names = names or [name for name in BENCHES if (results_dir / f"{name}.json").exists()]
    rows = [row(name, json.loads((results_dir / f"{name}.json").read_text())) for name in names]
    return "\n".join([HEADER, *rows])


if __name__ == "__main__":
    print(table(names=sys.argv[1:] or None))
