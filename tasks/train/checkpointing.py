"""In-stage checkpoints of training stages, kept in the store so any worker can resume.

Layout: scratch/<stage cache key>/step-<n>/{model/, state.pt, rank-<r>.pt, DONE}; DONE is written last,
so a step folder without it is ignored (the stage was killed while saving). The last two steps
are kept: a step that fails to load (truncated, or not plain tensors and values) is skipped with a
warning for the one before. The trainer state is tensors and plain values only, loaded with
`torch.load(weights_only=True)`: whoever can write the store's scratch/ cannot run code through it.
Under several processes each also keeps its own RNG states and, with FSDP, its shard of the
optimizer's state (`rank-<r>.pt`), so a resumed sharded stage keeps Adam's moments.
"""

from __future__ import annotations

import io
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from tasks.common.context import StageContext

_STEP = re.compile(r"^step-(\d+)$")


@dataclass
class Resumed:
    step: int
    model_dir: Path
    state: dict  # optimizer, scheduler, rng, history, promoted

    def own_state(self, rank: int) -> dict | None:
        """What process `rank` of a multi-process stage kept of its own (`rank_state`), if it did."""
        path = self.model_dir.parent / f"rank-{rank}.pt"
        return load_state(path) if path.is_file() else None


KEEP = 2  # in-stage steps kept, so one that fails to load leaves the one before it


def rng_state() -> dict:
    """The RNG states as tensors and plain values (what `torch.load(weights_only=True)` accepts):
    Python's, NumPy's, torch's CPU generator and, once the process uses CUDA, every GPU's (`cuda`)."""
    import numpy as np
    import torch

    name, keys, position, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(position),
                                                    int(has_gauss), float(gauss)],
             "torch": torch.get_rng_state()}
    # a process that never used CUDA has nothing to save, and asking would start CUDA on a GPU it may not hold
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore `rng_state()`'s states; a state saved before `cuda` was kept, or on a machine with
    other GPUs, restores what there is a generator for here (see set_cuda_rng_states)."""
    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    set_cuda_rng_states(state.get("cuda", []))


def set_cuda_rng_states(states: list) -> int:
    """Give each GPU here the saved state of the GPU with its index: the first min(saved, here)
    GPUs (none without CUDA); the others keep their own. Returns how many were restored.
    torch applies them when the process first uses CUDA."""
    import torch

    restorable = states[:torch.cuda.device_count()] if torch.cuda.is_available() else []
    for index, gpu_state in enumerate(restorable):
        torch.cuda.set_rng_state(gpu_state, index)
    return len(restorable)


def rank_state(optimizer, with_optimizer: bool) -> dict:
    """What each process of a multi-process stage keeps of its own: its RNG states and, where the
    optimizer's state is spread over the processes (FSDP), its part of it, sharded tensors as their
    local shards (plain tensors: loaded with weights_only like the rest)."""
    state = {"rng": rng_state()}
    if with_optimizer:
        state["optimizer"] = local_tensors(optimizer.state_dict())
    return state


def local_tensors(value):
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {key: local_tensors(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(local_tensors(item) for item in value)
    return value


def placed(optimizer_state: dict, optimizer) -> dict:
    """`local_tensors`' optimizer state with each shard placed as its parameter is (FSDP2's DTensors)."""
    import torch
    from torch.distributed.tensor import DTensor

    params = [param for group in optimizer.param_groups for param in group["params"]]

    def as_param(value, param):
        if isinstance(param, DTensor) and torch.is_tensor(value) and value.shape == param.to_local().shape \
                and value.dim() > 0:
            return DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape,
                                      stride=param.stride())
        return value

    state = {index: {key: as_param(value, params[int(index)]) for key, value in values.items()}
             for index, values in optimizer_state["state"].items()}
    return {**optimizer_state, "state": state}


def save_rank(ctx: StageContext, step: int, rank: int, state: dict) -> None:
    """Process `rank`'s own state into step-<step> (before the committing process marks it DONE)."""
    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    ctx.store.write_bytes(f"{ctx.scratch}/step-{step}/rank-{rank}.pt", buffer.getvalue())


def save(ctx: StageContext, step: int, model, state: dict, weights: dict | None = None, keep: int = KEEP) -> None:
    """Write step-<step> (model weights + trainer state) and drop older steps beyond `keep`.
    `weights`: the full state dict gathered from sharded training (None: the model's own)."""
    import torch

    local = ctx.workdir / "ckpt" / f"step-{step}"
    shutil.rmtree(local, ignore_errors=True)
    model.save_pretrained(str(local / "model"), state_dict=weights)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    (local / "state.pt").write_bytes(buffer.getvalue())
    remote = f"{ctx.scratch}/step-{step}"
    ctx.store.put_dir(local, remote)
    ctx.store.write_bytes(f"{remote}/DONE", b"ok")
    shutil.rmtree(local, ignore_errors=True)
    for old in _completed_steps(ctx)[:-keep]:
        ctx.store.remove(f"{ctx.scratch}/step-{old}")


def promote(ctx: StageContext, step: int, model, tokenizer, last_metrics: dict, weights: dict | None = None,
            kind: str = "checkpoint") -> str:
    """Commit the weights at `step` as the checkpoint artifact `<pipeline>/<stage>.step-<step>`.

    It is an ordinary checkpoint (loadable, evaluable, in lineage) that outlives the stage
    even if a later step fails; the same weights committed again give the same ref. A reward
    model's (`kind` reward_model) is committed as such and announces no checkpoint: no evaluation
    of a policy follows it.
    """
    local = ctx.workdir / "promote" / f"step-{step}"
    shutil.rmtree(local, ignore_errors=True)
    model.save_pretrained(str(local), state_dict=weights)
    tokenizer.save_pretrained(str(local))
    ref = ctx.store.commit(f"{ctx.output_name}.step-{step}", kind, local, producer=ctx.producer,
                           inputs=ctx.inputs, metrics={"promoted_at_step": step, **last_metrics})
    shutil.rmtree(local, ignore_errors=True)
    if kind == "checkpoint":
        ctx.announce_checkpoint(str(ref), step)
    return str(ref)


def _completed_steps(ctx: StageContext) -> list[int]:
    steps = []
    for name in ctx.store.listdir(ctx.scratch):
        match = _STEP.match(name)
        if match and ctx.store.exists(f"{ctx.scratch}/{name}/DONE"):
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest(ctx: StageContext) -> Resumed | None:
    """The newest in-stage checkpoint of this stage that loads, fetched locally; None if none does."""
    for step in reversed(_completed_steps(ctx)):
        local = ctx.store.get_dir(f"{ctx.scratch}/step-{step}", ctx.workdir / "resume" / f"step-{step}")
        try:
            return Resumed(step, local / "model", load_state(local / "state.pt"))
        except Exception as exc:  # truncated, tampered with, or from an older format: try the step before
            ctx.log(f"WARNING: in-stage checkpoint at step {step} does not load ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); trying the one before")
    return None


def load_state(path: Path) -> dict:
    """A trainer state: tensors and plain values only (no pickled objects, so no code runs)."""
    import torch

    return torch.load(path, weights_only=True)


def clear(ctx: StageContext) -> None:
    ctx.store.remove(ctx.scratch)
