"""A held-out slice of a training stage's data (sft, preference offline: `eval_fraction`), never
trained on, whose loss is measured every `eval_every` steps and after the last one.

The slice is drawn from each input dataset on its own (so the mix of the rest keeps its weights),
by a permutation seeded from the stage's seed: the same rows are held out on every run and every
resume. The measurement runs without gradients, in eval mode, on every process alike (a sharded
model's forwards are collectives), and is recorded in the step history as `held_out/<metric>`,
beside the training metric of the same name in the curves and the report (tasks/train/curves.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

SPLIT_SEED = 7_919  # keeps the held-out permutation apart from the batch order's (same stage seed)


@dataclass(frozen=True)
class HeldOutSplit:
    train: list[int]  # indices into the datasets concatenated in order, in index order
    held: list[int]
    sizes: list[int]  # training rows left of each dataset (what the batch mix draws from)


def split_held_out(sizes: list[int], fraction: float, seed: int) -> HeldOutSplit:
    """The split of datasets concatenated in order (`sizes`): from each, round(fraction * size)
    rows (at least one where fraction > 0) held out. Nothing is held out at fraction 0."""
    import torch

    train, held, kept, offset = [], [], [], 0
    for d, size in enumerate(sizes):
        count = max(1, round(fraction * size)) if fraction > 0 and size else 0
        order = torch.randperm(size, generator=torch.Generator().manual_seed(seed * SPLIT_SEED + d)).tolist()
        held += sorted(offset + i for i in order[:count])
        train += sorted(offset + i for i in order[count:])
        kept.append(size - count)
        offset += size
    return HeldOutSplit(train, held, kept)


def due(step: int, steps: int, every: int) -> bool:
    """Whether the held-out loss is measured after 0-based step `step` of `steps`."""
    return (step + 1) % every == 0 or step + 1 == steps


@contextlib.contextmanager
def measuring(model):
    """No gradients and eval mode (no dropout) inside; training mode again after."""
    import torch

    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train()


def held_out_metrics(values: dict[str, float]) -> dict[str, float]:
    """A measurement's metrics as the step history names them."""
    return {f"held_out/{name}": value for name, value in values.items()}
