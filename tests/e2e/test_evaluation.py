"""The evaluation flow in ephemeral mode (no Prefect server): inline after each new checkpoint,
by hand with `posttrain eval` (cached when repeated), in `posttrain status`, and its bad input.
The run it evaluates also has a stage beside warmup -> sft, which runs at once with warmup
(`max_parallel_stages: 2`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from artifacts.store import Store
from conftest import free_port
from e2e.helpers import EPHEMERAL, by_id, concurrently, posttrain, summary, tiny_spec, write

EVALUATION = {"on_new_checkpoint": True, "n": 8, "max_new_tokens": 16}
SIDE = {"id": "side", "kind": "synthesize", "env": "arith", "n": 64}  # beside warmup -> sft: both start at once


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("evaluation")
    store = tmp_path / "store"
    spec = tiny_spec(f"file://{store}", sft={"max_steps": 6, "checkpoint_every": 3}, evaluation=EVALUATION,
                     max_parallel_stages=2)
    spec["stages"] = [*spec["stages"][:2], SIDE]
    spec_path = write(tmp_path, spec)
    run = posttrain("run", spec_path, "--summary-json", tmp_path / "run.json", env=EPHEMERAL)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return store, run, summary(tmp_path / "run.json"), spec_path


def files(store: Path) -> list[str]:
    return sorted(str(p.relative_to(store)) for p in store.rglob("*"))


def test_ephemeral_mode_evaluates_each_new_checkpoint_inline_and_says_so(evaluated_run):
    store, run, run_summary, _ = evaluated_run
    assert "ephemeral mode): each new checkpoint is evaluated inline" in run.stdout
    sft = by_id(run_summary)["sft"]
    checkpoints = [*sft["metrics"]["promoted_checkpoints"], sft["outputs"]["checkpoint"]]
    assert len(checkpoints) == 2
    assert [e["checkpoint"] for e in run_summary["evaluations"]] == checkpoints  # step-3, then the final one
    artifact_store = Store(f"file://{store}")
    for evaluation in run_summary["evaluations"]:
        assert evaluation["state"] == "completed" and set(evaluation["metrics"]) == {"arith"}
        assert evaluation["metrics"]["arith"]["n"] == 8
        assert evaluation["compute_seconds"] > 0  # the evaluate stage's own time (bench/overhead.py counts it)
        results = artifact_store.manifest(evaluation["results"])
        assert results["name"] == evaluation["checkpoint"].split("@")[0] + ".eval"
        assert evaluation["checkpoint"] in results["inputs"].values()  # lineage: results <- checkpoint
        assert results["metrics"]["contract"]["success"]  # through the evaluation contract
        report = artifact_store.manifest(evaluation["report"])
        assert {f["path"] for f in report["files"]} == {"report.md", "evaluation.png", "metrics.json"}
        assert evaluation["checkpoint"] in report["inputs"].values()
    assert "evaluated inline (evaluation.on_new_checkpoint, ephemeral mode):" in run.stdout
    for evaluation in run_summary["evaluations"]:
        accuracy = evaluation["metrics"]["arith"]["accuracy"]
        assert f"  {evaluation['checkpoint']}: completed, accuracy arith {accuracy:.1%} -> {evaluation['results']}" \
            in run.stdout


def test_the_run_draws_the_learning_curve_of_its_evaluated_checkpoints(evaluated_run):
    store, run, run_summary, _ = evaluated_run
    (curve,) = run_summary["learning_curves"]
    accuracies = [e["metrics"]["arith"]["accuracy"] for e in run_summary["evaluations"]]
    assert (curve["stage"], curve["env"], curve["n"]) == ("sft", "arith", 8)
    assert [(p["step"], p["accuracy"]) for p in curve["points"]] == [(3, accuracies[0]), (6, accuracies[1])]
    line = f"  sft on arith (n=8): 3 {accuracies[0]:.1%} · 6 sft {accuracies[1]:.1%}"
    assert line in run.stdout.splitlines()
    status = posttrain("status", run_summary["run_id"], "--store", f"file://{store}")
    assert status.returncode == 0 and line in status.stdout.splitlines()


def test_independent_stages_run_at_once_and_every_record_has_its_times(evaluated_run):
    _, _, run_summary, _ = evaluated_run
    stages = by_id(run_summary)
    assert set(stages) == {"warmup", "side", "sft"} and run_summary["not_run"] == []
    for stage in stages.values():
        assert run_summary["started"] <= stage["started"] <= stage["finished"] <= run_summary["finished"]
    warmup, side = (stages[stage_id] for stage_id in ("warmup", "side"))
    # one at a time, side would run last (the spec's order); its stage takes about a second, the times' resolution
    assert [stage["id"] for stage in run_summary["stages"]].index("side") < 2
    assert max(warmup["started"], side["started"]) <= min(warmup["finished"], side["finished"])
    assert stages["sft"]["started"] >= warmup["finished"]


def test_eval_by_hand_is_cached_for_the_same_settings_and_listed_in_status(evaluated_run):
    store, _, run_summary, _ = evaluated_run
    checkpoint = by_id(run_summary)["sft"]["outputs"]["checkpoint"]
    inline = run_summary["evaluations"][-1]
    # the cached evaluation and a new one (other settings) are independent: both at once
    again, other = concurrently(lambda: posttrain("eval", checkpoint, "--store", f"file://{store}"),
                                lambda: posttrain("eval", checkpoint, "--n", "4", "--env", "calc", "--store",
                                                  f"file://{store}"))
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"{checkpoint}: cached  results {inline['results']}" in again.stdout
    assert other.returncode == 0, other.stdout[-2000:] + other.stderr[-2000:]
    assert f"{checkpoint}: completed" in other.stdout and "calc" in other.stdout
    status = posttrain("status", "--store", f"file://{store}")
    assert status.returncode == 0
    lines = status.stdout.splitlines()
    assert run_summary["run_id"] in lines[1]
    listed = [line.split() for line in lines[2:] if "@" in line]
    assert {(row[0], row[1]) for row in listed} >= {(inline["checkpoint"], "arith"), (checkpoint, "calc")}


def test_bad_input_is_one_line_and_writes_nothing(evaluated_run, tmp_path):
    store, _, run_summary, spec_path = evaluated_run
    checkpoint = by_id(run_summary)["sft"]["outputs"]["checkpoint"]
    dataset = by_id(run_summary)["warmup"]["outputs"]["dataset"]
    missing = checkpoint[:-1] + ("0" if checkpoint[-1] != "0" else "1")
    down = f"http://127.0.0.1:{free_port()}/api"
    unwritable = tmp_path / "file"
    unwritable.write_text("not a folder")
    before = files(store)
    cases = [
        (["eval", missing], {}, f"error: ref: no committed artifact {missing} in file://{store}"),
        (["eval", dataset], {}, f"error: ref: {dataset} is a dataset, not a checkpoint"),
        (["eval", "sft"], {}, "error: ref: not an artifact ref (expected name@version, 16 hex digits): 'sft'"),
        (["eval", checkpoint, "--env", "chess"], {}, "error: env: 'chess' is neither an env of spec 'tiny'"),
        (["eval", checkpoint, "--store", f"file://{unwritable}/store"], {}, "error: store: "),
        (["eval", checkpoint], {"PREFECT_API_URL": down},
         f"error: PREFECT_API_URL {down}: the Prefect server does not answer"),
        (["serve"], {"PREFECT_API_URL": down}, f"error: PREFECT_API_URL {down}: the Prefect server does not answer"),
        (["serve"], EPHEMERAL, "error: PREFECT_API_URL: `posttrain serve` needs a Prefect server"),
        (["serve-model", missing], {}, "error: ref: no committed artifact"),
        (["eval"], {}, "error: ref: name a checkpoint (name@version), or an endpoint"),
        (["eval", "--endpoint", down.replace("/api", "/v1"), "--model", "m", "--spec", spec_path], {},
         f"error: {down.replace('/api', '/v1')}: cannot reach the endpoint"),
    ]
    cases = [([*args, "--store", f"file://{store}"] if "--store" not in args else args, env, message)
             for args, env, message in cases]
    # independent commands, each one CLI start (a core's work): two at a time
    results = concurrently(*(lambda args=args, env=env: posttrain(*args, env=env, timeout=120)
                             for args, env, _ in cases), workers=2)
    for (args, _, message), result in zip(cases, results):
        assert result.returncode == 2, (args, result.stdout[-1000:], result.stderr[-1000:])
        assert result.stderr.startswith(message) and len(result.stderr.strip().splitlines()) == 1, \
            (args, result.stderr)
    assert files(store) == before
    assert not (unwritable.parent / "store").exists()


def test_a_checkpoint_served_by_serve_model_evaluates_as_it_does_in_process(evaluated_run):
    """`posttrain eval --endpoint` against `posttrain serve-model REF` (the official openai client
    underneath) gives the metrics the evaluation flow gave the same checkpoint in-process."""
    from e2e.helpers import start
    from e2e.prefect_server import answers, stop, wait_until

    store, _, run_summary, spec_path = evaluated_run
    inline = run_summary["evaluations"][-1]
    port = free_port()
    server = start("serve-model", inline["checkpoint"], "--port", port, "--store", f"file://{store}")
    try:
        wait_until(lambda: answers(f"http://127.0.0.1:{port}/v1/models"), 120, "serve-model did not come up")
        result = posttrain("eval", "--endpoint", f"http://127.0.0.1:{port}/v1", "--model", inline["checkpoint"],
                           "--spec", spec_path, timeout=300)
    finally:
        stop(server)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    [row] = [line.split() for line in result.stdout.splitlines() if line.startswith("arith ")]
    m = inline["metrics"]["arith"]
    assert row[1:] == [f"{m['accuracy']:.1%}", f"{m['format_rate']:.1%}", f"{m['doom_loop_rate']:.1%}",
                       f"{m['mean_completion_tokens']:.1f}", str(m["n"])]


def test_run_with_an_unreachable_prefect_server_is_refused(tmp_path):
    down = f"http://127.0.0.1:{free_port()}/api"
    path = write(tmp_path, tiny_spec(f"file://{tmp_path / 'store'}"))
    result = posttrain("run", path, env={"PREFECT_API_URL": down}, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: PREFECT_API_URL {down}: the Prefect server does not answer " \
                                    "([Errno 111] Connection refused)"
    assert not any((tmp_path / "store" / sub).exists() for sub in ("runs", "artifacts"))
