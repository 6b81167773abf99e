"""`method: kto` (TRL's KTOTrainer as the preference stage): completions labelled desirable or not,
unpaired, against the input checkpoint as the reference.

Rows: an unpaired preference dataset's (prompt, completion, label) as they are; a preference
dataset's or rollouts' pairs split into a desirable row (the chosen) and an undesirable one (the
rejected), as TRL's `unpair_preference_dataset`.

The KL baseline z₀ of a step pairs each row of its batch with the completion of the row before it
(the first with the last: TRL's rotation of the completions within a batch), its policy log-probs
taken without gradient at the step. The batches are drawn before training (mixed_batch_indices is
a function of the step), so the reference's log-probs of every row and of every step's mismatched
pairs are computed once, before the first step: no reference model stays in memory while
training. The rows, with `ref_logp`, are committed as `<stage>.pairs`.
"""

from __future__ import annotations

import math

from data_contracts.config import ContractParams
from models.loading import context_length, load_model, resolve_base
from models.losses import kto_baseline, kto_loss
from models.sampling import chat_prompt
from tasks.common import contract_gate
from tasks.common.context import StageContext, StageOutput
from tasks.common.datasets import write_rows
from tasks.common.encoding import Example, answer_example, encode_ids, row_tools
from tasks.common.errors import NoTrainingData
from tasks.common.pairs import PairStats, dataset_pairs
from tasks.stages.preference.config import PreferenceStage
from tasks.stages.preference.step import bucketed_logps, first_scored, reference_logps, side_logps
from tasks.train.learner import Learner
from tasks.train.loop import mixed_batch_indices, start_training, total_steps

KEPT = ("prompt", "completion", "label", "tools", "conversational")  # an unpaired dataset's columns trained on


def unpaired(pair: dict) -> list[dict]:
    """A pair as its desirable row (the chosen) and its undesirable one (the rejected)."""
    shared = {key: pair[key] for key in ("prompt", "tools", "conversational") if key in pair}
    return [{**shared, "id": f"{pair['id']}/{name}", "completion": pair[side], "label": label,
             **({"completion_tokens": pair[f"{side}_tokens"]} if f"{side}_tokens" in pair else {}),
             **({"completion_mask": pair[f"{side}_mask"]} if f"{side}_mask" in pair else {})}
            for side, name, label in (("chosen", "desirable", True), ("rejected", "undesirable", False))]


def input_rows(ctx: StageContext, stage: PreferenceStage) -> tuple[list[dict], PairStats, list[int]]:
    """The rows of every input dataset, the pairs split (what was dropped picking them), and how many
    rows came from each."""
    from tasks.common.datasets import read_rows

    rows, stats, sizes = [], PairStats(), []
    for data in stage.datasets():
        found = read_rows(ctx.fetch(data))
        if found and "label" in found[0]:
            given = [{**{key: row[key] for key in KEPT if key in row}, "id": f"{data}/{row['id']}"} for row in found]
        else:
            pairs, counted = dataset_pairs(data, found, stage.min_reward_gap)
            given = [row for pair in pairs for row in unpaired(pair)]
            for name, value in vars(counted).items():
                setattr(stats, name, getattr(stats, name) + value)
        rows += given
        sizes.append(len(given))
    return rows, stats, sizes


def encode_row(tokenizer, row: dict, max_len: int) -> Example:
    """A row as the loss reads it: its prompt masked, its completion scored (a rollout's own tokens
    and, multi-turn, its env's tokens masked)."""
    if "completion_tokens" in row and row["completion_tokens"] is not None:
        mask = row["completion_mask"] if "completion_mask" in row else None
        return encode_ids(chat_prompt(tokenizer, row["prompt"]), list(row["completion_tokens"]), max_len,
                          None if mask is None else list(mask))
    return answer_example(tokenizer, row["prompt"], row["completion"], max_len, row_tools(row))


def mismatched(examples: list[Example], batch: list[int], max_len: int) -> list[Example]:
    """The KL baseline's pairs of a batch: each row's prompt with the completion of the row before
    it in the batch (the first row's with the last's), cut at `max_len`."""
    out = []
    for position, row in enumerate(batch):
        prompt, answer = examples[row], examples[batch[position - 1]]
        cut, start = first_scored(prompt), first_scored(answer)
        ids = prompt.input_ids[:cut] + answer.input_ids[start:]
        labels = prompt.labels[:cut] + answer.labels[start:]
        out.append(Example(ids[:max_len], labels[:max_len], len(ids) > max_len))
    return out


def kto_step(learner: Learner, rows: list[Example], kl_rows: list[Example], desirable, ref_logps, ref_kl_logps,
             stage: PreferenceStage, pad_id: int, step_rows: int, shards: int = 1) -> tuple[dict, int]:
    """One optimizer step on this process's share of a batch of rows; returns (metrics over the
    step's rows, non-pad tokens processed: every process's, when they split it).

    First the KL baseline over the whole step's mismatched pairs (no gradient; summed over the
    processes), then the mean of `kto_loss` over the step's `step_rows` rows, × `shards` (Learner).
    """
    import torch

    device = learner.accelerator.device
    kl_sum = 0.0
    with torch.no_grad():
        for piece, weight in learner.equalized(learner.pieces(list(range(len(kl_rows))))):
            with learner.accelerator.autocast():
                logps, _, _ = side_logps(learner.model, [kl_rows[i] for i in piece], pad_id, device)
            if weight:
                kl_sum += (logps.float().cpu() - ref_kl_logps[piece]).sum().item()
    kl_sum, kl_count = learner.step_totals([kl_sum, len(kl_rows)], shards)
    kl = kto_baseline(kl_sum, int(kl_count))
    totals = [0.0] * 6  # loss, desirable reward, desirable rows, undesirable reward, undesirable rows, tokens
    pieces = learner.equalized(learner.pieces(list(range(len(rows)))))
    for index, (piece, weight) in enumerate(pieces):
        with learner.accelerator.autocast():
            logps, _, seen = (side_logps if learner.sharded else bucketed_logps)(
                learner.model, [rows[i] for i in piece], pad_id, device)
            labels = desirable[piece].to(device)
            losses, rewards = kto_loss(stage.beta, logps, ref_logps[piece].to(device), labels, kl,
                                       stage.desirable_weight, stage.undesirable_weight)
        learner.backward(losses.sum() * weight * shards / step_rows, last=index == len(pieces) - 1)
        if weight:  # a zero-weight piece only keeps a sharded model's collectives in step
            for slot, value in enumerate((losses.detach().sum(), rewards[labels].sum(), labels.sum(),
                                          rewards[~labels].sum(), (~labels).sum(), seen)):
                totals[slot] += float(value)
    learner.update()
    loss, chosen, n_chosen, rejected, n_rejected, seen = learner.step_totals(totals, shards)
    chosen_reward = chosen / n_chosen if n_chosen else math.nan
    rejected_reward = rejected / n_rejected if n_rejected else math.nan
    return {"loss": loss / (n_chosen + n_rejected), "kl": kl, "rewards/chosen": chosen_reward,
            "rewards/rejected": rejected_reward, "reward_margin": chosen_reward - rejected_reward}, int(seen)


def run_kto(stage: PreferenceStage, ctx: StageContext, source: str, tokenizer) -> dict[str, StageOutput]:
    import torch

    rows, stats, sizes = input_rows(ctx, stage)
    desirable_rows = sum(bool(row["label"]) for row in rows)
    ctx.log(f"{len(rows)} rows ({desirable_rows} desirable); {stats.pairs} pairs split from {stats.prompts} "
            f"prompts ({stats.dropped_tied} tied and {stats.dropped_unscored} unscored groups dropped)")
    if not rows:  # retrying cannot fix data
        raise NoTrainingData(f"no rows to train kto on in {', '.join(str(ctx.inputs[d]) for d in stage.datasets())}")
    examples = [encode_row(tokenizer, row, stage.max_seq_len) for row in rows]
    batches = [mixed_batch_indices(sizes, stage.weights(), stage.batch_size, stage.seed, step)
               for step in range(total_steps(stage, len(rows)))]
    pad_id, device = tokenizer.pad_token_id, ctx.device
    reference = load_model(source, ctx.model).to(device)
    ref_logps = reference_logps(reference, examples, pad_id, device)
    ref_kl = [torch.tensor(reference_logps(reference, mismatched(examples, batch, stage.max_seq_len), pad_id, device))
              for batch in batches]
    del reference
    for row, example, logp in zip(rows, examples, ref_logps):
        row.update(ref_logp=logp, total_tokens=len(example.input_ids))
    rows_dir = ctx.workdir / "pairs"
    write_rows(rows, rows_dir)
    contract = ContractParams(kind="unpaired", context_length=context_length(resolve_base(ctx.model.base)))
    rows_output = StageOutput("dataset", rows_dir, {**vars(stats), "rows": len(rows), "desirable": desirable_rows},
                              contract)
    rows_output.contract_summary = contract_gate.check(ctx, rows_output, stage.contract)  # before any training

    desirable, ref_logps = torch.tensor([bool(row["label"]) for row in rows]), torch.tensor(ref_logps)
    training = start_training(ctx, stage, source, len(batches), tokenizer)
    for step in range(training.start, training.steps):
        picked = batches[step]
        share = training.shard(list(range(len(picked))))  # positions in the batch
        batch = [picked[j] for j in share]
        kl_rows = mismatched(examples, picked, stage.max_seq_len)
        metrics, tokens = kto_step(training.learner, [examples[i] for i in batch], [kl_rows[j] for j in share],
                                   desirable[batch], ref_logps[batch], ref_kl[step][share], stage, pad_id,
                                   len(picked), training.learner.shards(picked))
        training.record(step, tokens, **metrics)
    last = training.history[-1]
    outputs = training.finish({"method": stage.method, "beta": stage.beta, "final_loss": last["loss"],
                               "final_kl": last["kl"], "rows": len(rows), "desirable": desirable_rows,
                               "pairs": stats.pairs,
                               "truncated_rows": sum(example.truncated for example in examples)})
    return {**outputs, "pairs": rows_output}
