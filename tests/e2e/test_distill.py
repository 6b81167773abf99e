"""On-policy distillation end to end: the quickstart's warmup and sft (on tiny settings), then a distill
stage with the sft checkpoint as teacher and the base model as student (every step on the student's own
samples), and one that mixes in the warmup's completions (lmbda 0.5). The student moves toward the
teacher: the JSD on its own samples falls. A teacher outside the spec's stages (`teacher: {base: ...}`, here
another architecture on the same tokenizer) distils as well, and one whose tokenizer differs is refused in
one line before training."""

import json
import math
from pathlib import Path

import yaml
from e2e.helpers import by_id, posttrain, summary

from artifacts.store import Store
from conftest import ROOT
from models.presets import materialize

STEPS = 6


def distill_spec(tmp_path) -> dict:
    quickstart = yaml.safe_load((ROOT / "pipelines" / "quickstart.yaml").read_text())
    warmup, sft = [dict(stage) for stage in quickstart["stages"][:2]]
    warmup.update(n=256)
    sft.update(max_steps=16, batch_size=16, warmup_steps=5, checkpoint_every=100)
    return {"name": "distill", "store": f"file://{tmp_path / 'store'}", "model": quickstart["model"],
            "envs": quickstart["envs"], "defaults": {"retries": 0, "timeout_seconds": 600},
            "stages": [warmup, sft,
                       {"id": "distill", "kind": "distill", "teacher": "sft", "envs": {"arith": 1.0},
                        "max_steps": STEPS, "batch_size": 6, "max_new_tokens": 24, "learning_rate": 0.002,
                        "warmup_steps": 0, "lr_schedule": "constant", "checkpoint_every": 3},
                       {"id": "distill-mixed", "kind": "distill", "teacher": "sft", "envs": {"arith": 1.0},
                        "data": "warmup", "lmbda": 0.5, "beta": 1.0, "max_steps": 4, "batch_size": 4,
                        "max_new_tokens": 16}]}


def test_distill_from_the_quickstarts_sft_moves_the_student_toward_the_teacher(tmp_path):
    spec = tmp_path / "distill.yaml"
    spec.write_text(yaml.safe_dump(distill_spec(tmp_path), sort_keys=False))
    done = posttrain("run", spec, "--summary-json", tmp_path / "run.json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stages = by_id(summary(tmp_path / "run.json"))
    assert {stage["state"] for stage in stages.values()} == {"completed"}

    store = Store(f"file://{tmp_path / 'store'}")
    distill = stages["distill"]
    manifest = store.manifest(store.resolve(distill["outputs"]["checkpoint"]))
    assert manifest["kind"] == "checkpoint" and set(manifest["inputs"]) == {"sft"}  # the teacher is an input
    assert [ref.split("@")[0] for ref in distill["metrics"]["promoted_checkpoints"]] == ["distill/distill.step-3"]
    history = [json.loads(line) for line in (store.fetch(store.resolve(distill["outputs"]["report"]))
                                             / "metrics.jsonl").read_text().splitlines()]
    losses = [h["loss"] for h in history]
    assert len(losses) == STEPS and all(math.isfinite(loss) and loss >= 0 for loss in losses)
    assert all(h["on_policy"] == 1.0 and math.isfinite(h["sampled_reward"]) for h in history)
    assert sum(losses[-2:]) < 0.7 * sum(losses[:2]), losses  # the student's distributions near the teacher's

    mixed = stages["distill-mixed"]["metrics"]
    assert mixed["lmbda"] == 0.5 and 0 <= mixed["on_policy_steps"] <= 4 and math.isfinite(mixed["final_loss"])


def outside_teacher_spec(tmp_path, teacher: str) -> Path:
    """A distill stage alone: the base model as student, a model outside the spec's stages as teacher."""
    quickstart = yaml.safe_load((ROOT / "pipelines" / "quickstart.yaml").read_text())
    spec = {"name": "distill-outside", "store": f"file://{tmp_path / 'store'}", "model": quickstart["model"],
            "envs": quickstart["envs"], "defaults": {"retries": 0, "timeout_seconds": 600},
            "stages": [{"id": "distill", "kind": "distill", "teacher": {"base": teacher}, "envs": {"arith": 1.0},
                        "max_steps": 2, "batch_size": 2, "max_new_tokens": 8}]}
    tmp_path.mkdir()
    path = tmp_path / "distill.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_distill_from_a_model_outside_the_spec_and_a_teacher_with_another_tokenizer_refused(tmp_path):
    done = posttrain("run", outside_teacher_spec(tmp_path / "qwen3", "tiny-qwen3"))  # another architecture
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    other = tmp_path / "other-teacher"
    AutoModelForCausalLM.from_pretrained(str(materialize("tiny-llama"))).save_pretrained(str(other))
    tokenizer = AutoTokenizer.from_pretrained(str(materialize("tiny-llama")))
    tokenizer.add_tokens(["<teacher-only>"])
    tokenizer.save_pretrained(str(other))
    refused = posttrain("run", outside_teacher_spec(tmp_path / "other", str(other)), "--summary-json",
                        tmp_path / "run.json")
    assert refused.returncode != 0
    [stage] = summary(tmp_path / "run.json")["stages"]
    assert stage["state"] == "failed" and stage["error"].startswith("teacher: its tokenizer is not the student's")
    assert "'<teacher-only>'" in stage["error"] and len(stage["error"].splitlines()) == 1
