"""The evaluation's paired statistics: the gain of a checkpoint over the previous one on the same
tasks, and the standard error of that paired difference."""

import math
import statistics

from tasks.stages.evaluate import add_paired_gains, paired_difference, summarize


def test_paired_difference_is_the_mean_and_standard_error_of_the_per_task_differences():
    before, after = [1, 0, 0, 1, 0, 1, 0, 0], [1, 1, 0, 0, 1, 1, 1, 0]
    differences = [a - b for a, b in zip(after, before)]
    gain, se = paired_difference(before, after)
    assert math.isclose(gain, statistics.mean(differences))
    assert math.isclose(se, statistics.stdev(differences) / math.sqrt(len(differences)))
    assert paired_difference([0, 1], [0, 1]) == (0.0, 0.0)  # the same answers: no gain, no spread
    assert paired_difference([0], [1]) == (1.0, 0.0)


def _rows(checkpoint, env, correct):
    return [{"checkpoint": checkpoint, "env": env, "mode": mode, "task_id": f"t{i}", "correct": bool(c)}
            for i, c in enumerate(correct) for mode in ("greedy", "sampled")]


def test_each_checkpoint_gets_its_gain_over_the_one_before_it_on_the_same_tasks():
    rows = _rows("sft", "term", [0, 0, 1, 0]) + _rows("rl", "term", [1, 0, 1, 1]) + \
        _rows("sft", "search", [1, 1, 0, 0]) + _rows("rl", "search", [1, 0, 0, 0])
    metrics = {"sft": {"term": {}, "search": {}}, "rl": {"term": {}, "search": {}}}
    add_paired_gains(metrics, rows)
    assert metrics["sft"] == {"term": {}, "search": {}}  # the first checkpoint has nothing to gain over
    assert metrics["rl"]["term"]["paired_gain"] == 0.5
    assert math.isclose(metrics["rl"]["term"]["paired_se"], round(statistics.stdev([1, 0, 0, 1]) / 2, 4))
    assert metrics["rl"]["search"]["paired_gain"] == -0.25
    # the sampled rows (here the same answers) are paired the same way
    assert metrics["rl"]["term"]["sampled_paired_gain"] == 0.5
    assert metrics["rl"]["term"]["sampled_paired_se"] == metrics["rl"]["term"]["paired_se"]


def test_greedy_rows_alone_give_no_sampled_gain():
    rows = [row for row in _rows("sft", "term", [0, 1]) + _rows("rl", "term", [1, 1]) if row["mode"] == "greedy"]
    metrics = {"sft": {"term": {}}, "rl": {"term": {}}}
    add_paired_gains(metrics, rows)
    assert metrics["rl"]["term"] == {"paired_gain": 0.5, "paired_se": 0.5}


def test_the_summary_carries_the_accuracy_standard_error():
    greedy = [{"correct": c, "formatted": True, "doom_loop": False, "completion_tokens": 3, "finish_reason": "stop",
               "turns": 1, "reward": float(c), "reward_errors": 0, "reward_not_applied": 0} for c in (1, 1, 0, 0)]
    summary = summarize(greedy, [])
    assert summary["accuracy"] == 0.5 and summary["accuracy_se"] == 0.25


def test_with_a_baseline_every_other_checkpoint_is_paired_with_it():
    rows = _rows("sft", "term", [0, 0, 0, 0]) + _rows("align", "term", [1, 0, 0, 0]) + _rows("rl", "term", [1, 1, 1, 0])
    metrics = {"sft": {"term": {}}, "align": {"term": {}}, "rl": {"term": {}}}
    add_paired_gains(metrics, rows, baseline="align")
    assert metrics["align"] == {"term": {}}
    assert metrics["sft"]["term"]["paired_gain"] == -0.25 and metrics["rl"]["term"]["paired_gain"] == 0.5
