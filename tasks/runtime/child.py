"""Child-process entry point of a stage: `python -m tasks.runtime.child REQUEST.json RESULT.json`.

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

from artifacts.refs import Ref, content_version
from artifacts.store import folder_hashes
from tasks.common import contract_gate
from tasks.common.context import StageContext
from tasks.common.errors import NotRetryable
from tasks.request import StageRequest
from tasks.runtime.peaks import highest, max_over_ranks, stage_peaks
from tasks.runtime.processes import alive
from tasks.train import checkpointing


def _exit_with(orchestrator: int) -> None:
    """Die when the orchestrator dies (SIGKILL included): no orphaned training. A forked stage's
    parent is the fork server, which outlives the orchestrator while it has children, so the
    watch is on the orchestrator's pid itself (gone, or a zombie nobody reaped yet)."""
    def watch():
        while alive(orchestrator):
            time.sleep(0.5)
        os._exit(137)

    threading.Thread(target=watch, daemon=True).start()


def _use_cpu_without_cuda() -> None:
    """Processes of a multi-GPU stage on a machine without CUDA train on the CPU (gloo), so the same
    launch runs everywhere (a CPU box runs a `gpus: 2` stage as two CPU processes)."""
    import torch

    if not torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_DEEPSPEED") != "true":
        os.environ["ACCELERATE_USE_CPU"] = "1"  # DeepSpeed runs on the CPU itself (gloo); asked to, accelerate drops it


def commit_outputs(ctx, outputs: dict, primary: str, checked: dict) -> dict[str, str]:
    """Commit a stage's outputs; returns {output key: ref}.

    The primary output is `<pipeline>/<stage>` (what downstream stages read); any other is
    `<pipeline>/<stage>.<key>` (stage ids cannot contain dots). Each lists the stage's inputs
    (artifacts that existed before it ran) and, as its `siblings`, the other outputs of the run,
    keyed `<stage id>.<output>` (the primary: `<stage id>`). The primary is committed last: once it
    exists, so do its siblings.
    """
    names = {key: ctx.output_name if key == primary else f"{ctx.output_name}.{key}" for key in outputs}
    hashes = {key: folder_hashes(output.local_dir) for key, output in outputs.items()}
    refs = {key: str(Ref(names[key], content_version(hashes[key]))) for key in outputs}
    label = {key: ctx.stage_id if key == primary else f"{ctx.stage_id}.{key}" for key in outputs}
    for key in sorted(outputs, key=lambda key: key == primary):
        output = outputs[key]
        metrics = {**output.metrics, **({"contract": checked[key]} if key in checked else {})}
        ctx.store.commit(names[key], output.kind, output.local_dir, producer=ctx.producer, inputs=ctx.inputs,
                         siblings={label[other]: refs[other] for other in outputs if other != key},
                         metrics=metrics, hashes=hashes[key])
        if output.kind == "checkpoint":
            ctx.announce_checkpoint(refs[key])
    return refs


def stage_context(request: StageRequest) -> StageContext:
    workdir = Path(tempfile.mkdtemp(prefix=f"posttrain-{request.stage.id}-"))
    return StageContext(store=request.store.open(), pipeline=request.pipeline, run_id=request.run_id,
                        stage_id=request.stage.id, cache_key=request.cache_key, model=request.model,
                        envs=request.envs, inputs=request.inputs, workdir=workdir,
                        producer=request.producer.manifest_entry(), output_name=request.primary_name,
                        announce_path=Path(request.announce_path) if request.announce_path else None,
                        core_share_path=Path(request.core_share_path) if request.core_share_path else None,
                        sources=request.sources, orchestration=request.orchestration,
                        filled={name: os.environ[name] for name in request.filled if name in os.environ},
                        orchestrator_cwd=Path(request.orchestrator_cwd or os.getcwd()))


def install_code(code: dict[str, str], workdir: Path) -> None:
    """Put the user code the request carries on the import path (its paths checked: relative,
    inside the folder, .py files)."""
    if not code:
        return
    folder = workdir / "code"
    for relative, source in code.items():
        parts = Path(relative).parts
        if Path(relative).is_absolute() or ".." in parts or not relative.endswith(".py"):
            raise ValueError(f"request code path {relative!r} leaves its folder")
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_text(source)
    sys.path.insert(0, str(folder))
    importlib.invalidate_caches()


class GpusUnavailable(RuntimeError):
    """A stage holding GPUs landed where there are fewer (a worker without a GPU, or a mask that hides them)."""


def check_gpus(stage_id: str, gpus: int, model) -> None:
    """A stage that holds GPUs runs on them: where this process sees fewer, it stops in one line
    rather than train on the CPU unnoticed, unless the spec says the CPU is meant (`model.device:
    cpu`, as the CPU tests of multi-GPU stages do). Under `accelerate launch` every rank sees all
    of the stage's GPUs."""
    if not gpus or model.device == "cpu":
        return
    import torch

    visible = torch.cuda.device_count()
    if visible < gpus:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise GpusUnavailable(f"stage {stage_id} holds gpus: {gpus}, but this worker sees {visible} GPU(s) "
                           f"(torch.cuda.device_count(){f'; CUDA_VISIBLE_DEVICES={shown}' if shown is not None else ''}"
                           "): run it on a GPU worker, or set model.device: cpu to train on the CPU")


def execute(request: StageRequest) -> dict:
    stage = request.stage
    declared = type(stage)
    check_gpus(stage.id, request.orchestration.gpus, request.model)
    ctx = stage_context(request)
    install_code(request.code, ctx.workdir)
    began = time.monotonic()
    try:
        outputs = importlib.import_module(declared.run_module()).run(stage, ctx)
        compute = time.monotonic() - began
        device = ctx.device
        # every process gathers now, while the others still run; rank 0 adds its own peak of the commit below
        ranks_peaks = max_over_ranks(stage_peaks(device), device)
        if not ctx.is_main:
            return {}  # one process per GPU: rank 0 checks, commits and reports
        if set(outputs) != set(declared.outputs):
            raise ValueError(f"stage kind {stage.kind!r} returned outputs {sorted(outputs)}, but declares "
                             f"{sorted(declared.outputs)}")
        checked = {key: output.contract_summary or contract_gate.check(ctx, output, stage.contract)
                   for key, output in outputs.items() if output.contract is not None}
        refs = commit_outputs(ctx, outputs, declared.primary, checked)
        metrics = {}
        for output in outputs.values():
            metrics.update(output.metrics)
        checkpointing.clear(ctx)
        return {"outputs": refs, "metrics": metrics, "compute_seconds": round(compute, 3), "device": device,
                **highest(ranks_peaks, stage_peaks(device))}
    finally:
        shutil.rmtree(ctx.workdir, ignore_errors=True)


def main(argv: list[str], orchestrator: int | None = None) -> int:
    request_path, result_path = Path(argv[0]), Path(argv[1])
    _exit_with(orchestrator or os.getppid())
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _use_cpu_without_cuda()
    try:
        result = execute(StageRequest.model_validate_json(request_path.read_text()))
        code = 0
    except NotRetryable as exc:
        result, code = {"error": str(exc), "retryable": False}, 1
    except Exception as exc:
        traceback.print_exc()
        result, code = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}, 1
    if os.environ.get("RANK", "0") == "0":
        result_path.write_text(json.dumps(result, default=str))
    return code


def forked_main(request_path: str, result_path: str, env: dict, cwd: str, orchestrator: int) -> None:
    """Entry point in a process forked from the warm fork server (tasks/runtime/launch.py): the same
    as `python -m tasks.runtime.child`, with the environment and working folder a fresh process
    would have had."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.exit(main([request_path, result_path], orchestrator))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
