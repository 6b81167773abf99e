"""A stage whose dataset breaks its contract is quarantined, not retried, and stops the pipeline."""

import json
import re

from artifacts.store import Store
from tests.e2e.helpers import by_id, posttrain, summary, tiny_spec, write


def test_bad_dataset_is_quarantined_and_nothing_downstream_runs(tmp_path):
    store = tmp_path / "store"
    spec = tiny_spec(f"file://{store}", defaults={"retries": 2, "retry_delay_seconds": 0, "timeout_seconds": 600})
    spec["stages"][0]["contract"] = {"context_length": 10}  # every example is longer than that
    result = posttrain("run", write(tmp_path, spec), "--summary-json", tmp_path / "run.json")
    assert result.returncode == 1
    run = summary(tmp_path / "run.json")
    warmup = by_id(run)["warmup"]
    assert warmup["state"] == "failed"
    assert "data contract 'sft' failed on 256 rows: expect_column_values_to_be_between(total_tokens): 256 rows, " \
           "e.g. arith-train-0, arith-train-1" in warmup["error"]
    assert run["not_run"] == ["sft", "final-eval"]
    assert result.stdout.count("[warmup] 256 examples") == 1  # a failed contract is not retried
    folder = store / "quarantine" / run["run_id"] / "warmup"
    assert {p.name for p in folder.iterdir()} == {"data.parquet", "contract.json", "contract.html"}
    assert json.loads((folder / "contract.json").read_text())["summary"]["success"] is False
    assert not (store / "artifacts" / "tiny" / "warmup").exists()
    status = posttrain("status", run["run_id"], "--store", f"file://{store}")
    assert "expect_column_values_to_be_between(total_tokens)" in status.stdout and "not run" in status.stdout


def test_warn_mode_reports_and_commits(tmp_path):
    store = tmp_path / "store"
    spec = tiny_spec(f"file://{store}")
    spec["stages"] = [{**spec["stages"][0], "contract": {"mode": "warn", "context_length": 10}}]
    result = posttrain("run", write(tmp_path, spec), "--summary-json", tmp_path / "run.json")
    assert result.returncode == 0
    assert "WARNING (contract mode warn): data contract 'sft' failed" in result.stdout
    ref = by_id(summary(tmp_path / "run.json"))["warmup"]["outputs"]["dataset"]
    contract = Store(f"file://{store}").manifest(ref)["metrics"]["contract"]
    assert contract["success"] is False and contract["params"]["mode"] == "warn"

    docs = posttrain("contracts", "docs", ref, "--store", f"file://{store}", "--out", tmp_path / "docs")
    assert docs.returncode == 0, docs.stderr
    assert (tmp_path / "docs" / "index.html").read_text().lower().startswith("<!doctype html") or \
        "<html" in (tmp_path / "docs" / "index.html").read_text().lower()


def test_generation_with_too_few_tokens_is_stopped_by_the_rollouts_contract(tmp_path):
    store = tmp_path / "store"
    spec = tiny_spec(f"file://{store}")
    spec["stages"].insert(2, {"id": "onpolicy", "kind": "generate", "policy": "sft", "env": "arith", "n": 8,
                              "samples": 3, "greedy": 1, "max_tokens": 4})  # every completion truncates
    spec["stages"][3].update(n=4, max_new_tokens=16)  # final-eval: only its state is checked
    result = posttrain("run", write(tmp_path, spec), "--summary-json", tmp_path / "run.json")
    assert result.returncode == 1
    run = summary(tmp_path / "run.json")
    stages = by_id(run)
    assert stages["sft"]["state"] == "completed" and stages["onpolicy"]["state"] == "failed"
    assert stages["final-eval"]["state"] == "completed"  # not downstream of the failed stage
    # (a sampled completion may end within its 4 tokens: nearly every row truncates, far over the 20% allowed)
    truncated = re.search(r"data contract 'rollouts' failed on 32 rows: expect_column_values_to_be_in_set"
                          r"\(finish_reason\): (\d+) rows, e\.g\. arith-train-\d+-\d", stages["onpolicy"]["error"])
    assert truncated and int(truncated.group(1)) >= 28, stages["onpolicy"]["error"]
    assert (store / "quarantine" / run["run_id"] / "onpolicy" / "data.parquet").exists()
    assert not (store / "artifacts" / "tiny" / "onpolicy").exists()
    status = posttrain("status", run["run_id"], "--store", f"file://{store}")
    assert "onpolicy" in status.stdout and "failed" in status.stdout and "expect_column_values_to_be_in_set" in \
        status.stdout
