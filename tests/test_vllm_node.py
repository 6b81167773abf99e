"""pipelines/vllm-node.yaml, the one-GPU-node path (docs/GPU.md "One GPU node"): it validates as
shipped, and its CPU rehearsal runs it end to end through `posttrain run` against the vLLM fake
(tests/fake_vllm): the spec rewritten as `make gpu-check` rewrites it (bench/gpu_check_node.py), with
`gpus: 0` and the tiny preset as its base, its endpoint from ${VLLM_ENDPOINT}."""

import json
import re
import subprocess

from conftest import POSTTRAIN, ROOT
from fake_vllm import FakeVllmConfig, running_fake

from bench.gpu_check_node import NODE_SPEC, gpu_split, node_pipeline, node_server, off_cuda, trainer_env
from flows.spec import load_spec
from models.presets import materialize


def test_vllm_node_spec_validates_with_server_rollouts_and_a_gpu_per_stage():
    done = subprocess.run([POSTTRAIN, "validate", str(NODE_SPEC)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    spec, _ = load_spec(NODE_SPEC)
    assert spec.model.base == "Qwen/Qwen3-1.7B" and spec.model.lora is not None
    stages = {stage.id: stage for stage in spec.stages}
    assert sorted(stage.kind for stage in spec.stages) == ["dataset", "dataset", "evaluate", "rl", "sft"]
    rollout = stages["rl"].rollout
    assert (rollout.backend, rollout.endpoint, rollout.model, rollout.api_key_env) == (
        "server", "http://127.0.0.1:8000/v1", "policy", "VLLM_API_KEY")
    assert rollout.sync_folder.startswith("/") and stages["rl"].asynchronous.max_staleness == 1
    assert stages["final-eval"].rollout.backend == "local"  # two adapters; vLLM serves one model
    assert {stage_id: spec.resolved(stage).gpus for stage_id, stage in stages.items()} == {
        "chats": 0, "sft": 1, "sums-data": 0, "rl": 1, "final-eval": 1}


def test_vllm_node_gpu_check_splits_the_node_between_vllm_and_training():
    assert gpu_split(8) == {"vllm": "0", "trainer": "1", "memory_share": "0.90"}
    assert gpu_split(1) == {"vllm": "0", "trainer": "0", "memory_share": "0.35"}  # one GPU, shared
    command, env = node_server("/opt/vllm/bin/vllm", "Qwen/Qwen3-1.7B", 8000, gpu_split(2), "k3y")
    assert command[:3] == ["/opt/vllm/bin/vllm", "serve", "Qwen/Qwen3-1.7B"] and env["CUDA_VISIBLE_DEVICES"] == "0"
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.90"
    assert command[command.index("--api-key") + 1] == "k3y" and "--enable-lora" in command
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert trainer_env("http://127.0.0.1:8000/v1", "k3y", "1")["CUDA_VISIBLE_DEVICES"] == "1"
    summary = {"stages": [{"id": "sft", "device": "cuda:0"}, {"id": "rl", "device": "cpu"}]}
    assert off_cuda(summary) == ["rl (cpu)", "final-eval (None)"]


def test_vllm_node_cpu_rehearsal_runs_the_spec_against_the_fake(tmp_path):
    """sft, rl decoding on the fake with its LoRA versions loaded there as they train, and the
    evaluation of both checkpoints: every stage of the spec completes."""
    sync = tmp_path / "sync"
    spec = node_pipeline(tmp_path, "tiny-llama", 0, sync)
    config = FakeVllmConfig(materialize("tiny-llama"), "policy", max_model_len=512,
                            logprobs_mode="processed_logprobs", max_loras=2, max_cpu_loras=4)
    with running_fake(config) as (url, server):
        done = subprocess.run([POSTTRAIN, "run", str(spec), "--summary-json", str(tmp_path / "run.json")],
                              cwd=ROOT, env=trainer_env(url, "rehearsal-key"), capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        requested, loaded = {request["model"] for request in server.requests}, list(server.registry)
    stages = {stage["id"]: stage for stage in json.loads((tmp_path / "run.json").read_text())["stages"]}
    assert {stage["state"] for stage in stages.values()} == {"completed"}
    assert set(stages) == {"chats", "sft", "sums-data", "rl", "final-eval"}
    # the start check probed the served model; every rollout named a version the stage published (v0:
    # the sft adapter, before the first step; with max_staleness 1, step 2's rollouts decode during step 1)
    rollouts = requested - {"policy"}
    versions = {int(match.group(1)) for name in rollouts if (match := re.fullmatch(r"policy@\w+-v(\d+)", name))}
    assert rollouts and len(versions) == len(rollouts) and 0 in versions and versions <= {0, 1}
    assert any(name.endswith("-v2") for name in loaded)  # the last step's version, on the server at the end
    assert set(stages["final-eval"]["metrics"]) == {"sft", "rl"}
    assert {"accuracy", "format_rate", "mean_reward"} <= set(stages["final-eval"]["metrics"]["rl"]["sums"])
