"""Child-process entry point of a stage: `python -m tasks.child REQUEST.json RESULT.json`.

Heavy stages run here so that a timeout can really stop them (the parent kills this
process) and a crash in native code cannot take the orchestrator down. The child commits
its outputs itself; the manifest is the last write, so a kill at any point leaves no
readable half-version.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from tasks.contracts import ContractViolation

STAGE_MODULES = {"synthesize": "tasks.synthesize", "generate": "tasks.generate", "sft": "tasks.sft",
                 "preference": "tasks.preference", "rl": "tasks.rl", "evaluate": "tasks.evaluate"}


def _exit_with(orchestrator: int) -> None:
    """Die when the orchestrator dies (SIGKILL included): no orphaned training. A forked stage's
    parent is the fork server, which outlives the orchestrator while it has children, so the
    watch is on the orchestrator's pid itself (gone, or a zombie nobody reaped yet)."""
    def watch():
        while _alive(orchestrator):
            time.sleep(0.5)
        os._exit(137)

    threading.Thread(target=watch, daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _use_cpu_without_cuda() -> None:
    """Processes of a multi-GPU stage on a machine without CUDA train on the CPU (gloo), so the same
    launch runs everywhere (a CPU box runs a `gpus: 2` stage as two CPU processes)."""
    import torch

    if not torch.cuda.is_available():
        os.environ["ACCELERATE_USE_CPU"] = "1"


def commit_outputs(ctx, outputs: dict, checked: dict, producer: dict) -> dict[str, str]:
    """Commit a stage's outputs; returns {output key: ref}, the primary (first) output first.

    The primary is `<pipeline>/<stage>`, what downstream stages read; any other output is
    `<pipeline>/<stage>.<key>` (stage ids cannot contain dots) and is committed before the
    primary, which lists it among its inputs, so lineage reaches it.
    """
    primary, *others = outputs
    refs, inputs = {}, dict(ctx.inputs)
    for key in [*others, primary]:
        output = outputs[key]
        name = ctx.output_name if key == primary else f"{ctx.output_name}.{key}"
        metrics = {**output.metrics, **({"contract": checked[key]} if key in checked else {})}
        ref = ctx.store.commit(name, output.kind, output.local_dir, producer=producer,
                               inputs=ctx.inputs if key != primary else inputs, metrics=metrics)
        refs[key] = str(ref)
        if output.kind == "checkpoint":
            ctx.announce_checkpoint(str(ref))
        if key != primary:
            inputs[f"{ctx.stage_id}.{key}"] = str(ref)
    return {key: refs[key] for key in outputs}


def execute(request: dict) -> dict:
    from artifacts.store import Store
    from envs.loader import ENV_CONFIG
    from models.config import ModelConfig
    from tasks import checkpointing, contracts
    from tasks.config import STAGE_CONFIG
    from tasks.stage import StageContext

    stage = STAGE_CONFIG.validate_python(request["stage"])
    store = Store(request["store"], request["storage_options"])
    workdir = Path(tempfile.mkdtemp(prefix=f"posttrain-{stage.id}-"))
    ctx = StageContext(store=store, pipeline=request["pipeline"], run_id=request["run_id"], stage_id=stage.id,
                       cache_key=request["cache_key"], model=ModelConfig.model_validate(request["model"]),
                       envs={k: ENV_CONFIG.validate_python(v) for k, v in request["envs"].items()},
                       inputs=request["inputs"], workdir=workdir, producer=request["producer"],
                       output_name=request.get("output_name", ""),
                       announce_path=Path(request["announce_path"]) if request.get("announce_path") else None)
    began = time.monotonic()
    try:
        outputs = importlib.import_module(STAGE_MODULES[stage.kind]).run(stage, ctx)
        compute = time.monotonic() - began
        if not ctx.is_main:
            return {}  # one process per GPU: rank 0 checks, commits and reports
        checked = {key: output.contract_summary or contracts.check(ctx, output, stage.contract)
                   for key, output in outputs.items() if output.contract is not None}
        refs = commit_outputs(ctx, outputs, checked, ctx.producer)
        metrics = {}
        for output in outputs.values():
            metrics.update(output.metrics)
        checkpointing.clear(ctx)
        return {"outputs": refs, "metrics": metrics, "compute_seconds": round(compute, 3)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str], orchestrator: int | None = None) -> int:
    request_path, result_path = Path(argv[0]), Path(argv[1])
    _exit_with(orchestrator or os.getppid())
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _use_cpu_without_cuda()
    try:
        result = execute(json.loads(request_path.read_text()))
        code = 0
    except ContractViolation as exc:
        result, code = {"error": str(exc), "contract_failed": True}, 1
    except Exception as exc:
        traceback.print_exc()
        result, code = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}, 1
    if os.environ.get("RANK", "0") == "0":
        result_path.write_text(json.dumps(result, default=str))
    return code


def forked_main(request_path: str, result_path: str, env: dict, cwd: str, orchestrator: int) -> None:
    """Entry point in a process forked from the runner's warm fork server (tasks/runner.py): the
    same as `python -m tasks.child`, with the environment and working folder a fresh process
    would have had."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.exit(main([request_path, result_path], orchestrator))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
