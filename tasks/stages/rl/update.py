"""An rl step's policy update: `num_iterations` clipped policy-gradient passes over the step's rows
(tasks/stages/rl/batch.py), with the KL reference's log-probs and, for rows an inference server
sampled, truncated importance weights (models/rl_losses.py)."""

from __future__ import annotations

from dataclasses import dataclass

from models.rl_losses import grpo_loss, kl_k3, loss_denominator, truncated_importance_weights
from tasks.stages.rl.batch import completion_logps, padded_behaviour, padded_rows, training_rows


def reference_logps(training, reference, batch, temperature: float):
    """Log-probs under the KL reference: the frozen input checkpoint, or with LoRA the policy
    with its adapters disabled."""
    import torch

    with torch.no_grad():
        if reference is not None:
            return completion_logps(reference, *batch[:4], temperature)[0]
        with training.accelerator.unwrap_model(training.model).disable_adapter():
            return completion_logps(training.model, *batch[:4], temperature)[0]


@dataclass
class Piece:
    """One micro-batch of a step's rows, as tensors."""

    batch: tuple  # prompt, prompt mask, completion, completion mask, loss mask (padded_rows)
    advantages: object
    ref_logps: object = None
    old_logps: object = None  # the trainer's before the update: the first iteration's, detached
    behaviour_logps: object = None  # the sampler's, when another engine sampled the rows (a server)
    importance_weights: object = None  # truncated_importance_weights of old against behaviour
    weight: float = 1.0  # 0: a copy that only keeps a sharded model's collectives in step (Learner.equalized)


def train_step(training, reference, groups: list[list], stage, pad_id: int) -> tuple[dict, int]:
    """`num_iterations` clipped policy-gradient steps on a step's rows, each over its micro-batches;
    returns (metrics, policy tokens)."""
    import torch

    # advantages are computed over whole groups first; then each process trains on its share
    step_rows = training_rows(groups, stage.algorithm, stage.group_size, stage.scale_rewards, stage.gamma,
                              stage.mask_truncated, stage.credit, stage.advantage)
    learner, device = training.learner, training.accelerator.device
    max_length = max(stage.max_tokens, *(len(r.completion_ids) for r in step_rows))  # a multi-turn grpo row is longer
    denominator = loss_denominator(stage.loss_aggregation, [sum(r.mask) for r in step_rows], max_length) \
        / learner.shards(step_rows)
    share = training.shard(step_rows)
    # rows another engine sampled (a server) carry its log-probs, which differ from the trainer's: importance-weighted
    weighted = stage.rollout.samples_elsewhere
    micro_batches = learner.equalized(learner.buckets(share, [(len(r.prompt_ids), len(r.completion_ids))
                                                              for r in share]))
    pieces = [Piece(padded_rows(rows, pad_id, device), torch.tensor([r.advantage for r in rows], device=device),
                    behaviour_logps=padded_behaviour(rows, device) if weighted else None, weight=weight)
              for rows, weight in micro_batches]
    for piece in pieces:
        piece.ref_logps = reference_logps(training, reference, piece.batch, stage.temperature) if stage.beta else None
    totals = {"loss": 0.0, "clipped": 0.0, "entropy": 0.0, "kl": 0.0, "tokens": 0, "weight": 0.0, "capped": 0.0,
              "mismatch": 0.0}
    level = "sequence" if stage.algorithm == "steppo" else "token"
    for iteration in range(stage.num_iterations):
        for index, piece in enumerate(pieces):
            prompt, prompt_mask, completion, completion_mask, loss_mask = piece.batch
            with training.accelerator.autocast():
                logps, entropy = completion_logps(training.model, prompt, prompt_mask, completion, completion_mask,
                                                  stage.temperature, with_entropy=iteration == 0)
                if iteration == 0:  # the ratio is 1 on the first pass
                    piece.old_logps = logps.detach()
                    if piece.behaviour_logps is not None:
                        piece.importance_weights = truncated_importance_weights(
                            piece.old_logps, piece.behaviour_logps, loss_mask, stage.importance_cap, level)
                loss, clip_fraction = grpo_loss(
                    logps, piece.old_logps, piece.advantages, loss_mask, epsilon_low=stage.epsilon_low,
                    epsilon_high=stage.epsilon_high, aggregation=stage.loss_aggregation, ref_logps=piece.ref_logps,
                    max_completion_length=max_length, beta=stage.beta, denominator=denominator,
                    importance_weights=piece.importance_weights,
                    ratio_level="sequence" if stage.algorithm == "steppo" else "token")
            learner.backward(loss * piece.weight, last=index == len(pieces) - 1)
            if not piece.weight:  # it only keeps a sharded model's collectives in step
                continue
            tokens = int(loss_mask.sum())
            totals["loss"] += loss.item() / stage.num_iterations
            totals["clipped"] += clip_fraction.item() * tokens / stage.num_iterations
            if iteration == 0:
                mask = loss_mask.float()
                totals["tokens"] += tokens
                totals["entropy"] += (entropy * mask).sum().item()
                if piece.ref_logps is not None:
                    totals["kl"] += (kl_k3(piece.old_logps, piece.ref_logps) * mask).sum().item()
                if piece.importance_weights is not None:
                    totals["weight"] += piece.importance_weights.sum().item()
                    totals["capped"] += ((piece.importance_weights >= stage.importance_cap) & (mask > 0)).sum().item()
                    totals["mismatch"] += ((piece.old_logps - piece.behaviour_logps).abs() * mask).sum().item()
        learner.update()
    trained = max(1, totals["tokens"])
    metrics = {"loss": totals["loss"], "clip_fraction": totals["clipped"] / trained,
               "entropy": totals["entropy"] / trained, "rows": sum(len(p.advantages) for p in pieces if p.weight)}
    if stage.beta:
        metrics["kl"] = totals["kl"] / trained
    if weighted:  # how far the server's log-probs are from the trainer's, and what the weights made of it
        metrics.update(importance_weight=totals["weight"] / trained, importance_capped=totals["capped"] / trained,
                       logp_mismatch=totals["mismatch"] / trained)
    return metrics, totals["tokens"]
