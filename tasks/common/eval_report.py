"""An evaluation's report: a markdown table of every checkpoint × env (and benchmark) and a PNG of its rates.

The folder this writes (report.md, evaluation.png, metrics.json) is the `report` output of an
evaluation; the flows publish report.md as a Prefect artifact, the chart inline
(flows/report_artifacts.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tasks.common.benchmarks import is_benchmark

RATES = ("accuracy", "format_rate", "doom_loop_rate")  # plotted: all in [0, 1]
TABLE_COLUMNS = ("accuracy", "accuracy_se", "paired_gain", "paired_se", "sampled_accuracy", "sampled_paired_gain",
                 "sampled_paired_se", "format_rate", "doom_loop_rate", "truncated_rate", "mean_completion_tokens",
                 "mean_turns", "n")
# Above this share of a checkpoint's greedy episodes on an env left unfinished (not by a doom loop),
# its accuracy measures the caps as much as the model: at 96 tokens 65 % of the held-out rlm
# episodes were cut off mid code cell, and it went unnoticed for several runs.
UNFINISHED_WARNING = 0.2


def unfinished_warnings(metrics: dict[str, dict[str, dict]], max_new_tokens: int) -> list[str]:
    """A line for each checkpoint and env where over UNFINISHED_WARNING of the greedy episodes
    ended unfinished but not in a doom loop (a loop is truncated too; no cap mends it): an action
    reached max_new_tokens, or the episode its env's max_turns. Accuracy counts each as failed."""
    lines = []
    for key, by_env in metrics.items():
        for env_id, values in by_env.items():
            if is_benchmark(env_id):
                continue
            unfinished = values["truncated_rate"] - values["doom_loop_rate"]
            if unfinished > UNFINISHED_WARNING:
                lines.append(f"{key} on {env_id}: {unfinished:.0%} of the episodes ended unfinished without a doom "
                             f"loop (an action reached max_new_tokens={max_new_tokens}, or the episode the env's "
                             f"max_turns) and count as failed: raise the cap that binds")
    return lines


def write_eval_report(metrics: dict[str, dict[str, dict]], checkpoints: dict[str, str], out_dir: Path,
                      title: str, warnings: list[str] = ()) -> None:
    """`metrics` is {checkpoint key: {env id: metrics}}; `checkpoints` maps each key to its ref."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    document = {"checkpoints": checkpoints, "metrics": _finite(metrics)}  # NaN is not JSON: null
    (out_dir / "metrics.json").write_text(json.dumps(document, indent=2, sort_keys=True, allow_nan=False))
    plot_rates(metrics, out_dir / "evaluation.png", title)
    (out_dir / "report.md").write_text(report_markdown(metrics, checkpoints, title, warnings))


def report_markdown(metrics: dict, checkpoints: dict[str, str], title: str, warnings: list[str] = ()) -> str:
    lines = [f"# {title}", ""]
    if warnings:
        lines += ["**Warnings**", "", *(f"- {warning}" for warning in warnings), ""]
    lines += ["| checkpoint | env | " + " | ".join(TABLE_COLUMNS) + " |", "|---|---|" + "---:|" * len(TABLE_COLUMNS)]
    for key, by_env in metrics.items():
        for env_id, values in envs_of(by_env).items():
            cells = [_cell(values.get(column)) for column in TABLE_COLUMNS]
            lines.append(f"| `{checkpoints[key]}` | {env_id} | " + " | ".join(cells) + " |")
    benchmarks = [(key, name, values) for key, by_env in metrics.items() for name, values in by_env.items()
                  if is_benchmark(name)]
    if benchmarks:
        lines += ["", "| checkpoint | benchmark | metrics |", "|---|---|---|"]
        lines += [f"| `{checkpoints[key]}` | {name} | " + " · ".join(f"{metric} {_cell(value)}" for metric, value
                                                                      in values.items()) + " |"
                  for key, name, values in benchmarks]
    lines += ["", "![rates](evaluation.png)", "", "As JSON: [metrics.json](metrics.json)", ""]
    return "\n".join(lines)


def plot_rates(metrics: dict, path: Path, title: str) -> None:
    """One subplot per rate; a bar per (checkpoint, env)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metrics = {key: envs_of(by_env) for key, by_env in metrics.items()}  # a benchmark has no such rates
    labels = [f"{key}\n{env_id}" for key, by_env in metrics.items() for env_id in by_env]
    figure = Figure(figsize=(max(4.0, 1.1 * len(labels)) * len(RATES) / 2, 3.2), dpi=100)
    FigureCanvasAgg(figure)
    figure.suptitle(title, fontsize=10)
    for ax, rate in zip(figure.subplots(1, len(RATES), squeeze=False).ravel(), RATES):
        values = [by_env[env_id].get(rate, math.nan) for by_env in metrics.values() for env_id in by_env]
        ax.bar(range(len(values)), [0 if math.isnan(v) else v for v in values])
        ax.set_xticks(range(len(values)), labels, fontsize=6)
        ax.set_ylim(0, 1)
        ax.set_title(rate, fontsize=9)
        ax.tick_params(labelsize=7)
    figure.tight_layout()
    figure.savefig(path)


def envs_of(by_env: dict[str, dict]) -> dict[str, dict]:
    """The envs' metrics of a checkpoint, without its benchmarks'."""
    return {env_id: values for env_id, values in by_env.items() if not is_benchmark(env_id)}


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.3f}"
    return str(value)


def _finite(value):
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return None if isinstance(value, float) and not math.isfinite(value) else value
