"""Independent stages in parallel (spec `max_parallel_stages`): which stages the pipeline flow
starts, what a failure stops, the running stages' progress in the run summary, and the summary's
per-stage fields in `posttrain status`."""

from __future__ import annotations

import sys
from concurrent.futures import Future

import pytest
import yaml

from artifacts.store import Store
from flows.cli.main import main
from flows.cli.report import print_stage_table
from flows.post_train import StageRun, Watch, post_train, stages_to_start, stopped_by_failures
from flows.spec import parse_spec, stage_graph
from tasks.runtime.live import progress_path

# a -> b -> c, and x -> y beside it; d reads both branches
GRAPH = {"a": [], "x": [], "b": ["a"], "y": ["x"], "c": ["b"], "d": ["c", "y"]}


def schedule(graph: dict[str, list[str]], limit: int, failing: set[str] = frozenset()) -> list[list[str]]:
    """Run `graph` with stages_to_start, every running stage ending at each tick (those in `failing`
    fail): the stages running at each tick."""
    done, failed, ticks = set(), set(), []
    while True:
        running = stages_to_start(graph, done, failed, set(), limit)
        if not running:
            return ticks
        ticks.append(running)
        failed |= set(running) & failing
        done |= set(running) - failing


def test_with_one_at_a_time_stages_run_in_topological_order():
    assert schedule(GRAPH, limit=1) == [["a"], ["x"], ["b"], ["y"], ["c"], ["d"]]


def test_every_stage_whose_inputs_are_committed_starts_up_to_the_limit():
    assert schedule(GRAPH, limit=2) == [["a", "x"], ["b", "y"], ["c"], ["d"]]
    assert schedule(GRAPH, limit=8) == [["a", "x"], ["b", "y"], ["c"], ["d"]]


def test_running_stages_take_their_slots():
    assert stages_to_start(GRAPH, done=set(), failed=set(), running={"a"}, limit=2) == ["x"]
    assert stages_to_start(GRAPH, done=set(), failed=set(), running={"a", "x"}, limit=2) == []
    assert stages_to_start(GRAPH, done={"a"}, failed=set(), running={"x"}, limit=3) == ["b"]


def test_a_failure_stops_only_its_dependents():
    assert schedule(GRAPH, limit=2, failing={"a"}) == [["a", "x"], ["y"]]
    assert stopped_by_failures(GRAPH, {"a"}) == ["b", "c", "d"]
    assert stages_to_start(GRAPH, done={"x"}, failed={"a"}, running=set(), limit=2) == ["y"]
    assert stopped_by_failures(GRAPH, {"y"}) == ["d"]
    assert stopped_by_failures(GRAPH, set()) == []


def test_a_failure_with_one_at_a_time_runs_the_rest_in_order():
    assert schedule(GRAPH, limit=1, failing={"b"}) == [["a"], ["x"], ["b"], ["y"]]
    assert stopped_by_failures(GRAPH, {"b"}) == ["c", "d"]


SPEC = {
    "name": "t", "store": "file:///unused",
    "envs": {"arith": {"kind": "arith", "digits": 2}, "calc": {"kind": "calc"}},
    "stages": [
        {"id": "sft", "kind": "sft", "data": ["warm-a", "warm-c", "warm-a"], "max_steps": 2},
        {"id": "warm-a", "kind": "synthesize", "env": "arith", "n": 10},
        {"id": "warm-c", "kind": "synthesize", "env": "calc", "n": 10},
        {"id": "eval", "kind": "evaluate", "checkpoints": ["sft"], "envs": ["arith"], "n": 4},
    ],
}


def test_the_stage_graph_of_a_spec_is_in_topological_order_each_input_once():
    spec = parse_spec(SPEC)
    assert spec.max_parallel_stages == 1
    assert stage_graph(spec) == {"warm-a": [], "warm-c": [], "sft": ["warm-a", "warm-c"], "eval": ["sft"]}
    assert parse_spec({**SPEC, "max_parallel_stages": 2}).max_parallel_stages == 2


@pytest.mark.parametrize("value, message", [
    (0, "max_parallel_stages: Input should be greater than or equal to 1 (got 0)"),
    ("two", "max_parallel_stages: Input should be a valid integer"),
])
def test_a_bad_max_parallel_stages_is_one_line(value, message, tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({**SPEC, "max_parallel_stages": value}))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {message}") and len(err.splitlines()) == 1, err


def test_validate_says_how_many_stages_run_at_once(tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({**SPEC, "max_parallel_stages": 3}))
    assert main(["validate", str(path)]) == 0
    assert "stages (run order, up to 3 at once):" in capsys.readouterr().out


def test_the_flows_task_runner_does_not_cap_parallel_stages():
    # the flow caps them (max_parallel_stages); PREFECT_TASKS_RUNNER_THREAD_POOL_MAX_WORKERS must not
    assert post_train.task_runner.duplicate()._max_workers == sys.maxsize


def running_stage(stage_id: str) -> StageRun:
    return StageRun(stage_id, Future(), dict)


def test_the_watch_folds_every_running_stages_progress_into_the_summary(tmp_path):
    store = Store(f"file://{tmp_path}")
    summary = {"run_id": "r1", "stages": []}
    running = {"sft": running_stage("sft"), "gen": running_stage("gen"), "eval": running_stage("eval")}
    store.write_json(progress_path(store, "r1", "sft"), {"step": 3, "total": 10, "eta_seconds": 7.0, "metrics": {}})
    store.write_json(progress_path(store, "r1", "gen"), {"step": 1, "total": 4, "eta_seconds": None})
    Watch(store, summary).look(list(running))
    expected = {"sft": {"step": 3, "total": 10, "eta_seconds": 7.0}, "gen": {"step": 1, "total": 4, "eta_seconds": None}}
    assert summary["running"] == expected  # eval has not reported yet
    assert store.read_json(store.path("runs", "r1.json"))["running"] == expected

    running["gen"].ended.set_result(None)
    assert Watch(store, summary).until_one_ends(running) == ["gen"]
    assert summary["running"] == {"sft": expected["sft"]}
    del running["gen"]  # as the flow does with an ended stage
    running["sft"].ended.set_result(None)
    running["eval"].ended.set_result(None)
    assert Watch(store, summary).until_one_ends(running) == ["sft", "eval"]
    assert "running" not in summary


def test_the_watch_writes_the_summary_only_when_progress_changed(tmp_path):
    store = Store(f"file://{tmp_path}")
    summary = {"run_id": "r1", "stages": []}
    Watch(store, summary).look(["sft"])
    assert "running" not in summary and not store.exists(store.path("runs", "r1.json"))


def test_status_shows_each_stages_device_and_peak_memory(capsys):
    stage = {"kind": "sft", "state": "completed", "seconds": 12.0, "outputs": {"checkpoint": "t/sft@0123"}}
    print_stage_table({"stages": [{**stage, "id": "sft", "device": "cuda:0", "peak_rss_gb": 2.04, "peak_gpu_gb": 5.55},
                                  {**stage, "id": "cpu-sft", "device": "cpu", "peak_rss_gb": 1.5},
                                  {**stage, "id": "old"}], "not_run": []})
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert lines[0] == ["stage", "kind", "state", "seconds", "device", "RAM", "GB", "GPU", "GB", "outputs"]
    assert lines[1] == ["sft", "sft", "completed", "12.0", "cuda:0", "2.0", "5.5", "t/sft@0123"]
    assert lines[2] == ["cpu-sft", "sft", "completed", "12.0", "cpu", "1.5", "-", "t/sft@0123"]
    assert lines[3] == ["old", "sft", "completed", "12.0", "-", "-", "-", "t/sft@0123"]
