"""`policy: sft@best:arith.accuracy` through the pipeline flow (ephemeral mode: each checkpoint of
sft evaluated inline before the stage downstream starts): the stage trains from the best evaluated
checkpoint and its manifest records the selector beside the ref it chose; a metric nothing was
evaluated with fails that stage in one line."""

from __future__ import annotations

from artifacts.store import Store
from e2e.helpers import EPHEMERAL, by_id, posttrain, summary, tiny_spec, write

EVALUATION = {"on_new_checkpoint": True, "stages": ["sft"], "n": 8, "max_new_tokens": 16}


def best_spec(store, selector: str) -> dict:
    spec = tiny_spec(f"file://{store}", sft={"max_steps": 4, "checkpoint_every": 2}, evaluation=EVALUATION)
    spec["stages"] = [*spec["stages"][:2], {"id": "polish", "kind": "sft", "data": "warmup", "policy": selector,
                                            "max_steps": 1, "batch_size": 16}]
    return spec


def test_best_checkpoint_of_a_stage_is_what_the_next_stage_trains_from(tmp_path):
    store = tmp_path / "store"
    run = posttrain("run", write(tmp_path, best_spec(store, "sft@best:arith.accuracy")), "--summary-json",
                    tmp_path / "run.json", env=EPHEMERAL)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    stages = by_id(summary(tmp_path / "run.json"))
    scored = [(e["metrics"]["arith"]["accuracy"], step, e["checkpoint"])
              for step, e in enumerate(summary(tmp_path / "run.json")["evaluations"])]
    assert len(scored) == 2  # sft.step-2 and sft, in step order
    best = max(scored)[2]  # the highest accuracy; a tie goes to the later step
    manifest = Store(f"file://{store}").manifest(stages["polish"]["outputs"]["checkpoint"])
    assert manifest["inputs"] == {"warmup": stages["warmup"]["outputs"]["dataset"], "sft@best:arith.accuracy": best}
    assert f"stages[2].policy: sft@best:arith.accuracy = {best} (arith.accuracy" in run.stdout + run.stderr

    spec = best_spec(store, "sft@best:arith.sampled_accuracy")
    spec["name"] = "tiny"
    again = posttrain("run", write(tmp_path, spec), "--summary-json", tmp_path / "again.json", env=EPHEMERAL)
    assert again.returncode == 1
    polish = by_id(summary(tmp_path / "again.json"))["polish"]
    assert (polish["state"], polish["error"]) == \
        ("failed", "stages[2].policy: no evaluated checkpoint of sft has arith.sampled_accuracy")
