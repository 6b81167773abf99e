"""`make gpu-check`'s one-node pass: pipelines/vllm-node.yaml as its comments say to run it, vLLM on
GPU 0 and training on GPU 1 (on a one-GPU machine both on GPU 0, vLLM with a smaller share of its
memory), the stages cut to a check's size.

The spec runs as shipped but for what a check must change: its store and sync folder in the check's
folder (never the user's home), its stages shorter (SHORT), its base the model given (the spec's
Qwen3-1.7B when it is in the local Hugging Face cache: nothing is downloaded) and `defaults.gpus`.
The same rewrite with `gpus: 0` and the tiny preset is the spec's CPU rehearsal against the vLLM
fake (tests/test_vllm_node.py). Skipped, and said so, without a `vllm` command (VLLM_BIN).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.gpu_check_vllm import failed, figures, healthy, server_command, vllm_command

ROOT = Path(__file__).resolve().parents[1]
NODE_SPEC = ROOT / "pipelines" / "vllm-node.yaml"
NAME = "vllm-node on one node"
# the spec's stages at a check's size: what runs is the spec's, only shorter
SHORT = {"sft": {"max_steps": 4, "batch_size": 8, "micro_batch_size": 4},
         "rl": {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_tokens": 16, "micro_batch_size": 4},
         "final-eval": {"n": 4, "max_new_tokens": 16, "batch_size": 4}}
MODEL_STAGES = ("sft", "rl", "final-eval")
# vLLM's share of its GPU's memory: the whole GPU is its own, or the trainer shares it (the spec's comments)
MEMORY_SHARE = {"own": "0.90", "shared": "0.35"}


def node_pipeline(folder: Path, base: str, gpus: int, sync_folder: Path) -> Path:
    """pipelines/vllm-node.yaml and examples/ copied side by side into `folder` (its sources are
    relative to its own folder), rewritten for a check (the module's doc); returns the spec's path."""
    shutil.copytree(ROOT / "examples", folder / "examples")
    spec = yaml.safe_load(NODE_SPEC.read_text())
    spec["store"] = f"file://{folder / 'store'}"
    spec["model"]["base"] = base
    spec["defaults"]["gpus"] = gpus
    for stage in spec["stages"]:
        stage.update(SHORT.get(stage["id"], {}))
        if "rollout" in stage:
            stage["rollout"]["sync_folder"] = str(sync_folder)
    (folder / "pipelines").mkdir()
    path = folder / "pipelines" / NODE_SPEC.name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def gpu_split(gpu_count: int) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES of vLLM and of `posttrain run`, and vLLM's --gpu-memory-utilization."""
    if gpu_count >= 2:
        return {"vllm": "0", "trainer": "1", "memory_share": MEMORY_SHARE["own"]}
    return {"vllm": "0", "trainer": "0", "memory_share": MEMORY_SHARE["shared"]}


def node_server(vllm: str, base: str, port: int, split: dict[str, str], api_key: str) -> tuple[list[str], dict]:
    """The spec's `vllm serve` (LoRA, key, log-prob mode) on the split's GPU with its memory share."""
    command, env = server_command(vllm, base, port, lora=True)
    command[command.index("--gpu-memory-utilization") + 1] = split["memory_share"]
    return [*command, "--api-key", api_key], {**env, "CUDA_VISIBLE_DEVICES": split["vllm"]}


def trainer_env(url: str, api_key: str, visible: str | None = None) -> dict:
    """`posttrain`'s environment: the spec's ${VLLM_ENDPOINT} and VLLM_API_KEY, its GPUs (None: as is)."""
    env = {**os.environ, "VLLM_ENDPOINT": url, "VLLM_API_KEY": api_key}
    return {**env, "CUDA_VISIBLE_DEVICES": visible} if visible is not None else env


def posttrain(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli.main", *args], cwd=str(ROOT), env=env,
                          capture_output=True, text=True)


def off_cuda(summary: dict) -> list[str]:
    """The model stages that did not run on cuda, as `id (device)`."""
    devices = {stage["id"]: stage.get("device") for stage in summary["stages"]}
    return [f"{stage_id} ({devices.get(stage_id)})" for stage_id in MODEL_STAGES
            if not str(devices.get(stage_id)).startswith("cuda")]


def node_base(fallback: str) -> str:
    """The spec's base when the local Hugging Face cache holds it (never downloaded), else `fallback`."""
    from huggingface_hub import try_to_load_from_cache

    base = yaml.safe_load(NODE_SPEC.read_text())["model"]["base"]
    return base if isinstance(try_to_load_from_cache(base, "config.json"), str) else fallback


def node_check(base: str, folder: Path, port: int, gpu_count: int) -> dict:
    """The pass's check entry: skipped without a vllm command; else vLLM and the spec on the split."""
    vllm = vllm_command()
    if vllm is None:
        return {"name": NAME, "ok": None, "skipped": "no vllm command (set VLLM_BIN to one in vLLM's own "
                                                     "environment)"}
    split, api_key, url = gpu_split(gpu_count), secrets.token_hex(16), f"http://127.0.0.1:{port}/v1"
    sync = folder / "sync"
    sync.mkdir(mode=0o700)
    spec = node_pipeline(folder, base, 1, sync)
    command, env = node_server(vllm, base, port, split, api_key)
    began = time.monotonic()
    with open(folder / "vllm.log", "w") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            outcome = run_on_server(spec, url, api_key, split, server, began)
        finally:
            server.terminate()
            server.wait(timeout=120)
    return {"name": NAME, "model": base, "gpu_split": split, **outcome}


def run_on_server(spec: Path, url: str, api_key: str, split: dict, server, began: float) -> dict:
    """Once vLLM answers: the start check, then `posttrain run` of the spec; the pass's figures."""
    folder = spec.parent.parent
    if not healthy(url, server):
        return failed(f"vLLM did not start: {(folder / 'vllm.log').read_text()[-1500:]}")
    env = trainer_env(url, api_key, split["trainer"])
    checked = posttrain(env, "validate", "--check-endpoints", str(spec))
    if checked.returncode != 0:
        return failed(f"the start check refused vLLM: {checked.stderr.strip()}")
    summary_path = folder / "run.json"
    done = posttrain(env, "run", str(spec), "--summary-json", str(summary_path))
    if done.returncode != 0 or not summary_path.exists():
        return failed(f"the pipeline failed: {done.stdout[-1500:]}{done.stderr[-1500:]}")
    summary = json.loads(summary_path.read_text())
    outcome = figures(summary, f"file://{folder / 'store'}", time.monotonic() - began, checked.stdout.strip())
    missed = off_cuda(summary)
    return {**outcome, "ok": outcome["ok"] and not missed,
            **({"reason": f"not on cuda: {', '.join(missed)}"} if missed else {})}
