"""A stage that fails once with a retriable error completes on its retry (Prefect's task retries,
`defaults.retries`): the run summary and the Prefect API show both attempts."""

import os

from toy_stage import write_flaky_stage

from tests.e2e.helpers import by_id, posttrain, summary, write
from tests.e2e.prefect_server import flow_run_named, rest


def test_a_stage_retried_then_completed_shows_its_attempts(tmp_path):
    plugins = write_flaky_stage(tmp_path / "site-packages")
    spec = write(tmp_path, {
        "name": "flaky", "store": f"file://{tmp_path / 'store'}", "model": {"base": "tiny-llama"},
        "envs": {"arith": {"kind": "arith", "digits": 1}},
        "defaults": {"retries": 1, "retry_delay_seconds": 0, "timeout_seconds": 600},
        "stages": [{"id": "sums", "kind": "flaky", "marker": str(tmp_path / "attempted")}]})
    run = posttrain("run", spec, "--summary-json", tmp_path / "run.json", env={"PYTHONPATH": str(plugins)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = summary(tmp_path / "run.json")
    sums = by_id(record)["sums"]
    assert (sums["state"], sums["attempts"]) == ("completed", 2)
    assert "flaky: the first attempt fails" in run.stdout + run.stderr  # the first attempt's error, logged

    api = os.environ["PREFECT_API_URL"]
    body = {"flow_runs": {"id": {"any_": [flow_run_named(api, record["run_id"])["id"]]}},
            "task_runs": {"name": {"any_": ["sums"]}}}
    [task_run] = rest("POST", f"{api}/task_runs/filter", json=body).json()
    assert (task_run["run_count"], task_run["state_type"]) == (2, "COMPLETED")  # what the UI shows
    history = rest("GET", f"{api}/task_run_states/?task_run_id={task_run['id']}").json()
    assert [state["name"] for state in history] == ["Pending", "Running", "Retrying", "Completed"]
