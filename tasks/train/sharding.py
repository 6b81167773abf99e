"""Training whose weights are spread over the processes (FSDP, DeepSpeed ZeRO-3).

There every forward and backward of the model is a collective: each process gathers the layers'
weights from the others and scatters their gradients back. Processes must therefore run as many
of them, in the same order, or the one that runs fewer waits for the others forever. Three rules
follow, applied by tasks/train/loop.py's Learner and the stages:

- a step's micro-batches are fixed-size pieces of the process's share, one forward each (no length
  buckets, whose number depends on the data), and every process runs as many as the process with
  the most: the others add zero-weight copies of their last piece (`equalized`);
- a stage that decodes with the trained model (rl's local rollouts: a different number of decode
  steps on every process) does so on whole weights gathered once before (`full_weights`), with no
  collective per step;
- everything a process computes once per step happens on every process (the reference
  log-probs of rl's KL, a piece at a time like the update).
"""

from __future__ import annotations

import contextlib
import os

SHARDED_TYPES = ("FSDP", "DEEPSPEED")  # accelerate's distributed types that shard weights and optimizer state


def is_sharded(model, accelerator) -> bool:
    """Whether `model`'s weights are spread over the processes: prepared so by accelerate, or wrapped
    by torch's FSDP (FSDP1's FullyShardedDataParallel, FSDP2's fully_shard)."""
    if accelerator.distributed_type.value in SHARDED_TYPES:
        return True
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return isinstance(model, (FSDPModule, FullyShardedDataParallel))


def most_over_processes(count: int, device) -> int:
    """The largest `count` any process holds (a collective: every process calls it)."""
    return int(reduced_over_processes([count], device, "max")[0])


def summed_over_processes(values: list[float], device) -> list[float]:
    """Each of `values` summed over the processes (a collective: every process calls it): a step's
    loss and counts over the whole batch, not one process's share."""
    return reduced_over_processes(values, device, "sum")


def reduced_over_processes(values: list[float], device, op: str) -> list[float]:
    """Each of `values` reduced (`sum` or `max`) over the processes; itself outside a process group."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(values)
    total = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(total, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return total.tolist()


def equalized(pieces: list, sharded: bool, device) -> list[tuple[object, float]]:
    """(piece, weight) of each micro-batch to run: every piece at weight 1, then, where the weights
    are sharded, zero-weight copies of the last piece until this process runs as many as the
    process with the most. A zero-weight piece runs the forward and backward (the collectives) and
    adds nothing to the gradient."""
    weighted = [(piece, 1.0) for piece in pieces]
    if not sharded:
        return weighted
    most = most_over_processes(len(pieces), device)
    return weighted + [(pieces[-1], 0.0)] * (most - len(pieces))


@contextlib.contextmanager
def full_weights(model):
    """Inside the block every process holds `model`'s whole weights and a forward is no collective
    (decoding, whose number of steps differs between processes). One gathering on the way in (all
    processes must enter together), freed on the way out; an unsharded model is left as it is."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            yield
        return
    modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for module in modules:
        module.set_reshard_after_forward(False)
        module.unshard()
    try:
        yield
    finally:
        for module in modules:
            module.reshard()
            module.set_reshard_after_forward(True)


def deepspeed_batches(config: dict, micro_batch_size: int | None) -> None:
    """A DeepSpeed config fit for the Learner: no fixed accumulation count (the Learner marks each
    step's boundary, and its losses are already normalised per step: DeepSpeed would divide them
    again), and the micro-batch size DeepSpeed requires when no dataloader is prepared."""
    config["gradient_accumulation_steps"] = 1
    if config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        config["train_micro_batch_size_per_gpu"] = micro_batch_size or 1
    config["train_batch_size"] = config["train_micro_batch_size_per_gpu"] * int(os.environ.get("WORLD_SIZE", "1"))
    config.setdefault("zero_allow_untested_optimizer", True)  # the stage's own AdamW under ZeRO
    # ZeRO-3 spreads the weights: a checkpoint needs them gathered whole (accelerate's get_state_dict)
    zero = config.setdefault("zero_optimization", {})
    if isinstance(zero, dict):
        zero["stage3_gather_16bit_weights_on_model_save"] = True
