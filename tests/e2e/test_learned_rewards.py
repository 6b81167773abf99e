"""pipelines/learned-rewards.yaml on tiny settings: a reward model trained on the user's preference
pairs scores an RLOO stage's and an online DPO stage's completions, and a held-out evaluation
measures both with the rows' own check. The reward model is committed as such: no policy
evaluation follows it, and it cannot be served or evaluated as a policy."""

import json

from e2e.helpers import by_id, posttrain, shortened_copy, summary

from artifacts.store import Store

SHORT = {"sft": {"max_steps": 6, "batch_size": 8}, "rm": {"max_steps": 4, "batch_size": 8, "checkpoint_every": 2},
         "rl": {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_tokens": 24, "checkpoint_every": 1},
         "online-dpo": {"max_steps": 2, "batch_size": 2, "max_tokens": 16},
         "final-eval": {"n": 4, "max_new_tokens": 16}}


def test_a_reward_model_drives_rloo_and_online_dpo_and_is_no_policy(tmp_path):
    spec = shortened_copy(tmp_path, "learned-rewards", SHORT)
    done = posttrain("run", spec, "--summary-json", tmp_path / "run.json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = summary(tmp_path / "run.json")
    stages = by_id(run)
    assert {stage["state"] for stage in stages.values()} == {"completed"}

    store = Store(f"file://{tmp_path / 'store'}")
    rm_ref = stages["rm"]["outputs"]["checkpoint"]
    manifest = store.manifest(store.resolve(rm_ref))
    assert manifest["kind"] == "reward_model" and "eval_accuracy" in manifest["metrics"]
    # rl and online DPO read the reward model: it is among their inputs, so their cache keys follow it
    for stage_id in ("rl", "online-dpo"):
        assert store.manifest(store.resolve(stages[stage_id]["outputs"]["checkpoint"]))["inputs"]["rm"] == rm_ref
    # a reward model announces no checkpoint (no policy evaluation is triggered for it), rl announces each of its
    assert stages["rm"]["new_checkpoints"] == [] and len(stages["rl"]["new_checkpoints"]) == 2
    metrics = stages["final-eval"]["metrics"]
    assert set(metrics) == {"sft", "rl", "online-dpo"} and metrics["rl"]["sums"]["n"] == 4
    rows = [json.loads(line) for line in (store.fetch(store.resolve(stages["rl"]["outputs"]["report"]))
                                          / "metrics.jsonl").read_text().splitlines()]
    assert all(row["reward_errors"] == 0 for row in rows)  # every completion got the reward model's score

    refused = posttrain("eval", rm_ref, "--store", f"file://{tmp_path / 'store'}")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
