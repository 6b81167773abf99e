"""A stage with `gpus: 2` runs as two processes under `accelerate launch` (DDP). Here, without
CUDA, the same launch trains on two CPU processes (gloo): each on its share of every batch, rank 0
alone logging, promoting and committing."""

from __future__ import annotations

import json

import pytest

from artifacts.store import Store
from e2e.helpers import by_id, posttrain, summary, tiny_spec, write
from tasks.train.loop import lr_factor

# DDP as a GPU box's config says it; without CUDA the processes train on the CPU (gloo), as with --multi_gpu
CPU_ACCELERATE_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_machines: 1
num_processes: 2
mixed_precision: 'no'
"""


def test_a_two_gpu_stage_trains_as_two_processes_and_commits_once(tmp_path):
    store = tmp_path / "store"
    # 20 steps, 5 of them warm-up: the loss ends near 0.3 of its first step's (single-process trial; 40 steps
    # with the default 20 of warm-up: 0.1)
    spec = tiny_spec(f"file://{store}", sft={"max_steps": 20, "warmup_steps": 5, "learning_rate": 0.003,
                                             "checkpoint_every": 10, "gpus": 2})
    # rl: as an accelerate config file says (DDP here; FSDP or DeepSpeed on GPUs), in micro-batches
    spec["model"]["device"] = "cpu"  # the CPU meant: a stage holding GPUs refuses to fall back unasked
    (tmp_path / "ddp.yaml").write_text(CPU_ACCELERATE_CONFIG)
    spec["stages"][2:] = [{"id": "rl", "kind": "rl", "policy": "sft", "envs": {"arith": 1.0}, "steps": 2,
                           "prompts_per_step": 4, "group_size": 4, "max_tokens": 16, "learning_rate": 0.001,
                           "gpus": 2, "accelerate_config": "ddp.yaml", "micro_batch_size": 3}]
    run = posttrain("run", write(tmp_path, spec), "--summary-json", tmp_path / "run.json")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    lines = run.stdout.splitlines()
    for stage in ("sft", "rl"):
        assert lines.count(f"[{stage}] 2 processes (MULTI_CPU), each on its share of every batch") == 1
    assert sum(line.startswith("[sft] step 20/20") for line in lines) == 1  # one progress line, not one per process
    stages = by_id(summary(tmp_path / "run.json"))
    assert stages["sft"]["state"] == stages["rl"]["state"] == "completed"
    artifact_store = Store(f"file://{store}")
    [promoted] = stages["sft"]["metrics"]["promoted_checkpoints"]
    assert promoted.startswith("tiny/sft.step-10@") and artifact_store.is_committed(promoted)
    assert sorted(artifact_store.listdir(artifact_store.path("artifacts", "tiny"))) == \
        sorted(["warmup", "sft", "sft.step-10", "sft.report", "rl", "rl.report"])
    # rank 0 alone announced its checkpoints (each gets one checkpoint event)
    assert stages["sft"]["new_checkpoints"] == [promoted, stages["sft"]["outputs"]["checkpoint"]]
    assert stages["rl"]["new_checkpoints"] == [stages["rl"]["outputs"]["checkpoint"]]
    report = artifact_store.fetch(stages["sft"]["outputs"]["report"])
    history = [json.loads(line) for line in (report / "metrics.jsonl").read_text().splitlines()]
    assert len(history) == 20 and history[-1]["loss"] < history[0]["loss"] / 2
    # the schedule moves once per optimizer step, as in one process (accelerate's scheduler wrapper
    # would move it once per process)
    assert [h["lr"] for h in history] == pytest.approx([0.003 * lr_factor(s + 1, 5, 20) for s in range(20)])
    assert stages["rl"]["outputs"]["checkpoint"] != stages["sft"]["outputs"]["checkpoint"]
