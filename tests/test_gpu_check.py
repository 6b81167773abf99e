"""`make gpu-check` (bench/gpu_check.py): its pipeline is a valid spec with every stage kind, it
refuses on a machine without CUDA, and it names the stages that did not run on cuda."""

import json
import subprocess
import sys

import yaml
from conftest import ROOT

from bench.gpu_check import MODEL_STAGES, off_cuda, write_pipeline
from flows.spec import load_spec
from tasks.kinds import BUILTIN_KINDS


def test_the_check_pipeline_is_valid_and_runs_every_stage_kind_on_a_gpu(tmp_path):
    for lora in (False, True):
        spec, _ = load_spec(write_pipeline(tmp_path, "tiny-llama", lora))
        assert {stage.kind for stage in spec.stages} == {kind.model_fields["kind"].annotation.__args__[0] for kind in BUILTIN_KINDS}
        assert all(spec.resolved(stage).gpus == type(stage).uses_accelerator for stage in spec.stages)
        assert set(MODEL_STAGES) <= {stage.id for stage in spec.stages}


def test_without_cuda_it_refuses_in_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "gpu_check.json"
    run = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--out", str(out)], cwd=str(ROOT),
                         capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr.strip() == ("error: gpu-check needs a CUDA device and torch sees none here "
                                  "(torch.cuda.is_available() is False); run it on a GPU machine")
    assert not out.exists()


def test_a_model_stage_off_cuda_is_named():
    figures = {stage_id: {"device": "cuda:0"} for stage_id in MODEL_STAGES}
    assert off_cuda(figures) == []
    figures["rl"] = {"device": "cpu"}
    del figures["final-eval"]
    assert off_cuda(figures) == ["rl (cpu)", "final-eval (None)"]


def test_the_vllm_passes_start_vllm_with_the_documented_flags(tmp_path):
    from bench.gpu_check_vllm import EXTENSION, check_spec, server_command

    lora, lora_env = server_command("vllm", "Qwen/Qwen3-0.6B", 8765, lora=True)
    assert {"--logprobs-mode", "processed_logprobs", "--enable-lora", "--max-loras", "--max-cpu-loras",
            "--max-model-len", "--max-lora-rank"} <= set(lora) and lora_env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    full, full_env = server_command("vllm", "/ckpt", 8765, lora=False, sync_root=tmp_path / "sync")
    assert full[full.index("--worker-extension-cls") + 1] == EXTENSION and full_env["VLLM_SERVER_DEV_MODE"] == "1"
    assert full_env["POSTTRAIN_SYNC_ROOT"] == str(tmp_path / "sync")
    assert lora[lora.index("--host") + 1] == full[full.index("--host") + 1] == "127.0.0.1"  # never every interface
    assert full_env["PYTHONPATH"].split(":")[0] == str(ROOT / "deployments")
    for lora_on in (True, False):
        path = tmp_path / f"spec-{lora_on}.yaml"
        path.write_text(yaml.safe_dump(check_spec(f"file://{tmp_path}/store", "tiny-llama", "http://127.0.0.1:8765/v1",
                                                  tmp_path / "sync", lora_on, asynchronous=lora_on)))
        spec, _ = load_spec(path)
        assert spec.stages[-1].rollout.sync_folder == str(tmp_path / "sync")


def test_without_a_vllm_command_the_vllm_check_says_it_was_skipped(tmp_path, monkeypatch):
    from bench.gpu_check_vllm import vllm_checks

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("VLLM_BIN", raising=False)
    [check] = vllm_checks("tiny-llama", tmp_path, 8765)
    assert check["ok"] is None and check["skipped"].startswith("no vllm command")


def test_the_fsdp_pass_puts_the_training_stages_on_two_gpus_under_fsdp(tmp_path):
    from bench.gpu_check import TRAINING_STAGES

    spec, _ = load_spec(write_pipeline(tmp_path, "tiny-llama", False, fsdp=True))
    for stage in spec.stages:
        assert spec.resolved(stage).gpus == (2 if stage.id in TRAINING_STAGES else type(stage).uses_accelerator)
    assert "distributed_type: FSDP" in (tmp_path / "fsdp.yaml").read_text()


def test_the_sized_model_has_the_published_config_and_a_tokenizer(tmp_path, monkeypatch):
    """On a GPU box without the hub's weights, the check still runs a model of Qwen3-0.6B's size
    (here with its width cut, so the test stays light: the folder is built the same way)."""
    from bench import scale
    from bench.gpu_check import sized_model
    from models.loading import load_tokenizer

    monkeypatch.setitem(scale.PUBLISHED["qwen3-0.6b"], "config", scale.TINY["qwen3-0.6b"])
    folder = sized_model("qwen3-0.6b", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["head_dim"] == 16
    assert load_tokenizer(folder).eos_token is not None


def test_without_a_vllm_command_the_vllm_node_pass_says_it_was_skipped(tmp_path, monkeypatch):
    """The one-node pass (bench/gpu_check_node.py; its spec rewrite and command lines are tested in
    tests/test_vllm_node.py, its run there against the vLLM fake)."""
    from bench.gpu_check_node import NAME, node_check

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("VLLM_BIN", raising=False)
    check = node_check("tiny-llama", tmp_path, 8765, gpu_count=2)
    assert check == {"name": NAME, "ok": None, "skipped": "no vllm command (set VLLM_BIN to one in vLLM's own "
                                                          "environment)"}
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing written
