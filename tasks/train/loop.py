"""What the training stages (sft, preference, rl) share: data order, schedule, optimizer and a
resumable step loop with in-stage checkpoints.

The data order is a pure function of (seed, step), so a stage resumed from an in-stage
checkpoint sees exactly the batches it would have seen.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

from models.loading import enable_activation_checkpointing, load_model
from tasks.common.context import StageContext, StageOutput
from tasks.common.progress import Progress
from tasks.config import DatasetTrainStage, TrainStage
from tasks.train import checkpointing
from tasks.train.learner import Learner
from tasks.train.sharding import SHARDED_TYPES, deepspeed_batches
from tasks.train.trackers import Trackers

LOG_EVERY = 25
PROGRESS_METRICS = ("loss", "reward", "accuracy", "reward_accuracy")  # what the progress line shows


def batch_indices(n_examples: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Indices of the batch at `step`: epoch-wise seeded permutations, batches never straddle epochs."""
    import torch

    per_epoch = max(1, n_examples // batch_size)
    epoch, position = divmod(step, per_epoch)
    order = torch.randperm(n_examples, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return order[position * batch_size:(position + 1) * batch_size].tolist()


def mixed_batch_indices(sizes: list[int], weights: list[float], batch_size: int, seed: int, step: int) -> list[int]:
    """`batch_indices` over datasets concatenated in order (`sizes`), drawn by `weights`: each
    epoch of sum(sizes) examples holds round(share * total) from each dataset, walking through its
    own seeded permutations (a small dataset with a large weight repeats). One dataset: exactly
    `batch_indices`."""
    import torch

    if len(sizes) == 1:
        return batch_indices(sizes[0], batch_size, seed, step)
    total = sum(sizes)
    per_epoch = max(1, total // batch_size)
    epoch, position = divmod(step, per_epoch)
    epoch_rows, offset = [], 0
    live = sum(weight for size, weight in zip(sizes, weights) if size)  # an empty dataset draws nothing
    for d, (size, weight) in enumerate(zip(sizes, weights)):
        count = round(weight / live * total) if size else 0
        start = epoch * count
        for turn in range(start // size, (start + count - 1) // size + 1) if count else ():
            order = torch.randperm(size, generator=torch.Generator().manual_seed(seed * 100_003 + d * 7919 + turn))
            lo, hi = max(start - turn * size, 0), min(start + count - turn * size, size)
            epoch_rows += (order[lo:hi] + offset).tolist()
        offset += size
    order = torch.randperm(len(epoch_rows), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return [epoch_rows[i] for i in order[position * batch_size:(position + 1) * batch_size].tolist()]


def lr_factor(step: int, warmup: int, total: int, schedule: str = "cosine") -> float:
    """Linear warm-up, then cosine decay to 10% of the peak (or constant at the peak)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def total_steps(stage: DatasetTrainStage, n_examples: int) -> int:
    if stage.max_steps is not None:
        return stage.max_steps
    return max(1, math.ceil(stage.epochs * max(1, n_examples // stage.batch_size)))


def make_optimizer(model, stage: TrainStage, steps: int):
    """AdamW over the trainable parameters with the warm-up + cosine (or constant) schedule."""
    import torch

    trainable = [p for p in model.parameters() if p.requires_grad]
    # fused: one kernel for every parameter's update (5x less optimizer time at the CPU preset;
    # TRL's default too), where torch has it: plain parameters on the CPU or CUDA
    fused = all(type(p) is torch.nn.Parameter and p.device.type in ("cpu", "cuda") for p in trainable)
    optimizer = torch.optim.AdamW(trainable, lr=stage.learning_rate, weight_decay=stage.weight_decay,
                                  fused=fused or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, stage.warmup_steps, steps, stage.lr_schedule))
    return optimizer, scheduler


@dataclass
class Training:
    """A model being trained by a stage, with everything a resume needs."""

    ctx: StageContext
    stage: TrainStage
    steps: int
    model: object
    optimizer: object
    scheduler: object
    accelerator: object
    tokenizer: object
    start: int = 0
    history: list = field(default_factory=list)
    promoted: list = field(default_factory=list)  # refs of the in-stage checkpoints committed so far
    tokens_seen: int = 0
    artifact_kind: str = "checkpoint"  # what its weights are committed as (a reward model's: reward_model)
    began: float = field(default_factory=time.monotonic)
    progress: Progress | None = None  # set by start_training, once the resumed step is known
    trackers: Trackers = field(default_factory=Trackers)  # the stage's report_to, started by start_training

    def record(self, step: int, tokens: int, **values: float) -> None:
        """Log step `step` (0-based); save and promote an in-stage checkpoint when one is due."""
        self.tokens_seen += tokens
        entry = {"step": step + 1, **{k: round(v, 5) for k, v in values.items()}, "tokens": tokens,
                 "tokens_per_second": round(self.tokens_per_second, 1), "lr": self.scheduler.get_last_lr()[0]}
        self.history.append(entry)
        self.trackers.log_step(entry)
        if self.ctx.is_main:  # one progress line per stage, not one per process
            self.progress.update(step + 1, **{k: v for k, v in values.items() if k in PROGRESS_METRICS},
                                 tokens_per_second=self.tokens_per_second)
        if (step + 1) % self.stage.checkpoint_every == 0 and step + 1 < self.steps:
            self._checkpoint(step + 1)

    @property
    def learner(self) -> Learner:
        return Learner(self.model, self.accelerator, self.optimizer, self.scheduler, self.stage.micro_batch_size)

    def shard(self, batch: list) -> list:
        """This process's share of a batch: all of it, or every N-th example under N processes
        (DDP averages their gradients, so a step still sees the whole batch). A batch smaller than
        N goes whole to every process (the same gradient N times, averaged: still that batch's)."""
        processes = self.accelerator.num_processes
        return batch if len(batch) < processes else batch[self.accelerator.process_index::processes]

    def _checkpoint(self, step: int) -> None:
        """Scratch state for a resume, and the weights committed as `<pipeline>/<stage>.step-<n>`
        (by the committing process only; the others' weights are the same)."""
        weights = self.gathered_weights()  # every process takes part in the gathering
        if self.accelerator.num_processes > 1:
            own = checkpointing.rank_state(self.optimizer, self.sharded and not self.deepspeed)
            checkpointing.save_rank(self.ctx, step, self.accelerator.process_index, own)
            self.accelerator.wait_for_everyone()  # every process's part is in before the step is marked DONE
        if not self.ctx.is_main:
            return
        model = self.accelerator.unwrap_model(self.model)
        ref = checkpointing.promote(self.ctx, step, model, self.tokenizer, self.history[-1], weights,
                                   self.artifact_kind)
        self.promoted.append(ref)
        state = {"scheduler": self.scheduler.state_dict(), "rng": checkpointing.rng_state(),
                 "history": self.history, "promoted": self.promoted, "trackers": self.trackers.ids}
        if not self.sharded:  # a sharded optimizer's state is spread over the processes: not kept
            state["optimizer"] = self.optimizer.state_dict()
        checkpointing.save(self.ctx, step, model, state, weights)
        self._show_report(step, ref)

    @property
    def sharded(self) -> bool:
        """FSDP or DeepSpeed (an accelerate_config): weights and optimizer state spread over the processes."""
        return self.accelerator.distributed_type.value in SHARDED_TYPES

    @property
    def deepspeed(self) -> bool:
        """DeepSpeed keeps its optimizer state inside its engine, in its own format: not kept here."""
        return self.accelerator.distributed_type.value == "DEEPSPEED"

    def gathered_weights(self) -> dict | None:
        """The full state dict, gathered from every process, when training is sharded (None otherwise:
        save_pretrained reads the model's own). Every process must call it: it is a collective."""
        return self.accelerator.get_state_dict(self.model) if self.sharded else None

    def _show_report(self, step: int, ref: str) -> None:
        """The report so far, its curves inline, for the stage's report artifact in Prefect (best
        effort: a display that fails never fails the stage)."""
        from tasks.train.curves import report_so_far

        if self.ctx.announce_path is None:  # no orchestrator to show it
            return
        note = (f"*In progress: step {step} of {self.steps}, checkpoint `{ref}`. The committed report "
                "replaces this one when the stage ends.*")
        try:
            self.ctx.show_report(report_so_far(self.history, self.ctx.workdir / "report-so-far",
                                               f"{self.ctx.pipeline}/{self.ctx.stage_id}", note), step)
        except Exception as exc:  # noqa: BLE001
            self.ctx.log(f"report at step {step} not shown: {type(exc).__name__}: {exc}", "WARNING")

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_seen / max(1e-9, time.monotonic() - self.began)

    def finish(self, metrics: dict) -> dict[str, StageOutput]:
        """The trained model (full weights or adapter, with its tokenizer) and the training report
        (metrics.jsonl, curves.png, report.md) as the stage's outputs."""
        from tasks.train.curves import write_training_report

        out_dir, report_dir = self.ctx.workdir / "checkpoint", self.ctx.workdir / "report"
        self.accelerator.unwrap_model(self.model).save_pretrained(str(out_dir), state_dict=self.gathered_weights())
        self.tokenizer.save_pretrained(str(out_dir))
        write_training_report(self.history, report_dir, f"{self.ctx.pipeline}/{self.ctx.stage_id}")
        self.trackers.finish()
        metrics = {"steps": self.steps, "resumed_from_step": self.start,
                   "train_tokens_per_second": round(self.tokens_per_second, 1),
                   "promoted_checkpoints": self.promoted, **metrics}
        return {"checkpoint": StageOutput(self.artifact_kind, out_dir, metrics),
                "report": StageOutput("report", report_dir, {})}


def make_accelerator(stage: TrainStage, device: str):
    """accelerate's Accelerator on the stage's device, with its mixed precision (autocast over
    fp32 weights). fp16 autocast needs CUDA: refused on the CPU."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    if stage.mixed_precision == "fp16" and device == "cpu":
        raise ValueError(f"stage {stage.id!r}: mixed_precision: fp16 needs a CUDA device and this stage runs on "
                         "the CPU; use bf16 (CPU and recent GPUs) or no")
    # accelerate drops a DeepSpeed config when told to use the CPU: DeepSpeed finds the CPU itself,
    # and gloo must be named there, or accelerate counts one process where DeepSpeed runs several
    deepspeed_on_cpu = os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true" and device == "cpu"
    handlers = [InitProcessGroupKwargs(backend="gloo")] if deepspeed_on_cpu else []
    accelerator = Accelerator(cpu=device == "cpu" and not deepspeed_on_cpu, mixed_precision=stage.mixed_precision,
                              kwargs_handlers=handlers)
    if accelerator.state.deepspeed_plugin is not None:
        deepspeed_batches(accelerator.state.deepspeed_plugin.deepspeed_config, stage.micro_batch_size)
    return accelerator


def start_training(ctx: StageContext, stage: TrainStage, source: str, steps: int, tokenizer,
                   updates_per_step: int = 1, reward_head: bool = False) -> Training:
    """Load the model from the stage's last in-stage checkpoint if there is one, else from `source`.

    The learning-rate schedule spans `steps * updates_per_step` optimizer updates. `reward_head`:
    the model is a reward model (a scalar head, committed as a `reward_model` artifact).
    """
    import torch

    torch.manual_seed(stage.seed)
    resumed = checkpointing.latest(ctx)
    accelerator = make_accelerator(stage, ctx.device)
    model = load_model(resumed.model_dir if resumed else source, ctx.model, trainable=True,
                       reward_head=reward_head)
    if stage.gradient_checkpointing:
        enable_activation_checkpointing(model)
    optimizer, scheduler = make_optimizer(model, stage, steps * updates_per_step)
    # the schedule stays ours, stepped once per optimizer step: accelerate's wrapper would step it once
    # per process (it assumes a dataloader split into bigger batches), ending it N times too early
    model, optimizer = accelerator.prepare(model, optimizer)
    training = Training(ctx, stage, steps, model, optimizer, scheduler, accelerator, tokenizer,
                        artifact_kind="reward_model" if reward_head else "checkpoint")
    if resumed:
        own = resumed.own_state(accelerator.process_index) if accelerator.num_processes > 1 else None
        if "optimizer" in resumed.state:
            optimizer.load_state_dict(resumed.state["optimizer"])
        elif own is not None and "optimizer" in own:
            optimizer.load_state_dict(checkpointing.placed(own["optimizer"], optimizer))
        else:
            ctx.log("the in-stage checkpoint holds no optimizer state (DeepSpeed's stays in its engine): Adam's "
                    "moments restart", "WARNING")
        scheduler.load_state_dict(resumed.state["scheduler"])
        checkpointing.set_rng_state(own["rng"] if own is not None else resumed.state["rng"])
        training.start, training.history = resumed.step, resumed.state["history"]
        training.promoted = resumed.state["promoted"]
        ctx.log(f"resuming from in-stage checkpoint at step {resumed.step}/{steps}")
    if accelerator.num_processes > 1 and ctx.is_main:
        ctx.log(f"{accelerator.num_processes} processes ({accelerator.distributed_type.value}), each on its "
                "share of every batch")
    training.trackers = Trackers.start(ctx, stage, resumed.state.get("trackers", {}) if resumed else {},
                                       training.history)
    training.progress = Progress(steps, training.start, ctx.stage_id, log_every=LOG_EVERY,
                                 on_update=ctx.report_progress)
    model.train()
    return training
