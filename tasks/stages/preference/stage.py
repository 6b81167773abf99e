"""`preference`: alignment on on-policy data (Liquid's phase 2), resumable like sft.

From a rollouts dataset, per prompt: chosen = the best-scored completion, rejected = the
worst (ties broken towards the shorter chosen and the longer rejected, so a looping greedy
completion is the one rejected). Groups whose best and worst scores tie, and groups with
fewer than two finite scores, are dropped and counted. A user's preference dataset (the dataset
stage) gives its pairs as they are. Several datasets mix by weight, as in sft.

The input checkpoint is the reference. Its log-probs of every pair are computed once,
before the first step, and stored in the pairs dataset, which is committed next to the
checkpoint as `<stage>.pairs`: no reference model stays in memory while training. orpo, simpo
and cpo have no reference: nothing is computed before the first step, and the pairs carry no
reference log-probs. kto trains on unpaired rows (tasks/stages/preference/kto.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from models.loading import load_model, load_tokenizer, set_threads
from tasks.common import contract_gate
from tasks.common.context import StageContext, StageOutput
from tasks.common.datasets import write_rows
from tasks.common.errors import NoTrainingData
from tasks.common.pairs import input_pairs
from tasks.stages.preference.config import PreferenceStage
from tasks.stages.preference.kto import run_kto
from tasks.stages.preference.online import run_online
from tasks.stages.preference.step import (
    encode_pairs,
    held_out_pairs,
    pairs_contract,
    reference_logps,
    sliced,
    train_step,
)
from tasks.train.held_out import due, held_out_metrics, split_held_out
from tasks.train.loop import mixed_batch_indices, start_training, total_steps


def run(stage: PreferenceStage, ctx: StageContext) -> dict[str, StageOutput]:
    set_threads(ctx.model)
    source = str(ctx.fetch(stage.policy))
    tokenizer = load_tokenizer(source, ctx.model)
    if stage.mode == "online":
        return run_online(stage, ctx, source, tokenizer)
    if stage.method == "kto":
        return run_kto(stage, ctx, source, tokenizer)
    return run_offline(stage, ctx, source, tokenizer)


def run_offline(stage: PreferenceStage, ctx: StageContext, source: str, tokenizer) -> dict[str, StageOutput]:
    pairs, stats, sizes = input_pairs(ctx, stage.datasets(), stage.min_reward_gap)
    ctx.log(f"{stats.pairs} pairs from {stats.prompts} prompts ({stats.dropped_tied} tied and "
            f"{stats.dropped_unscored} unscored groups dropped)")
    if not pairs:  # retrying cannot fix data
        raise NoTrainingData(f"no preference pairs in {', '.join(str(ctx.inputs[d]) for d in stage.datasets())}: "
                             f"all {stats.prompts} prompt groups tied or unscored")
    chosen, rejected = encode_pairs(tokenizer, pairs, stage.max_seq_len)
    ref_chosen, ref_rejected = (None, None) if stage.reference_free else pair_reference_logps(
        ctx, source, pairs, chosen, rejected, tokenizer.pad_token_id)
    for pair, c, r in zip(pairs, chosen, rejected):  # after the reference's columns: the pairs' column order
        pair["total_tokens"] = max(len(c.input_ids), len(r.input_ids))

    pairs_dir = ctx.workdir / "pairs"
    write_rows(pairs, pairs_dir)
    pairs_output = StageOutput("dataset", pairs_dir, vars(stats), pairs_contract(ctx))
    pairs_output.contract_summary = contract_gate.check(ctx, pairs_output, stage.contract)  # before any training

    split = split_held_out(sizes, stage.eval_fraction, stage.seed)  # indices into every pair
    held_out = HeldOutPairs([chosen[i] for i in split.held], [rejected[i] for i in split.held],
                            sliced(ref_chosen, split.held), sliced(ref_rejected, split.held))
    training = start_training(ctx, stage, source, total_steps(stage, len(split.train)), tokenizer)
    for step in range(training.start, training.steps):
        picked = [split.train[i] for i in mixed_batch_indices(split.sizes, stage.weights(), stage.batch_size,
                                                               stage.seed, step)]
        batch = training.shard(picked)
        metrics, tokens = train_step(training.learner, [chosen[i] for i in batch], [rejected[i] for i in batch],
                                     sliced(ref_chosen, batch), sliced(ref_rejected, batch), stage,
                                     tokenizer.pad_token_id, len(picked), training.learner.shards(picked))
        training.record(step, tokens, **metrics, **held_out.measure(training, stage, step))

    last = training.history[-1]
    measured = {"held_out_pairs": len(split.held), "final_held_out_loss": last["held_out/loss"],
                "final_held_out_reward_accuracy": last["held_out/reward_accuracy"]} if split.held else {}
    outputs = training.finish({"method": stage.method, "beta": stage.beta, "final_loss": last["loss"],
                               "final_reward_accuracy": last["reward_accuracy"], "pairs": stats.pairs,
                               "truncated_pairs": sum(c.truncated or r.truncated for c, r in zip(chosen, rejected)),
                               **measured})
    return {**outputs, "pairs": pairs_output}


def pair_reference_logps(ctx: StageContext, source: str, pairs: list[dict], chosen: list, rejected: list,
                         pad_id: int):
    """The input checkpoint's summed log-probs of both sides of every pair, computed once before
    training and stored with the pairs (`ref_chosen_logp`, `ref_rejected_logp`); the reference is
    dropped before training starts."""
    import torch

    reference = load_model(source, ctx.model).to(ctx.device)
    ref_chosen = reference_logps(reference, chosen, pad_id, ctx.device)
    ref_rejected = reference_logps(reference, rejected, pad_id, ctx.device)
    del reference
    for pair, c_logp, r_logp in zip(pairs, ref_chosen, ref_rejected):
        pair.update(ref_chosen_logp=c_logp, ref_rejected_logp=r_logp)
    return torch.tensor(ref_chosen), torch.tensor(ref_rejected)


@dataclass
class HeldOutPairs:
    """The pairs held out of training (`eval_fraction`) and their reference log-probs."""

    chosen: list
    rejected: list
    ref_chosen: object  # tensor
    ref_rejected: object

    def measure(self, training, stage: PreferenceStage, step: int) -> dict[str, float]:
        """`held_out/loss` and `held_out/reward_accuracy` after the steps they are due at; nothing otherwise."""
        if not self.chosen or not due(step, training.steps, stage.eval_every):
            return {}
        return held_out_metrics(held_out_pairs(training.model, self.chosen, self.rejected, self.ref_chosen,
                                               self.ref_rejected, stage, training.tokenizer.pad_token_id,
                                               training.accelerator.device, training.sharded))
