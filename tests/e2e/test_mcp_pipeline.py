"""pipelines/mcp.yaml end to end through the real CLI on tiny settings: teacher traces from the rows'
oracle calls played against examples/mcp_notes_server.py over stdio -> sft -> rl on the mcp env ->
evaluate sft and rl on the held-out tasks, with the tool metrics. Step counts are cut to keep the
test short (docs/MCP.md has what a full run of the shipped spec learns)."""

import mcp  # noqa: E402,F401  (the dev extra installs the SDK: missing, these fail, never skip)

from e2e.helpers import by_id, posttrain, shortened_copy, summary

SHORT = {"traces": {"n": 12}, "sft": {"max_steps": 4, "batch_size": 4, "checkpoint_every": 2},
         "rl": {"steps": 1, "prompts_per_step": 2, "group_size": 2, "max_tokens": 24, "checkpoint_every": 1},
         "final-eval": {"n": 3, "max_new_tokens": 24}}
TOOL_METRICS = {"mean_outcome_valid_call_rate", "mean_outcome_tool_errors", "mean_outcome_turns",
                "mean_outcome_server_error", "mean_outcome_tool_calls"}


def test_mcp_pipeline_runs_end_to_end_with_tool_metrics(tmp_path):
    spec = shortened_copy(tmp_path, "mcp", SHORT)
    done = posttrain("run", spec, "--summary-json", tmp_path / "run.json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stages = by_id(summary(tmp_path / "run.json"))
    assert {stage["state"] for stage in stages.values()} == {"completed"}
    # every oracle episode solved on the server but the shortcuts (teacher_shortcut_rate 0.3 of the tasks)
    assert 0.5 <= stages["traces"]["metrics"]["teacher_accuracy"] < 1.0
    evaluation = stages["final-eval"]["metrics"]
    for checkpoint in ("sft", "rl"):
        notes = evaluation[checkpoint]["notes"]
        assert TOOL_METRICS <= set(notes) and notes["mean_outcome_server_error"] == 0.0
    assert {"paired_gain", "paired_se"} <= set(evaluation["rl"]["notes"])  # rl over sft, the same held-out tasks
