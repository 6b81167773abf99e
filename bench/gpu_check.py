"""`make gpu-check`: every stage kind on CUDA, on any machine with a GPU.

Runs a small pipeline through the real CLI (`posttrain run`) with `defaults: {gpus: 1}` (which the
kinds that want no accelerator, dataset and synthesize, do not take): a user's dataset,
synthesize, sft, generate, preference, rl and evaluate, on the tiny preset, and
again on a real model when one is in the local Hugging Face cache (LFM2-350M, Qwen3-0.6B: nothing
is downloaded), else on a model of Qwen3-0.6B's size with random weights. It asserts from the run
summary that every stage that runs a model ran on cuda. On a machine with two GPUs or more, the
pipeline's sft, preference and rl run again on two GPUs under FSDP2 (skipped, and said so, with
one). Then rl against a real vLLM server, with LoRA and with full-weight sync
(bench/gpu_check_vllm.py; skipped, and said so, without a `vllm` command), and pipelines/vllm-node.yaml
on this one node, vLLM on GPU 0 and training on GPU 1 (bench/gpu_check_node.py). It writes
bench/results/gpu_check.json: each stage's device, peak GPU memory, peak RSS and seconds, and each
check as an entry of `checks`: {name, ok, seconds, peak_gpu_gb, tokens_per_second}. Without CUDA
it refuses (exit 2): nothing in CI needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from bench.common import RESULTS_DIR, go_offline, make_result, package_versions, write_result
from bench.gpu_check_node import node_base, node_check
from bench.gpu_check_vllm import vllm_checks
from models.presets import materialize

ROOT = Path(__file__).resolve().parents[1]
MODEL_STAGES = ("sft", "generate", "align", "rm", "online", "rl", "distill", "final-eval")  # the stages that load a model
REAL_MODELS = ("LiquidAI/LFM2-350M", "Qwen/Qwen3-0.6B")
CHATS = [{"prompt": f"What is {a} + {b}?", "completion": f"{a + b}"} for a in range(1, 9) for b in range(1, 5)]
# pairs the preference stage always has, whatever the briefly trained policy's rollouts tie on
PAIRS = [{"prompt": f"What is {a} + {b}?", "chosen": f"{a + b}", "rejected": f"{a + b + 1}"} for a in range(1, 5)
         for b in range(1, 5)]
PROMPTS = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(1, 9) for b in range(1, 5)]


def pipeline_spec(store: str, base: str, lora: bool) -> dict:
    """Every stage kind, tiny settings, one GPU each; the spec mirrors what a user writes."""
    return {
        "name": "gpu-check",
        "store": store,
        "model": {"base": base, **({"lora": {"r": 8}} if lora else {})},
        # sums: prompts rewarded by the reward model (its scores never tie: online DPO always has pairs)
        "envs": {"arith": {"kind": "arith", "digits": 2},
                 "sums": {"kind": "dataset", "source": "prompts.jsonl", "eval_fraction": 0.25,
                          "rewards": [{"function": "posttrain.rewards:answer_format", "weight": 0.0},
                                      {"reward_model": "rm"}]}},
        "defaults": {"retries": 0, "timeout_seconds": 1800, "gpus": 1},
        "stages": [
            {"id": "chats", "kind": "dataset", "source": "chats.jsonl"},
            {"id": "pairs", "kind": "dataset", "source": "pairs.jsonl"},
            {"id": "warmup", "kind": "synthesize", "env": "arith", "n": 128},
            # 8 steps left greedy completions empty (the end token first), which the rollouts contract refuses
            {"id": "sft", "kind": "sft", "data": {"warmup": 0.7, "chats": 0.3}, "max_steps": 40, "batch_size": 8,
             "learning_rate": 0.01 if lora else 0.003, "micro_batch_size": 4, "gradient_checkpointing": True,
             "mixed_precision": "bf16"},
            # a briefly trained policy may run to max_tokens: the check is where it runs, not what it writes
            {"id": "generate", "kind": "generate", "policy": "sft", "env": "arith", "n": 8, "samples": 2,
             "greedy": 1, "max_tokens": 32, "contract": {"max_truncated_fraction": 1.0}},
            {"id": "align", "kind": "preference", "policy": "sft", "data": ["generate", "pairs"], "max_steps": 2,
             "batch_size": 4, "micro_batch_size": 2},
            {"id": "rm", "kind": "reward_model", "policy": "sft", "data": "pairs", "max_steps": 2, "batch_size": 4,
             "eval_fraction": 0.25},
            {"id": "online", "kind": "preference", "mode": "online", "policy": "sft", "envs": {"sums": 1.0},
             "max_steps": 2, "batch_size": 4, "max_tokens": 32},
            {"id": "rl", "kind": "rl", "policy": "align", "envs": {"arith": 1.0, "sums": 1.0}, "steps": 2,
             "prompts_per_step": 2, "group_size": 4, "max_tokens": 32, "micro_batch_size": 4, "advantage": "rloo"},
            {"id": "distill", "kind": "distill", "teacher": "align", "student": "sft", "envs": {"arith": 1.0},
             "max_steps": 2, "batch_size": 4, "max_new_tokens": 32},
            {"id": "final-eval", "kind": "evaluate", "checkpoints": ["sft", "rl"], "envs": ["arith"], "n": 16,
             "max_new_tokens": 32},
        ],
    }


def cached_real_models() -> list[str]:
    """The real models whose config is in the local Hugging Face cache (never downloaded)."""
    from huggingface_hub import try_to_load_from_cache

    return [model for model in REAL_MODELS if isinstance(try_to_load_from_cache(model, "config.json"), str)]


# FSDP2 over two GPUs, as a user's accelerate config file says it (the training stages of the FSDP pass)
FSDP_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_machines: 1
num_processes: 2
mixed_precision: bf16
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
"""
TRAINING_STAGES = ("sft", "align", "rm", "rl")  # online preference and distill run in one process


def write_pipeline(folder: Path, base: str, lora: bool, fsdp: bool = False) -> Path:
    """The check's spec and its data files in `folder`; returns the spec's path. `fsdp`: the
    training stages on two GPUs under FSDP_CONFIG."""
    for name, rows in (("chats", CHATS), ("pairs", PAIRS), ("prompts", PROMPTS)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    spec_data = pipeline_spec(f"file://{folder / 'store'}", base, lora)
    if fsdp:
        (folder / "fsdp.yaml").write_text(FSDP_CONFIG)
        for stage in spec_data["stages"]:
            if stage["id"] in TRAINING_STAGES:
                stage.update(gpus=2, accelerate_config="fsdp.yaml", mixed_precision="bf16")
    spec = folder / "gpu-check.yaml"
    spec.write_text(yaml.safe_dump(spec_data, sort_keys=False))
    return spec


def run_pipeline(folder: Path, base: str, lora: bool, fsdp: bool = False) -> dict:
    """`posttrain run` of the check's pipeline in `folder`; returns the run summary."""
    spec = write_pipeline(folder, base, lora, fsdp)
    summary_path = folder / "run.json"
    run = subprocess.run([sys.executable, "-m", "flows.cli.main", "run", str(spec), "--summary-json",
                          str(summary_path)], cwd=str(ROOT), capture_output=True, text=True)
    if run.returncode != 0 or not summary_path.exists():
        raise SystemExit(f"gpu-check: the pipeline on {base} failed (exit {run.returncode}):\n"
                         f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return json.loads(summary_path.read_text())


def stage_figures(summary: dict) -> dict[str, dict]:
    """{stage id: {device, peak_gpu_gb, peak_rss_gb, seconds}} from a run summary."""
    return {stage["id"]: {key: stage.get(key) for key in ("device", "peak_gpu_gb", "peak_rss_gb", "seconds")}
            for stage in summary["stages"]}


def off_cuda(figures: dict[str, dict]) -> list[str]:
    """The model stages that did not run on cuda (missing ones included), as `id (device)`."""
    return [f"{stage_id} ({figures.get(stage_id, {}).get('device')})" for stage_id in MODEL_STAGES
            if not str(figures.get(stage_id, {}).get("device")).startswith("cuda")]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS_DIR / "gpu_check.json"))
    parser.add_argument("--base", default="tiny-llama", help="the preset (or local folder) of the first pass")
    parser.add_argument("--vllm-port", type=int, default=8765, help="where the vLLM passes serve")
    args = parser.parse_args(argv)
    go_offline()
    import torch

    if not torch.cuda.is_available():
        print("error: gpu-check needs a CUDA device and torch sees none here (torch.cuda.is_available() is False); "
              "run it on a GPU machine", file=sys.stderr)
        raise SystemExit(2)
    runs, checks = {}, []
    real_models = cached_real_models()
    sized = tempfile.TemporaryDirectory(prefix="posttrain-gpu-check-sized-")
    # without a real model in the cache, its size at least: Qwen3-0.6B's config, random weights
    bases = real_models or [str(sized_model("qwen3-0.6b", Path(sized.name)))]
    for base, lora in [(args.base, False), *((model, True) for model in bases)]:
        with tempfile.TemporaryDirectory(prefix="posttrain-gpu-check-") as folder:
            figures = stage_figures(run_pipeline(Path(folder), base, lora))
        missed = off_cuda(figures)
        if missed:
            raise SystemExit(f"gpu-check: on {base}, these stages did not run on cuda: {', '.join(missed)}")
        runs[base] = figures
        checks.append(pipeline_check(base, figures))
        print(f"{base}: every model stage ran on cuda; {json.dumps(figures)}")
    sized.cleanup()
    checks.append(fsdp_check(args.base))
    with tempfile.TemporaryDirectory(prefix="posttrain-gpu-check-vllm-") as folder:
        vllm_base = real_models[0] if real_models else str(materialize(args.base))
        checks += vllm_checks(vllm_base, Path(folder), args.vllm_port)
    with tempfile.TemporaryDirectory(prefix="posttrain-gpu-check-node-") as folder:
        checks.append(node_check(node_base(vllm_base), Path(folder), args.vllm_port, torch.cuda.device_count()))
    result = make_result(metric="model stages on cuda", unit="stages", ours=float(len(MODEL_STAGES)), peer=None,
                         peer_name=None, config={"stages": list(MODEL_STAGES), "gpu": torch.cuda.get_device_name(0),
                                                 "versions": package_versions("torch", "transformers", "accelerate",
                                                                              "peft")})
    result.update(runs=runs, checks=checks)
    write_result(result, args.out)
    for check in checks:
        print(f"{check['name']}: {'ok' if check['ok'] else check.get('skipped') or check.get('reason')}")
    if any(check["ok"] is False for check in checks):
        raise SystemExit(1)
    return result


def sized_model(name: str, folder: Path) -> Path:
    """A checkpoint folder with a published model's config (bench/scale.py: PUBLISHED), random
    weights and the tiny presets' tokenizer: the real size on the GPU, with nothing downloaded."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.scale import PUBLISHED
    from models.loading import load_tokenizer

    config = AutoConfig.for_model(PUBLISHED[name]["model_type"], **PUBLISHED[name]["config"])
    torch.manual_seed(0)
    target = folder / f"{name}-sized"
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(target))
    load_tokenizer(materialize("tiny-llama")).save_pretrained(str(target))
    return target


def fsdp_check(base: str) -> dict:
    """sft, preference and rl on two GPUs under FSDP2 (skipped, and said so, on one GPU)."""
    import torch

    name = "sft, preference and rl under FSDP on 2 GPUs"
    if torch.cuda.device_count() < 2:
        return {"name": name, "ok": None, "skipped": f"needs 2 GPUs, this machine has {torch.cuda.device_count()}"}
    with tempfile.TemporaryDirectory(prefix="posttrain-gpu-check-fsdp-") as folder:
        try:
            figures = stage_figures(run_pipeline(Path(folder), base, False, fsdp=True))
        except SystemExit as failure:
            return {"name": name, "ok": False, "reason": str(failure)[:3000]}
    return {**pipeline_check(base, figures), "name": name, "ok": not off_cuda(figures)}


def pipeline_check(base: str, figures: dict[str, dict]) -> dict:
    """The pipeline's entry among the checks: its seconds and the largest stage's GPU memory."""
    peaks = [f["peak_gpu_gb"] for f in figures.values() if f.get("peak_gpu_gb") is not None]
    return {"name": f"every stage kind on {base}", "ok": True,
            "seconds": round(sum(f["seconds"] or 0 for f in figures.values()), 1),
            "peak_gpu_gb": max(peaks) if peaks else None, "tokens_per_second": None}


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
