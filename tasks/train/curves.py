"""A training stage's report: its step metrics as JSONL, a PNG of their curves and a markdown summary.

The folder this writes (metrics.jsonl, curves.png, report.md) is what a stage commits as its
`report` output; the flow shows report.md as a Prefect artifact (flows/report_artifacts.py). At
each in-stage checkpoint `report_so_far` renders the same report of the steps so far, its curves
inline, which the orchestrator shows under the same artifact key.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

# a `held_out/<metric>` (tasks/train/held_out.py) is drawn as series `held_out` beside the training one
PLOTTED_METRICS = ("reward", "accuracy", "kl", "doom_loop_rate", "clip_fraction", "entropy",
                   "tokens_per_second", "loss", "reward_accuracy")
COLUMNS = 3
METRICS_LINK = "\nEvery step's metrics: [metrics.jsonl](metrics.jsonl)\n"


def write_training_report(history: list[dict], out_dir: Path, title: str) -> None:
    """Write metrics.jsonl, curves.png and report.md for a stage's step history into `out_dir`."""
    out_dir = Path(out_dir)
    markdown = curves_and_markdown(history, out_dir, title)
    write_metrics_jsonl(history, out_dir / "metrics.jsonl")
    (out_dir / "report.md").write_text(markdown + METRICS_LINK)


def curves_and_markdown(history: list[dict], out_dir: Path, title: str, note: str = "") -> str:
    """Draw curves.png into `out_dir`; return the report's markdown (`note` under the title)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    series = metric_series(history)
    plot_curves(series, out_dir / "curves.png", title)
    return report_markdown(series, title, len(history), note)


def report_so_far(history: list[dict], work_dir: Path, title: str, note: str) -> str:
    """The report of the steps so far as markdown with its curves inline (a data: URI): what an
    in-stage checkpoint shows in the Prefect UI. The PNG is drawn into `work_dir`; `note` says
    where the stage is."""
    from tasks.common.report_images import inline_images, unlink_relative

    work_dir = Path(work_dir)
    markdown = curves_and_markdown(history, work_dir, title, note)
    return unlink_relative(inline_images(markdown, lambda name: (work_dir / name).read_bytes()))


def write_metrics_jsonl(history: list[dict], path: Path) -> None:
    # NaN/inf are not JSON: they become null so that strict readers (jq, pandas, browsers) load the file.
    lines = [json.dumps({k: _json_safe(v) for k, v in entry.items()}, allow_nan=False) for entry in history]
    path.write_text("".join(line + "\n" for line in lines))


def metric_series(history: list[dict]) -> dict[str, dict[str, tuple[list, list]]]:
    """{metric: {series label: (steps, values)}} of the plotted metrics, finite values only.

    A metric's plain key is the series labelled ""; "<env>/<metric>" keys are series labelled <env>.
    Metrics without a single finite value are left out.
    """
    series: dict[str, dict[str, tuple[list, list]]] = {}
    for index, entry in enumerate(history):
        step = entry.get("step", index + 1)
        for key, value in entry.items():
            label, _, metric = key.rpartition("/")
            if metric not in PLOTTED_METRICS or not _is_finite_number(value):
                continue
            steps, values = series.setdefault(metric, {}).setdefault(label, ([], []))
            steps.append(step)
            values.append(float(value))
    return {metric: dict(sorted(series[metric].items())) for metric in PLOTTED_METRICS if metric in series}


def plot_curves(series: dict, path: Path, title: str) -> None:
    """One small subplot per metric, x = step; per-env series share their metric's subplot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # A bare Figure on an Agg canvas: no pyplot, so no global figure registry or GUI backend.
    columns = max(1, min(COLUMNS, len(series)))
    rows = max(1, math.ceil(len(series) / columns))
    figure = Figure(figsize=(3.6 * columns, 2.4 * rows + 0.4), dpi=100)
    FigureCanvasAgg(figure)
    figure.suptitle(title, fontsize=10)
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for ax, (metric, by_label) in zip(axes, series.items()):
        for label, (steps, values) in by_label.items():
            ax.plot(steps, values, linewidth=1, label=label or "all")
        ax.set_title(metric, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.locator_params(nbins=4)  # fewer ticks: drawing tick objects is most of the render time
        ax.grid(alpha=0.3)
        if len(by_label) > 1:
            ax.legend(fontsize=7)
    for ax in axes[len(series):]:
        ax.set_axis_off()
    if not series:
        axes[0].text(0.5, 0.5, "no metrics recorded", ha="center", va="center")
    axes[-columns].set_xlabel("step", fontsize=8)
    figure.subplots_adjust(left=0.08, right=0.98, bottom=0.12 if rows == 1 else 0.08, top=0.85 if rows == 1 else 0.9,
                           wspace=0.25, hspace=0.45)
    figure.savefig(path, format="png")


def report_markdown(series: dict, title: str, n_steps: int, note: str = "") -> str:
    lines = [f"# {title}", "", *([note, ""] if note else []), f"{n_steps} logged steps.", ""]
    if series:
        lines += ["| metric | first | last | min | max |", "|---|---|---|---|---|"]
        for metric, by_label in series.items():
            for label, (_, values) in by_label.items():
                name = f"{label}/{metric}" if label else metric
                cells = [_format(v) for v in (values[0], values[-1], min(values), max(values))]
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append("![curves](curves.png)")
    return "\n".join(lines) + "\n"


def _is_finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _json_safe(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _format(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
