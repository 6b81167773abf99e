"""End-to-end: the agentic pipeline's shape (agentic.yaml) on tiny settings through the real CLI:
oracle warm-ups (terminal's and openclaw's tasks from the generated families) -> multi-dataset SFT ->
whole-episode generation (through the rollouts contract's mask checks) -> StepPO over the five envs with CoD credit ->
per-env evaluation. (Preference on episodes: tests/test_multi_turn_data.py; a 4-step SFT model
ties every group, so it would have no pairs here.)"""

import json

from artifacts.store import Store
from tests.e2e.helpers import by_id, posttrain, summary, write

ENVS = {"term": {"kind": "terminal", "max_turns": 5, "generated": {"train": 2, "eval": 1}},
        "search": {"kind": "search", "max_turns": 3}, "rlm": {"kind": "rlm", "context_chars": 2000, "max_turns": 3,
                                                              "tasks": 20},
        "claw": {"kind": "openclaw", "max_turns": 5, "generated": {"train": 2, "eval": 1}},
        "packs": {"kind": "cod", "pack_size": 2, "eval_pack_size": 2}}


WARMED = ("term", "packs")


def agentic_spec(store) -> dict:
    # two warm-ups (a sandboxed env and the context-restarting one) stand for the five: every env's
    # oracle is played through the loop in its own tests; each stage here costs ~10 s of start-up
    warm = [{"id": f"warm-{env}", "kind": "synthesize", "env": env, "n": 4} for env in WARMED]
    return {
        "name": "agentic", "store": f"file://{store}", "model": {"base": "tiny-llama-1k"}, "envs": ENVS,
        "defaults": {"retries": 0, "retry_delay_seconds": 0, "timeout_seconds": 600},
        "stages": warm + [
            # batches of 4 of the 8 episodes (1,024 positions each): both warm-ups' twice over in 4 steps
            {"id": "sft", "kind": "sft", "data": [s["id"] for s in warm], "max_steps": 4, "batch_size": 4,
             "max_seq_len": 1024, "checkpoint_every": 2},
            {"id": "onpolicy", "kind": "generate", "policy": "sft", "env": "search", "n": 4, "samples": 2, "greedy": 1,
             "max_tokens": 16, "contract": {"max_truncated_fraction": 1.0}},
            {"id": "rl", "kind": "rl", "policy": "sft", "algorithm": "steppo", "credit": "cod",
             "envs": {env: 1.0 for env in ENVS}, "steps": 1, "prompts_per_step": 5, "group_size": 2,
             "max_tokens": 16, "anti_doom": {"penalty": 0.5}, "checkpoint_every": 5},
            {"id": "final-eval", "kind": "evaluate", "checkpoints": ["sft", "rl"], "envs": list(ENVS), "n": 2,
             "max_new_tokens": 16, "sampled": None},
        ],
    }


def test_agentic_pipeline_runs_every_env_and_evaluates_each(tmp_path):
    store = tmp_path / "store"
    spec = write(tmp_path, agentic_spec(store))
    run = posttrain("run", spec, "--summary-json", tmp_path / "run.json")
    stages = by_id(summary(tmp_path / "run.json"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    for env in WARMED:  # the oracle solved every warm-up task through the sandboxed episode loop
        assert stages[f"warm-{env}"]["state"] == "completed"
        assert stages[f"warm-{env}"]["metrics"]["teacher_accuracy"] == 1.0
    assert stages["sft"]["state"] == stages["rl"]["state"] == stages["final-eval"]["state"] == "completed"
    report = next(store.glob("artifacts/agentic/rl.report/*/metrics.jsonl")).read_text().splitlines()
    steps = [json.loads(line) for line in report]
    assert len(steps) == 1 and steps[0]["rows"] > 0
    assert {key.split("/")[0] for step in steps for key in step if "/" in key} <= set(ENVS)
    evaluation = stages["final-eval"]["metrics"]
    assert set(evaluation["rl"]) == set(ENVS)
    for env in ENVS:  # rl's gain over sft on the same held-out tasks, with its paired standard error
        assert {"accuracy", "accuracy_se", "paired_gain", "paired_se", "mean_turns", "n"} <= set(evaluation["rl"][env])
        assert evaluation["rl"][env]["paired_gain"] == round(
            evaluation["rl"][env]["accuracy"] - evaluation["sft"][env]["accuracy"], 4)
    assert "mean_outcome_position_0" in evaluation["rl"]["packs"]  # CoD reward by position in the pack
    assert "mean_outcome_tests_passed" in evaluation["rl"]["term"]
    rollouts = Store(f"file://{store}").manifest(stages["onpolicy"]["outputs"]["rollouts"])["metrics"]
    assert rollouts["rows"] == 12 and rollouts["contract"]["success"] is True  # env tokens never trained on
