"""`make gpu-check`'s vLLM section: a real vLLM server on the GPU, and a few rl steps whose rollouts
decode on it, with LoRA sync (asynchronous) and with full-weight sync (our worker extension).

vLLM brings its own torch build, so it is never installed into this project's environment: the
check runs the `vllm` command of another one (`VLLM_BIN`, else `vllm` on PATH) and skips, saying so,
when there is none. Each pass starts the server with the flags docs/GPU.md gives (log-probs after
temperature, runtime LoRA or development routes, a share of the GPU memory left for the trainer),
runs `posttrain validate --check-endpoints` (the start check: model, token ids, log-prob mode,
context length) and `posttrain run` of a 3-step rl stage on it, and records whether it passed, its
seconds, the stage's peak GPU memory, its completion tokens per second and the mean
`logp_mismatch` between vLLM's log-probs and the trainer's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXTENSION = "posttrain_vllm_worker.PosttrainWorkerExtension"
PASSES = {"vllm lora sync, asynchronous": {"lora": True, "asynchronous": True},
          "vllm full-weight sync, lockstep": {"lora": False, "asynchronous": False}}


def vllm_command() -> str | None:
    return os.environ.get("VLLM_BIN") or shutil.which("vllm")


def server_command(vllm: str, model: str, port: int, lora: bool,
                   sync_root: Path | None = None) -> tuple[list[str], dict]:
    """The `vllm serve` command line and environment of one pass (docs/GPU.md's recipe): on loopback
    (vLLM's key guards only /v1, never its development routes), full weights loaded only from
    `sync_root`."""
    command = [vllm, "serve", model, "--served-model-name", "policy", "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "2048",
               "--logprobs-mode", "processed_logprobs", "--gpu-memory-utilization", "0.35", "--dtype", "bfloat16"]
    env = dict(os.environ)
    if lora:
        command += ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "2", "--max-cpu-loras", "4"]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    else:
        command += ["--worker-extension-cls", EXTENSION]
        env["VLLM_SERVER_DEV_MODE"] = "1"
        if sync_root is not None:
            env["POSTTRAIN_SYNC_ROOT"] = str(sync_root)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "deployments"), env.get("PYTHONPATH")]))
    return command, env


def check_spec(store: str, base: str, url: str, sync_folder: Path, lora: bool, asynchronous: bool,
               with_rl: bool = True) -> dict:
    """A 2-step sft and, with `with_rl`, a 3-step rl stage decoding on the server at `url`."""
    rollout = {"backend": "server", "endpoint": url, "model": "policy", "sync_folder": str(sync_folder)}
    stages = [{"id": "warmup", "kind": "synthesize", "env": "arith", "n": 64},
              {"id": "sft", "kind": "sft", "data": "warmup", "max_steps": 2, "batch_size": 8}]
    if with_rl:
        stages.append({"id": "rl", "kind": "rl", "policy": "sft", "envs": {"arith": 1.0}, "steps": 3,
                       "prompts_per_step": 4, "group_size": 4, "max_tokens": 48, "rollout": rollout,
                       **({"asynchronous": {"max_staleness": 1}} if asynchronous else {})})
    return {"name": "gpu-check-vllm", "store": store, "model": {"base": base, **({"lora": {"r": 8}} if lora else {})},
            "envs": {"arith": {"kind": "arith", "digits": 2}},
            "defaults": {"retries": 0, "timeout_seconds": 1800, "gpus": 1}, "stages": stages}


def posttrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli.main", *args], cwd=str(ROOT), capture_output=True,
                          text=True)


def run_pass(vllm: str, base: str, folder: Path, port: int, lora: bool, asynchronous: bool) -> dict:
    """sft, then vLLM serving what rl starts from (the base model under LoRA, the sft checkpoint
    otherwise), then rl on it; the pass's figures."""
    from artifacts.store import Store

    store, sync = f"file://{folder / 'store'}", folder / "sync"
    sync.mkdir(mode=0o700)
    url = f"http://127.0.0.1:{port}/v1"
    spec = folder / "spec.yaml"
    spec.write_text(yaml.safe_dump(check_spec(store, base, url, sync, lora, asynchronous, with_rl=False)))
    done = posttrain("run", str(spec))
    if done.returncode != 0:
        return failed(f"sft failed: {done.stdout[-1500:]}")
    served = base if lora else str(Store(store).fetch(Store(store).latest("gpu-check-vllm/sft")))
    command, env = server_command(vllm, served, port, lora, sync_root=sync)
    began = time.monotonic()
    with open(folder / "vllm.log", "w") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            if not healthy(url, server):
                return failed(f"vLLM did not start: {(folder / 'vllm.log').read_text()[-1500:]}")
            spec.write_text(yaml.safe_dump(check_spec(store, base, url, sync, lora, asynchronous)))
            checked = posttrain("validate", "--check-endpoints", str(spec))
            if checked.returncode != 0:
                return failed(f"the start check refused vLLM: {checked.stderr.strip()}")
            summary = folder / "run.json"
            done = posttrain("run", str(spec), "--summary-json", str(summary))
            if done.returncode != 0:
                return failed(f"rl failed: {done.stdout[-1500:]}")
            return figures(json.loads(summary.read_text()), store, time.monotonic() - began, checked.stdout.strip())
        finally:
            server.terminate()
            server.wait(timeout=120)


def healthy(url: str, server, seconds: float = 900) -> bool:
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(url.removesuffix("/v1") + "/health", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(2)
    return False


def figures(summary: dict, store: str, seconds: float, checked: str) -> dict:
    from artifacts.store import Store

    rl = next(stage for stage in summary["stages"] if stage["id"] == "rl")
    report = Store(store).fetch(rl["outputs"]["report"])
    history = [json.loads(line) for line in (report / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"ok": rl["state"] == "completed", "seconds": round(seconds, 1), "peak_gpu_gb": rl.get("peak_gpu_gb"),
            "tokens_per_second": round(sum(h["tokens"] for h in history) / rl["seconds"], 1),
            "logp_mismatch": round(sum(h["logp_mismatch"] for h in history) / len(history), 5),
            "start_check": checked}


def failed(reason: str) -> dict:
    return {"ok": False, "seconds": None, "peak_gpu_gb": None, "tokens_per_second": None, "reason": reason}


def vllm_checks(base: str, folder: Path, port: int) -> list[dict]:
    """Each pass's check entry (`name`, `ok`, ...); one skipped entry without a vllm command."""
    vllm = vllm_command()
    if vllm is None:
        return [{"name": "vllm", "ok": None, "skipped": "no vllm command (set VLLM_BIN to one in vLLM's own "
                                                        "environment)"}]
    version = subprocess.run([vllm, "--version"], capture_output=True, text=True).stdout.strip()
    checks = []
    for name, setting in PASSES.items():
        pass_folder = folder / name.replace(" ", "-").replace(",", "")
        pass_folder.mkdir(parents=True)
        checks.append({"name": name, "vllm_version": version, "model": base,
                       **run_pass(vllm, base, pass_folder, port, **setting)})
    return checks
