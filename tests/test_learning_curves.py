"""Learning curves from evaluation rows: one per stage run (cache key), env and n, from the
checkpoint the stage started from (step 0) to its final one."""

from flows.learning_curves import LearningCurve, curves_markdown, curves_png, learning_curves
from flows.spec import EvaluationConfig


def row(checkpoint, step, accuracy, cache_key, inputs=(), n=200, env="arith", created="2026-12-06T10:00:00"):
    stage = checkpoint.split("/")[1].split("@")[0].split(".")[0]
    return {"checkpoint": checkpoint, "env": env, "n": n, "accuracy": accuracy, "headline": accuracy, "step": step,
            "cache_key": cache_key, "stage": stage, "inputs": list(inputs), "created": created}


ALIGN = "qs/align@" + "a" * 16
ROWS = [
    row(ALIGN, 30, 0.64, "k-align"),
    row("qs/rl.step-50@" + "b" * 16, 50, 0.80, "k-rl", [ALIGN], created="2026-12-06T10:01:00"),
    row("qs/rl@" + "d" * 16, 150, 0.90, "k-rl", [ALIGN], created="2026-12-06T10:03:00"),
    # a resumed run's checkpoint: made by an earlier run, the same stage cache key
    row("qs/rl.step-100@" + "c" * 16, 100, 0.85, "k-rl", [ALIGN], created="2026-12-06T09:00:00"),
    row("qs/rl.step-50@" + "b" * 16, 50, 0.75, "k-rl", [ALIGN], n=20),  # another n: its own curve (of one point)
    row("qs/rl@" + "e" * 16, 150, 0.70, "k-other", ["qs/sft@" + "f" * 16]),  # started from an unevaluated one
    {**row("qs/imported@" + "9" * 16, None, 0.5, "k-imp")},  # no step: no curve
]


def test_a_curve_runs_from_the_start_checkpoint_through_every_evaluated_one_of_the_stage():
    curves = learning_curves(ROWS)
    assert [(c.stage, c.cache_key, c.n) for c in curves] == [("rl", "k-rl", 200)]
    (curve,) = curves
    assert [(p.step, p.label, p.accuracy) for p in curve.points] == [
        (0, "align", 0.64), (50, "rl.step-50", 0.80), (100, "rl.step-100", 0.85), (150, "rl", 0.90)]
    assert curve.line() == "rl on arith (n=200): 0 align 64.0% · 50 80.0% · 100 85.0% · 150 rl 90.0%"
    assert LearningCurve.from_dict(curve.as_dict()) == curve


def test_curves_keep_only_the_stages_asked_for():
    assert learning_curves(ROWS, {"k-align", "k-other"}) == []
    assert [c.cache_key for c in learning_curves(ROWS, {"k-rl"})] == ["k-rl"]


def test_curves_render_as_a_table_and_a_picture():
    curves = learning_curves(ROWS)
    markdown = curves_markdown(curves, "data:image/png;base64,AAAA")
    assert "| rl | arith | 200 | 0 | align | 64.0% |" in markdown
    assert "| rl | arith | 200 | 150 | rl | 90.0% |" in markdown
    assert "![learning curves](data:image/png;base64,AAAA)" in markdown
    assert curves_png(curves).startswith(b"\x89PNG")


def test_evaluation_stages_pick_whose_checkpoints_are_evaluated():
    assert EvaluationConfig(on_new_checkpoint=True).evaluates("sft")
    picked = EvaluationConfig(on_new_checkpoint=True, stages=["rl"])
    assert picked.evaluates("rl") and not picked.evaluates("align")
    assert not EvaluationConfig(stages=["rl"]).evaluates("rl")
