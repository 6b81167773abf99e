"""A workload split across the processes of a multi-GPU stage (`gpus: N`, one process per GPU).

Items (RL groups, generate's prompts, evaluate's tasks) go round-robin: process r of N takes
items r, r + N, r + 2N, … Each item is seeded by its own index (models/sampling.py seeds every
row), so what an item produces does not depend on which process made it. The results are then
exchanged, so every process holds all of them in item order: what one process would have made.

The exchange is JSON in byte tensors through torch.distributed (all_gather): no pickle, even
between a stage's own processes.
"""

from __future__ import annotations

import json
import os
from typing import Callable


def world(device: str = "cpu") -> tuple[int, int]:
    """(this process's rank, number of processes); a multi-process stage's process group is
    started here if nothing started it yet (generate and evaluate have no Accelerator)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        from accelerate import PartialState

        PartialState(cpu=device == "cpu")
    return dist.get_rank(), dist.get_world_size()


def share(n_items: int, rank: int, size: int) -> list[int]:
    """The item indices process `rank` of `size` takes: round-robin."""
    return list(range(rank, n_items, size))


def split_and_gather(n_items: int, work: Callable[[list[int]], list], device: str = "cpu",
                     encode: Callable = lambda item: item, decode: Callable = lambda index, data: data) -> list:
    """`work(indices)` -> one result per index, on this process's share of range(n_items); returns
    every index's result, in index order, on every process. `encode`/`decode` turn a result into
    JSON values and back (`decode(index, data)`); a single process uses its results as they are."""
    rank, size = world(device)
    mine = share(n_items, rank, size)
    results = work(mine)
    if size == 1:
        return results
    gathered: list = [None] * n_items
    for index, result in zip(mine, results):
        gathered[index] = result
    for other, payload in enumerate(all_gather_json([encode(result) for result in results], device)):
        if other != rank:
            for index, data in zip(share(n_items, other, size), payload):
                gathered[index] = decode(index, data)
    return gathered


def all_gather_json(values: list, device: str = "cpu") -> list[list]:
    """Every process's `values` (JSON-serializable; NaN allowed), in rank order."""
    import torch
    import torch.distributed as dist

    on = device if dist.get_backend() == "nccl" else "cpu"  # NCCL moves CUDA tensors only
    data = torch.frombuffer(bytearray(json.dumps(values).encode()), dtype=torch.uint8).to(on)
    sizes = [torch.zeros(1, dtype=torch.long, device=on) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.long, device=on))
    longest = max(int(size) for size in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=on)
    padded[:data.numel()] = data
    buffers = [torch.zeros(longest, dtype=torch.uint8, device=on) for _ in sizes]
    dist.all_gather(buffers, padded)
    return [json.loads(buffer[:int(size)].cpu().numpy().tobytes().decode()) for buffer, size in zip(buffers, sizes)]
