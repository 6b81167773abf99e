"""`python -m bench [NAME ...]`: run every benchmark (or the named ones) with its default
arguments, then print one table. `make bench` runs them all, `make bench NAME=grpo_vs_trl` one."""

from __future__ import annotations

import importlib
import sys

# Each module has `main(argv) -> result dict` and writes bench/results/<name>.json.
BENCHES = ("sft_vs_trl", "dpo_vs_trl", "grpo_vs_trl", "overhead", "rl_seeds", "contracts", "generate",
           "scale", "serve_batching", "rl_async", "agentic_seeds", "learned_rewards")

COLUMNS = ("name", "metric", "ours", "peer", "ratio")


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}" if value < 100 else f"{value:,.0f}"
    return str(value)


def table(rows: list[dict]) -> str:
    cells = [COLUMNS] + [tuple(_cell(row[c]) for c in COLUMNS) for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def main(names: list[str] | None = None) -> list[dict]:
    names = names or list(BENCHES)
    unknown = [name for name in names if name not in BENCHES]
    if unknown:
        print(f"bench: no benchmark {unknown[0]!r}; one of: {', '.join(BENCHES)}", file=sys.stderr)
        raise SystemExit(2)
    rows = []
    for name in names:
        result = importlib.import_module(f"bench.{name}").main([])
        rows.append({"name": name, **result})
    print()
    print(table(rows))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
