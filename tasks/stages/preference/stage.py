"""`preference`: alignment on on-policy data (Liquid's phase 2), resumable like sft.

From a rollouts dataset, per prompt: chosen = the best-scored completion, rejected = the
worst (ties broken towards the shorter chosen and the longer rejected, so a looping greedy
completion is the one rejected). Groups whose best and worst scores tie, and groups with
fewer than two finite scores, are dropped and counted. A user's preference dataset (the dataset
stage) gives its pairs as they are. Several datasets mix by weight, as in sft.

The input checkpoint is the reference. Its log-probs of every pair are computed once,
before the first step, and stored in the pairs dataset, which is committed next to the
checkpoint as `<stage>.pairs`: no reference model stays in memory while training.
"""

from __future__ import annotations

from models.loading import load_model, load_tokenizer, set_threads
from tasks.common import contract_gate
from tasks.common.context import StageContext, StageOutput
from tasks.common.datasets import write_rows
from tasks.common.errors import NoTrainingData
from tasks.common.pairs import input_pairs
from tasks.stages.preference.config import PreferenceStage
from tasks.stages.preference.online import run_online
from tasks.stages.preference.step import encode_pairs, pairs_contract, reference_logps, train_step
from tasks.train.loop import mixed_batch_indices, start_training, total_steps


def run(stage: PreferenceStage, ctx: StageContext) -> dict[str, StageOutput]:
    set_threads(ctx.model)
    source = str(ctx.fetch(stage.policy))
    tokenizer = load_tokenizer(source, ctx.model)
    if stage.mode == "online":
        return run_online(stage, ctx, source, tokenizer)
    return run_offline(stage, ctx, source, tokenizer)


def run_offline(stage: PreferenceStage, ctx: StageContext, source: str, tokenizer) -> dict[str, StageOutput]:
    import torch

    pairs, stats, sizes = input_pairs(ctx, stage.datasets(), stage.min_reward_gap)
    ctx.log(f"{stats.pairs} pairs from {stats.prompts} prompts ({stats.dropped_tied} tied and "
            f"{stats.dropped_unscored} unscored groups dropped)")
    if not pairs:  # retrying cannot fix data
        raise NoTrainingData(f"no preference pairs in {', '.join(str(ctx.inputs[d]) for d in stage.datasets())}: "
                             f"all {stats.prompts} prompt groups tied or unscored")
    chosen, rejected = encode_pairs(tokenizer, pairs, stage.max_seq_len)
    device = ctx.device
    reference = load_model(source, ctx.model).to(device)
    ref_chosen = reference_logps(reference, chosen, tokenizer.pad_token_id, device)
    ref_rejected = reference_logps(reference, rejected, tokenizer.pad_token_id, device)
    del reference
    for pair, c, r, c_logp, r_logp in zip(pairs, chosen, rejected, ref_chosen, ref_rejected):
        pair.update(ref_chosen_logp=c_logp, ref_rejected_logp=r_logp,
                    total_tokens=max(len(c.input_ids), len(r.input_ids)))

    pairs_dir = ctx.workdir / "pairs"
    write_rows(pairs, pairs_dir)
    pairs_output = StageOutput("dataset", pairs_dir, vars(stats), pairs_contract(ctx))
    pairs_output.contract_summary = contract_gate.check(ctx, pairs_output, stage.contract)  # before any training

    ref_chosen, ref_rejected = torch.tensor(ref_chosen), torch.tensor(ref_rejected)
    training = start_training(ctx, stage, source, total_steps(stage, len(pairs)), tokenizer)
    for step in range(training.start, training.steps):
        picked = mixed_batch_indices(sizes, stage.weights(), stage.batch_size, stage.seed, step)
        batch = training.shard(picked)
        metrics, tokens = train_step(training.learner, [chosen[i] for i in batch], [rejected[i] for i in batch],
                                     ref_chosen[batch], ref_rejected[batch], stage, tokenizer.pad_token_id,
                                     len(picked), training.learner.shards(picked))
        training.record(step, tokens, **metrics)

    last = training.history[-1]
    outputs = training.finish({"method": stage.method, "beta": stage.beta, "final_loss": last["loss"],
                               "final_reward_accuracy": last["reward_accuracy"], "pairs": stats.pairs,
                               "truncated_pairs": sum(c.truncated or r.truncated for c, r in zip(chosen, rejected))})
    return {**outputs, "pairs": pairs_output}
