"""`posttrain run SPEC --in-process STAGE`: one stage built as the flow builds it, its inputs from the
store, run in the CLI's own process, where pdb steps through it; bad input is one line."""

import ast
import subprocess
import sys

from conftest import ROOT

from tests.e2e.helpers import by_id, environment, posttrain, summary, tiny_spec, write


def spec_without_eval(tmp_path, store) -> dict:
    spec = tiny_spec(f"file://{store}", sft={"max_steps": 4, "checkpoint_every": 2})
    spec["stages"] = spec["stages"][:2]
    return spec


def first_statement_line(path, function: str) -> int:
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    return node.body[0].lineno


def test_in_process_runs_the_stage_as_the_flow_would_and_pdb_steps_into_it(tmp_path):
    spec = write(tmp_path, spec_without_eval(tmp_path, tmp_path / "store"))
    run = posttrain("run", spec, "--summary-json", tmp_path / "run.json")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    flow_ref = by_id(summary(tmp_path / "run.json"))["sft"]["outputs"]["checkpoint"]

    again = posttrain("run", spec, "--in-process", "sft")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "sft: running in this process" in again.stdout
    assert f"sft.checkpoint: {flow_ref}" in again.stdout  # the same request, the same weights, bit for bit

    line = first_statement_line(ROOT / "tasks" / "stages" / "sft.py", "run")
    commands = f"b {ROOT / 'tasks' / 'stages' / 'sft.py'}:{line}\nc\np ('stage is', stage.id, ctx.stage_id)\nq\n"
    debugged = subprocess.run([sys.executable, "-m", "pdb", "-m", "flows.cli.main", "run", str(spec), "--in-process",
                               "sft"], input=commands, capture_output=True, text=True, cwd=ROOT,
                              env=environment({"HF_HUB_OFFLINE": "1"}), timeout=300)
    assert "('stage is', 'sft', 'sft')" in debugged.stdout, debugged.stdout[-3000:] + debugged.stderr[-3000:]


def test_in_process_refuses_an_unknown_stage_and_missing_inputs_in_one_line(tmp_path):
    spec = write(tmp_path, spec_without_eval(tmp_path, tmp_path / "empty-store"))
    unknown = posttrain("run", spec, "--in-process", "sftt")
    assert (unknown.returncode, unknown.stderr.strip()) == \
        (2, "error: --in-process: unknown stage 'sftt' (the spec's stages: warmup, sft)")
    missing = posttrain("run", spec, "--in-process", "sft")
    assert missing.returncode == 2
    assert missing.stderr.strip() == (f"error: --in-process: stage 'warmup' upstream has no committed output for this "
                                      f"spec and code in file://{tmp_path / 'empty-store'}; run `posttrain run {spec}` "
                                      "first")
    assert not (tmp_path / "empty-store" / "artifacts").exists()  # nothing committed
