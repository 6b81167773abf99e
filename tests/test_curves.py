import json
import math

from tasks.train.curves import metric_series, report_markdown, write_training_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def rl_history(steps=30):
    return [{"step": s, "loss": 1 / s, "reward": s / steps, "arith/reward": s / steps / 2,
             "search/reward": 0.25, "kl": float("nan"), "entropy": None, "lr": 1e-5} for s in range(1, steps + 1)]


def test_writes_jsonl_png_and_markdown(tmp_path):
    history = rl_history()
    write_training_report(history, tmp_path / "report", "rl (grpo)")
    folder = tmp_path / "report"
    assert sorted(p.name for p in folder.iterdir()) == ["curves.png", "metrics.jsonl", "report.md"]
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 31))
    assert rows[0]["kl"] is None and rows[0]["arith/reward"] == history[0]["arith/reward"]  # NaN -> null
    assert (folder / "curves.png").read_bytes().startswith(PNG_SIGNATURE)
    report = (folder / "report.md").read_text()
    assert report.startswith("# rl (grpo)\n") and "![curves](curves.png)" in report


def test_report_table_has_first_last_min_max_of_plotted_metrics_only():
    history = [{"step": 1, "reward": 0.5, "lr": 1.0}, {"step": 2, "reward": 0.1}, {"step": 3, "reward": 0.9}]
    table = report_markdown(metric_series(history), "sft", len(history))
    assert "| reward | 0.5 | 0.9 | 0.1 | 0.9 |" in table
    assert "lr" not in table and "3 logged steps" in table


def test_per_env_keys_join_their_base_metric_and_absent_or_nan_metrics_are_skipped():
    series = metric_series(rl_history())
    assert list(series) == ["reward", "loss"]  # PLOTTED_METRICS order; kl all-NaN, entropy all-None
    assert list(series["reward"]) == ["", "arith", "search"]
    steps, values = series["reward"]["arith"]
    assert steps[:2] == [1, 2] and math.isclose(values[-1], 0.5)
    table = report_markdown(series, "rl", 30)
    assert "| arith/reward |" in table and "| kl |" not in table


def test_history_without_steps_or_metrics_still_writes_a_report(tmp_path):
    write_training_report([{"lr": 0.1}, {"lr": 0.2}], tmp_path, "empty")
    assert (tmp_path / "curves.png").read_bytes().startswith(PNG_SIGNATURE)
    assert "| metric |" not in (tmp_path / "report.md").read_text()
    assert metric_series([{"loss": 2.0}, {"loss": 1.0}])["loss"][""][0] == [1, 2]  # step = position
