"""`sft`: supervised fine-tuning with a completion-only loss, on accelerate, resumable.

Its data: synthesized traces, or a user's text, prompt-completion or conversational datasets
(the dataset stage), mixed by weight (`data: {chats: 0.7, tools: 0.3}`; a list: equal weights).
A conversation trains on its assistant turns only, masks taken from the model's chat template."""

from __future__ import annotations

from typing import Literal

from models.loading import load_tokenizer, resolve_base, set_threads
from models.token_logps import label_logps
from tasks.common.context import StageContext, StageOutput
from tasks.common.datasets import read_rows
from tasks.common.encoding import Example, collate, encode_row
from tasks.config import PLOT_MODULES, DatasetTrainStage, HeldOutLoss
from tasks.train.held_out import due, held_out_metrics, measuring, split_held_out
from tasks.train.learner import Learner
from tasks.train.loop import mixed_batch_indices, start_training, total_steps


class SftStage(DatasetTrainStage, HeldOutLoss):
    """Supervised fine-tuning with a completion-only loss."""

    outputs = ("checkpoint", "report")
    primary = "checkpoint"
    produces = "checkpoint"
    preload = ("peft", "accelerate", *PLOT_MODULES)  # curves at checkpoints

    kind: Literal["sft"]
    policy: str | None = None  # a checkpoint stage; the spec's base model when absent

    def reads_base_model(self) -> bool:
        return self.policy is None

    def stage_refs(self):
        refs = self.data_refs("dataset")
        if self.policy is not None:
            refs.append(("policy", self.policy, "checkpoint"))
        return refs


def train_step(learner: Learner, batch: list[Example], pad_id: int, step_tokens: int | None = None,
               shards: int = 1) -> tuple[float, int]:
    """One optimizer step on this process's share of a batch, in micro-batches; returns (mean loss
    over the step's completion tokens, non-pad tokens processed: every process's, when they split it).

    The loss is `completion_nll` over the whole step: Σ −log πθ(y_t | y_<t) / `step_tokens`, the
    completion tokens of the step's whole batch (every process's share; default: this share's),
    × `shards` (Learner)."""
    step_tokens = step_tokens or sum(example.scored_tokens for example in batch)
    nll_sum, scored, seen = 0.0, 0, 0
    pieces = learner.equalized(learner.pieces(batch))
    for index, (piece, weight) in enumerate(pieces):
        ids, mask, labels = collate(piece, pad_id, learner.accelerator.device)
        with learner.accelerator.autocast():
            logps, _, scored_positions = label_logps(learner.model, ids, mask, labels)
            piece_nll = -logps.sum()
        learner.backward(piece_nll * weight * shards / max(1, step_tokens), last=index == len(pieces) - 1)
        if weight:  # a zero-weight piece only keeps a sharded model's collectives in step
            nll_sum += piece_nll.item()
            scored += int(scored_positions.sum())
            seen += int(mask.sum())
    learner.update()
    nll_sum, scored, seen = learner.step_totals([nll_sum, scored, seen], shards)
    return nll_sum / max(1, scored), int(seen)


def held_out_loss(model, examples: list[Example], pad_id: int, device, batch_size: int) -> float:
    """The mean NLL over the completion tokens of `examples`, in batches, without gradients."""
    nll_sum, scored = 0.0, 0
    with measuring(model):
        for start in range(0, len(examples), batch_size):
            ids, mask, labels = collate(examples[start:start + batch_size], pad_id, device)
            logps, _, scored_positions = label_logps(model, ids, mask, labels)
            nll_sum -= logps.sum().item()
            scored += int(scored_positions.sum())
    return nll_sum / max(1, scored)


def measure_held_out(training, held_out: list[Example], stage: SftStage, step: int) -> dict[str, float]:
    """`held_out/loss` after the steps it is due at; nothing otherwise."""
    if not held_out or not due(step, training.steps, stage.eval_every):
        return {}
    return held_out_metrics({"loss": held_out_loss(training.model, held_out, training.tokenizer.pad_token_id,
                                                   training.accelerator.device, stage.batch_size)})


def sft_rows(data: str, rows: list[dict]) -> list[dict]:
    """The rows of input `data`, refused (one line) when they are not SFT data."""
    columns = set(rows[0]) if rows else set()
    if "chosen" in columns:
        raise ValueError(f"data {data!r} is a preference dataset; sft trains on text, prompt_completion or "
                         "messages data (a preference stage takes it)")
    if not columns & {"completion", "messages", "text", "token_ids"}:
        raise ValueError(f"data {data!r} holds prompts without answers ({', '.join(sorted(columns))}); sft trains "
                         "on text, prompt_completion or messages data")
    return rows


def start_checkpoint(stage: SftStage, ctx: StageContext) -> str:
    """The folder training starts from: the input policy's checkpoint or the base model."""
    return str(ctx.fetch(stage.policy)) if stage.policy else resolve_base(ctx.model.base)


def run(stage: SftStage, ctx: StageContext) -> dict[str, StageOutput]:
    set_threads(ctx.model)
    source = start_checkpoint(stage, ctx)
    tokenizer = load_tokenizer(source, ctx.model)
    datasets = [sft_rows(data, read_rows(ctx.fetch(data))) for data in stage.datasets()]
    encoded = [encode_row(tokenizer, row, stage.max_seq_len) for rows in datasets for row in rows]
    split = split_held_out([len(rows) for rows in datasets], stage.eval_fraction, stage.seed)
    examples, held_out = [encoded[i] for i in split.train], [encoded[i] for i in split.held]
    training = start_training(ctx, stage, source, total_steps(stage, len(examples)), tokenizer)
    for step in range(training.start, training.steps):
        drawn = mixed_batch_indices(split.sizes, stage.weights(), stage.batch_size, stage.seed, step)
        picked = [examples[i] for i in drawn]
        loss, tokens = train_step(training.learner, training.shard(picked), tokenizer.pad_token_id,
                                  sum(example.scored_tokens for example in picked), training.learner.shards(picked))
        training.record(step, tokens, loss=loss, **measure_held_out(training, held_out, stage, step))
    return training.finish({"final_loss": training.history[-1]["loss"], "examples": len(examples),
                            "truncated_examples": sum(e.truncated for e in encoded),
                            **({"held_out_examples": len(held_out),
                                "final_held_out_loss": training.history[-1]["held_out/loss"]} if held_out else {})})
