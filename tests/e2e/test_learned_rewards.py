"""pipelines/learned-rewards.yaml on tiny settings: a reward model trained on every pair of the SFT
model's own samples, as a second env over the same rows scored them, scores an RLOO stage's and an
online DPO stage's completions, and a held-out evaluation measures both with the rows' own check. The reward model is committed as such: no policy
evaluation follows it, and it cannot be served or evaluated as a policy."""

import json

import yaml
from e2e.helpers import by_id, posttrain, shortened_copy, summary

from artifacts.store import Store

SHORT = {"sft": {"max_steps": 6, "batch_size": 8},
         "mistakes": {"n": 4, "samples": 3, "max_tokens": 16,
                      "contract": {"max_blank_fraction": 1.0, "max_truncated_fraction": 1.0}},
         "rm": {"max_steps": 4, "batch_size": 8, "checkpoint_every": 2},
         "rl": {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_tokens": 24, "checkpoint_every": 1},
         "online-dpo": {"max_steps": 2, "batch_size": 2, "max_tokens": 16},
         "final-eval": {"n": 4, "max_new_tokens": 16}}

BY_TEXT = """import zlib


def by_text(prompts, completions, **columns):
    return [zlib.crc32(str(completion).encode()) % 100 / 100 for completion in completions]
"""


def test_a_reward_model_drives_rloo_and_online_dpo_and_is_no_policy(tmp_path):
    spec = shortened_copy(tmp_path, "learned-rewards", SHORT)
    # a 6-step SFT model answers no sum right, so every sample ties on the check: here a sample's
    # label is a hash of its text, which differs between samples, to make pairs
    (tmp_path / "examples" / "by_text.py").write_text(BY_TEXT)
    shortened = yaml.safe_load(spec.read_text())
    shortened["envs"]["checked"]["rewards"] = [{"function": "../examples/by_text.py:by_text", "weight": 1.0}]
    spec.write_text(yaml.safe_dump(shortened, sort_keys=False))
    done = posttrain("run", spec, "--summary-json", tmp_path / "run.json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = summary(tmp_path / "run.json")
    stages = by_id(run)
    # the two envs read the same rows: imported once, the other env's dataset stage is a cache hit
    rows = ("sums-data", "checked-data")
    assert {stage["state"] for stage in stages.values() if stage["id"] not in rows} == {"completed"}
    assert sorted(stages[s]["state"] for s in rows) == ["cached", "completed"]
    assert stages["checked-data"]["outputs"] == stages["sums-data"]["outputs"]

    store = Store(f"file://{tmp_path / 'store'}")
    rm_ref = stages["rm"]["outputs"]["checkpoint"]
    manifest = store.manifest(store.resolve(rm_ref))
    assert manifest["kind"] == "reward_model" and "eval_accuracy" in manifest["metrics"]
    assert manifest["inputs"]["mistakes"] == stages["mistakes"]["outputs"]["rollouts"]
    pairs = manifest["metrics"]["train_pairs"] + manifest["metrics"]["eval_pairs"]
    assert pairs > 4  # every pair of a group, more than one a prompt
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
