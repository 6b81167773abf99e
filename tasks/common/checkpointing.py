"""In-stage checkpoints of training stages, kept in the store so any worker can resume.

Layout: scratch/<stage cache key>/step-<n>/{model/, state.pt, DONE}; DONE is written last,
so a step folder without it is ignored (the stage was killed while saving).
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


def rng_state() -> dict:
    import numpy as np
    import torch

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save(ctx: StageContext, step: int, model, state: dict, keep: int = 1) -> None:
    """Write step-<step> (model weights + trainer state) and drop older steps beyond `keep`."""
    import torch

    local = ctx.workdir / "ckpt" / f"step-{step}"
    shutil.rmtree(local, ignore_errors=True)
    model.save_pretrained(str(local / "model"))
    buffer = io.BytesIO()
    torch.save(state, buffer)
    (local / "state.pt").write_bytes(buffer.getvalue())
    remote = f"{ctx.scratch}/step-{step}"
    ctx.store.put_dir(local, remote)
    ctx.store.write_bytes(f"{remote}/DONE", b"ok")
    shutil.rmtree(local, ignore_errors=True)
    for old in _completed_steps(ctx)[:-keep]:
        ctx.store.remove(f"{ctx.scratch}/step-{old}")


def promote(ctx: StageContext, step: int, model, tokenizer, last_metrics: dict) -> str:
    """Commit the weights at `step` as the checkpoint artifact `<pipeline>/<stage>.step-<step>`.

    It is an ordinary checkpoint (loadable, evaluable, in lineage) that outlives the stage
    even if a later step fails; the same weights committed again give the same ref.
    """
    local = ctx.workdir / "promote" / f"step-{step}"
    shutil.rmtree(local, ignore_errors=True)
    model.save_pretrained(str(local))
    tokenizer.save_pretrained(str(local))
    ref = ctx.store.commit(f"{ctx.output_name}.step-{step}", "checkpoint", local, producer=ctx.producer,
                           inputs=ctx.inputs, metrics={"promoted_at_step": step, **last_metrics})
    shutil.rmtree(local, ignore_errors=True)
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
    """The newest complete in-stage checkpoint of this stage, fetched locally, if any."""
    import torch

    steps = _completed_steps(ctx)
    if not steps:
        return None
    step = steps[-1]
    local = ctx.store.get_dir(f"{ctx.scratch}/step-{step}", ctx.workdir / "resume" / f"step-{step}")
    state = torch.load(local / "state.pt", weights_only=False)
    return Resumed(step, local / "model", state)


def clear(ctx: StageContext) -> None:
    ctx.store.remove(ctx.scratch)
