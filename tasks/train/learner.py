"""One optimizer step of a training stage in micro-batches: how a process's share of a batch is cut
(`length_buckets`, or fixed pieces when the weights are sharded) and how their gradients add up to
the whole batch's (`Learner`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from tasks.train.sharding import equalized, is_sharded, summed_over_processes

PIECE_OVERHEAD_TOKENS = 512  # one more forward + backward costs about as much as this many padded tokens
SPAN_ROWS = 256  # the longest micro-batch the cut considers: past it, one call's overhead is noise


def length_buckets(widths: list[tuple[int, ...]], max_rows: int | None = None,
                   overhead: int = PIECE_OVERHEAD_TOKENS) -> list[list[int]]:
    """Row indices cut into micro-batches that waste the least on padding.

    A micro-batch of n rows pads each part k (left-padded prompt, right-padded completion) to its
    longest, so costs n · Σ_k max_k plus `overhead` for the call itself. Rows sorted by total
    length, the cheapest cut into runs of at most `max_rows` comes from a dynamic programme
    (O(n · SPAN_ROWS)). One straggling 64-token row no longer pads 63 rows of ~38 to its length.
    """
    order = sorted(range(len(widths)), key=lambda i: (sum(widths[i]), i))
    best, cut = [0.0] + [float("inf")] * len(order), [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        longest = [0] * len(widths[0])
        for start in range(end - 1, -1, -1):
            if end - start > (max_rows or SPAN_ROWS):
                break
            longest = [max(a, b) for a, b in zip(longest, widths[order[start]])]
            cost = best[start] + (end - start) * sum(longest) + overhead
            if cost < best[end]:
                best[end], cut[end] = cost, start
    buckets, end = [], len(order)
    while end > 0:
        buckets.append(sorted(order[cut[end]:end]))  # rows keep their order within a micro-batch
        end = cut[end]
    return buckets[::-1]


@dataclass
class Learner:
    """A model and its optimizer, as one step's micro-batches update it.

    A step's loss is the sum of its micro-batches' losses, each normalised by the whole step's
    count (tokens, pairs, rows: what the loss averages over) and multiplied by `shards`: DDP
    averages gradients over the processes that split the batch. So the step's gradient is that of
    the whole batch in one piece, whatever the micro-batch size and the number of processes.
    """

    model: object
    accelerator: object
    optimizer: object
    scheduler: object
    micro_batch_size: int | None = None  # None: the whole share at once

    def pieces(self, rows: list) -> list[list]:
        size = self.micro_batch_size or len(rows) or 1
        return [rows[start:start + size] for start in range(0, len(rows), size)]

    @property
    def sharded(self) -> bool:
        """Weights spread over the processes: every forward and backward is a collective (tasks/train/sharding.py)."""
        return is_sharded(self.model, self.accelerator)

    def buckets(self, rows: list, widths: list[tuple[int, ...]]) -> list[list]:
        """`rows` regrouped by length into micro-batches of at most `micro_batch_size` (see
        length_buckets); `widths[i]` holds the lengths of row i's separately padded parts. Sharded,
        fixed-size pieces: how many length buckets there are depends on each process's data."""
        if self.sharded:
            return self.pieces(rows)
        return [[rows[i] for i in bucket] for bucket in length_buckets(widths, self.micro_batch_size)]

    def step_totals(self, values: list[float], shards: int) -> list[float]:
        """A step's loss sums and counts over its whole batch: summed over the processes that split
        it (`shards` > 1), as they are where each holds the whole batch."""
        return summed_over_processes(values, self.accelerator.device) if shards > 1 else list(values)

    def equalized(self, pieces: list) -> list[tuple[object, float]]:
        """(piece, weight) of each micro-batch to run; sharded, as many as on the process with the most
        (zero-weight copies added: tasks/train/sharding.py)."""
        return equalized(pieces, self.sharded, self.accelerator.device)

    def shards(self, batch: list) -> int:
        """How many processes split `batch` (Training.shard): all of them, or 1 when each holds it whole."""
        processes = self.accelerator.num_processes
        return processes if len(batch) >= processes else 1

    def backward(self, loss, last: bool) -> None:
        """Accumulate one micro-batch's gradients; processes exchange theirs only after the last.
        DeepSpeed's engine steps itself at the accumulation boundary accelerate marks
        (`sync_gradients`): the step's last micro-batch, not every one."""
        if self.accelerator.distributed_type.value == "DEEPSPEED":
            self.accelerator.gradient_state._set_sync_gradients(last)
            try:
                self.accelerator.backward(loss)
            finally:
                self.accelerator.gradient_state._set_sync_gradients(True)
            return
        sync = contextlib.nullcontext() if last or self.accelerator.num_processes == 1 \
            else self.accelerator.no_sync(self.model)
        with sync:
            self.accelerator.backward(loss)

    def update(self, max_grad_norm: float = 1.0) -> None:
        """Clip, step, zero the gradients, advance the schedule. Under DeepSpeed the engine did the
        first three at the step's last backward (clipping at accelerate's 1.0): only the schedule
        (the stage's own, never handed to the engine) moves here."""
        if self.accelerator.distributed_type.value != "DEEPSPEED":
            self.accelerator.clip_grad_norm_(self.model.parameters(), max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
