"""`sft`: supervised fine-tuning with a completion-only loss, on accelerate, resumable.

The data order is a pure function of (seed, step), so a stage resumed from an in-stage
checkpoint sees exactly the batches it would have seen.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from models.loading import load_model, load_tokenizer, resolve_base, set_threads
from models.losses import IGNORE_INDEX, completion_nll
from tasks import checkpointing
from tasks.config import SftStage
from tasks.datasets import read_rows
from tasks.stage import StageContext, StageOutput

LOG_EVERY = 25


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]
    truncated: bool


def encode_example(tokenizer, prompt: str, completion: str, max_len: int) -> Example:
    """Chat-formatted prompt (masked) + completion + end token (trained on)."""
    prompt_text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                add_generation_prompt=True)
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    input_ids = (prompt_ids + completion_ids)[:max_len]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + completion_ids)[:max_len]
    return Example(input_ids, labels, len(prompt_ids) + len(completion_ids) > max_len)


def collate(examples: list[Example], pad_id: int, device):
    import torch

    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        ids[row, :n] = torch.tensor(example.input_ids)
        labels[row, :n] = torch.tensor(example.labels)
        mask[row, :n] = 1
    return ids.to(device), mask.to(device), labels.to(device)


def batch_indices(n_examples: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Indices of the batch at `step`: epoch-wise seeded permutations, batches never straddle epochs."""
    import torch

    per_epoch = max(1, n_examples // batch_size)
    epoch, position = divmod(step, per_epoch)
    order = torch.randperm(n_examples, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return order[position * batch_size:(position + 1) * batch_size].tolist()


def lr_factor(step: int, warmup: int, total: int, schedule: str = "cosine") -> float:
    """Linear warm-up, then cosine decay to 10% of the peak (or constant at the peak)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def total_steps(stage: SftStage, n_examples: int) -> int:
    if stage.max_steps is not None:
        return stage.max_steps
    return max(1, math.ceil(stage.epochs * max(1, n_examples // stage.batch_size)))


def make_optimizer(model, stage: SftStage, steps: int):
    """AdamW over the trainable parameters with the warm-up + cosine (or constant) schedule."""
    import torch

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=stage.learning_rate, weight_decay=stage.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, stage.warmup_steps, steps, stage.lr_schedule))
    return optimizer, scheduler


def train_step(model, batch: list[Example], pad_id: int, accelerator, optimizer, scheduler) -> tuple[float, int]:
    """One optimizer step on a batch; returns (loss, non-pad tokens processed)."""
    ids, mask, labels = collate(batch, pad_id, accelerator.device)
    loss, _ = completion_nll(model(input_ids=ids, attention_mask=mask).logits, labels)
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item(), int(mask.sum())


def start_checkpoint(stage: SftStage, ctx: StageContext) -> str:
    """The folder training starts from: the input policy's checkpoint or the base model."""
    return str(ctx.fetch(stage.policy)) if stage.policy else resolve_base(ctx.model.base)


def run(stage: SftStage, ctx: StageContext) -> dict[str, StageOutput]:
    import torch
    from accelerate import Accelerator

    set_threads(ctx.model)
    torch.manual_seed(stage.seed)
    source = start_checkpoint(stage, ctx)
    tokenizer = load_tokenizer(source)
    rows = read_rows(ctx.fetch(stage.data))
    examples = [encode_example(tokenizer, r["prompt"], r["completion"], stage.max_seq_len) for r in rows]
    steps = total_steps(stage, len(examples))

    resumed = checkpointing.latest(ctx)
    model = load_model(resumed.model_dir if resumed else source, ctx.model, trainable=True)
    optimizer, scheduler = make_optimizer(model, stage, steps)
    accelerator = Accelerator()
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    start, history = 0, []
    if resumed:
        optimizer.load_state_dict(resumed.state["optimizer"])
        scheduler.load_state_dict(resumed.state["scheduler"])
        checkpointing.set_rng_state(resumed.state["rng"])
        start, history = resumed.step, resumed.state["history"]
        ctx.log(f"resuming from in-stage checkpoint at step {start}/{steps}")

    model.train()
    tokens_seen, began = 0, time.monotonic()
    for step in range(start, steps):
        batch = [examples[i] for i in batch_indices(len(examples), stage.batch_size, stage.seed, step)]
        loss, tokens = train_step(model, batch, tokenizer.pad_token_id, accelerator, optimizer, scheduler)
        tokens_seen += tokens
        history.append({"step": step + 1, "loss": round(loss, 5), "lr": scheduler.get_last_lr()[0]})
        if (step + 1) % LOG_EVERY == 0 or step + 1 == steps:
            rate = tokens_seen / max(1e-9, time.monotonic() - began)
            ctx.log(f"step {step + 1}/{steps} loss {loss:.4f} ({rate:,.0f} tokens/s)")
        if (step + 1) % stage.checkpoint_every == 0 and step + 1 < steps:
            state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                     "rng": checkpointing.rng_state(), "history": history}
            checkpointing.save(ctx, step + 1, accelerator.unwrap_model(model), state)

    out_dir = ctx.workdir / "checkpoint"
    accelerator.unwrap_model(model).save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    seconds = time.monotonic() - began
    metrics = {"steps": steps, "resumed_from_step": start, "final_loss": history[-1]["loss"] if history else None,
               "examples": len(examples), "truncated_examples": sum(e.truncated for e in examples),
               "train_tokens_per_second": round(tokens_seen / max(1e-9, seconds), 1)}
    return {"checkpoint": StageOutput("checkpoint", out_dir, metrics)}
