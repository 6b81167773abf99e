"""`sft`: supervised fine-tuning with a completion-only loss, on accelerate, resumable."""

from __future__ import annotations

from dataclasses import dataclass

from models.loading import load_tokenizer, resolve_base, set_threads
from models.losses import IGNORE_INDEX, completion_nll
from models.sampling import chat_prompt
from tasks.config import SftStage
from tasks.datasets import read_rows
from tasks.stage import StageContext, StageOutput
from tasks.training import batch_indices, optimizer_step, start_training, total_steps


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]
    truncated: bool


def encode_ids(prompt_ids: list[int], completion_ids: list[int], max_len: int,
               loss_mask: list[int] | None = None) -> Example:
    """Prompt token ids (masked) + completion token ids (trained on where `loss_mask` is 1:
    not on env-written tokens), cut at `max_len`."""
    trained = completion_ids if loss_mask is None else \
        [token if keep else IGNORE_INDEX for token, keep in zip(completion_ids, loss_mask)]
    input_ids = (prompt_ids + completion_ids)[:max_len]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + trained)[:max_len]
    return Example(input_ids, labels, len(prompt_ids) + len(completion_ids) > max_len)


def encode_example(tokenizer, prompt: str, completion: str, max_len: int) -> Example:
    """Chat-formatted prompt (masked) + completion + end token (trained on)."""
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return encode_ids(chat_prompt(tokenizer, prompt), completion_ids, max_len)


def encode_row(tokenizer, row: dict, max_len: int) -> Example:
    """A text row (prompt, completion), or a multi-turn row with its token ids and loss mask
    (the env's observation tokens are not trained on)."""
    if "token_ids" not in row:  # single-turn datasets are text only
        return encode_example(tokenizer, row["prompt"], row["completion"], max_len)
    return encode_ids([], list(row["token_ids"]), max_len, list(row["loss_mask"]))


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


def train_step(model, batch: list[Example], pad_id: int, accelerator, optimizer, scheduler) -> tuple[float, int]:
    """One optimizer step on a batch; returns (loss, non-pad tokens processed)."""
    ids, mask, labels = collate(batch, pad_id, accelerator.device)
    loss, _ = completion_nll(model(input_ids=ids, attention_mask=mask).logits, labels)
    optimizer_step(model, loss, accelerator, optimizer, scheduler)
    return loss.item(), int(mask.sum())


def start_checkpoint(stage: SftStage, ctx: StageContext) -> str:
    """The folder training starts from: the input policy's checkpoint or the base model."""
    return str(ctx.fetch(stage.policy)) if stage.policy else resolve_base(ctx.model.base)


def run(stage: SftStage, ctx: StageContext) -> dict[str, StageOutput]:
    set_threads(ctx.model)
    source = start_checkpoint(stage, ctx)
    tokenizer = load_tokenizer(source)
    rows = [row for data in stage.datasets() for row in read_rows(ctx.fetch(data))]
    examples = [encode_row(tokenizer, row, stage.max_seq_len) for row in rows]
    training = start_training(ctx, stage, source, total_steps(stage, len(examples)), tokenizer)
    for step in range(training.start, training.steps):
        batch = [examples[i] for i in training.shard(batch_indices(len(examples), stage.batch_size, stage.seed, step))]
        loss, tokens = train_step(training.model, batch, tokenizer.pad_token_id, training.accelerator,
                                  training.optimizer, training.scheduler)
        training.record(step, tokens, loss=loss)
    return training.finish({"final_loss": training.history[-1]["loss"], "examples": len(examples),
                            "truncated_examples": sum(e.truncated for e in examples)})
