"""Learning curves: a training stage's held-out accuracy per env, checkpoint by checkpoint (per
benchmark, its headline metric: an lm-eval task's first metric, HumanEval's pass@k of its first k).

The points are the evaluations the pipeline already makes (`evaluation.on_new_checkpoint`, with
`evaluation.stages` to pick the stages): each in-stage checkpoint (`rl.step-50`), the stage's
final one, and, at step 0, the checkpoint the stage started from when it was evaluated too. They
are read from the store's evaluation results (flows/leaderboard.py), so a curve is the same
whether the evaluations ran inline or in triggered flow runs, and a resumed stage's curve keeps
the checkpoints of the run that was killed (one curve per stage cache key).
"""

from __future__ import annotations

import base64
import io
from collections import defaultdict
from dataclasses import dataclass

from artifacts.refs import Ref
from artifacts.store import Store
from flows.leaderboard import evaluations
from tasks.common.report_images import prefect_key


@dataclass(frozen=True)
class CurvePoint:
    step: int
    checkpoint: str  # its ref
    accuracy: float

    @property
    def label(self) -> str:
        """The checkpoint's name within its pipeline: `align`, `rl.step-50`."""
        return Ref.parse(self.checkpoint).name.split("/", 1)[-1]


@dataclass(frozen=True)
class LearningCurve:
    stage: str
    cache_key: str
    env: str
    n: int  # held-out tasks per evaluation
    points: list[CurvePoint]

    def as_dict(self) -> dict:
        """The curve as the run summary keeps it (`learning_curves`)."""
        return {"stage": self.stage, "cache_key": self.cache_key, "env": self.env, "n": self.n,
                "points": [{"step": p.step, "checkpoint": p.checkpoint, "accuracy": p.accuracy} for p in self.points]}

    @classmethod
    def from_dict(cls, curve: dict) -> LearningCurve:
        return cls(curve["stage"], curve["cache_key"], curve["env"], curve["n"],
                   [CurvePoint(p["step"], p["checkpoint"], p["accuracy"]) for p in curve["points"]])

    def line(self) -> str:
        """`rl on arith (n=200): 0 align 64.0% · 50 80.5% · 150 rl 90.0%`"""
        points = " · ".join(f"{p.step}{'' if '.step-' in p.label else ' ' + p.label} {p.accuracy:.1%}"
                            for p in self.points)
        return f"{self.stage} on {self.env} (n={self.n}): {points}"


def learning_curves(rows: list[dict], cache_keys: set[str] | None = None) -> list[LearningCurve]:
    """The curves of the evaluation rows `rows` (leaderboard.evaluations), one per (stage cache
    key, env, n) with at least two points; only the stages of `cache_keys` if given."""
    evaluated = {(row["checkpoint"], row["env"], row["n"]): row for row in rows}
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        if row["step"] is not None and row["cache_key"] and (cache_keys is None or row["cache_key"] in cache_keys):
            groups[(row["cache_key"], row["env"], row["n"])].append(row)
    curves = []
    for (cache_key, env, n), members in groups.items():
        members.sort(key=lambda row: row["step"])
        last = members[-1]
        start = next((evaluated[(ref, env, n)] for ref in last["inputs"] if (ref, env, n) in evaluated), None)
        points = ([CurvePoint(0, start["checkpoint"], start["headline"])] if start is not None else []) + \
            [CurvePoint(row["step"], row["checkpoint"], row["headline"]) for row in members]
        if len(points) >= 2:
            curves.append(LearningCurve(last["stage"], cache_key, env, n, points))
    return sorted(curves, key=lambda curve: (evaluated[(curve.points[-1].checkpoint, curve.env, curve.n)]["created"],
                                             curve.env))


def curves_markdown(curves: list[LearningCurve], image_uri: str | None) -> str:
    lines = ["# Learning curves", "", "Held-out accuracy (greedy) at each evaluated checkpoint of a stage; "
             "step 0 is the checkpoint it started from.", ""]
    if image_uri:
        lines += [f"![learning curves]({image_uri})", ""]
    lines += ["| stage | env | n | step | checkpoint | accuracy |", "|---|---|---|---|---|---|"]
    lines += [f"| {curve.stage} | {curve.env} | {curve.n} | {point.step} | {point.label} | {point.accuracy:.1%} |"
              for curve in curves for point in curve.points]
    return "\n".join(lines) + "\n"


def curves_png(curves: list[LearningCurve]) -> bytes:
    """One line per curve: accuracy against step."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.0, 3.6), dpi=100)
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    for curve in curves:
        ax.plot([p.step for p in curve.points], [p.accuracy for p in curve.points], marker="o",
                label=f"{curve.stage} · {curve.env}")
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel("held-out accuracy", fontsize=8)
    ax.set_ylim(0, 1)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def publish_stage_curves(store: Store, pipeline: str, checkpoint_ref: str) -> str | None:
    """The curves of the stage that made `checkpoint_ref` as a Prefect markdown artifact (inside a
    flow or task run), their picture inline. Like a report, one that cannot be published is
    logged, not raised: the evaluation is committed, and a display problem must not fail its run."""
    from prefect import get_run_logger
    from prefect.artifacts import create_markdown_artifact

    try:
        producer = store.manifest(Ref.parse(checkpoint_ref))["producer"]
        curves = learning_curves(evaluations(store, pipeline), {producer["cache_key"]})
        if not curves:
            return None
        key = prefect_key(pipeline, producer["stage_id"], "learning-curves")
        image = "data:image/png;base64," + base64.b64encode(curves_png(curves)).decode()
        create_markdown_artifact(markdown=curves_markdown(curves, image), key=key,
                                 description=f"held-out accuracy per checkpoint of {pipeline}/{producer['stage_id']}")
    except Exception as exc:  # noqa: BLE001
        get_run_logger().warning(f"learning curves of {checkpoint_ref} not published: {type(exc).__name__}: {exc}")
        return None
    return key
