"""An rl step's policy update: `num_iterations` clipped policy-gradient passes over the step's rows
(tasks/stages/rl/batch.py), with the KL reference's log-probs and, for rows an inference server
sampled, truncated importance weights (models/rl_losses.py). `PolicyUpdate` is built once from the
stage: its rows' plan, its loss, its passes."""

from __future__ import annotations

from dataclasses import dataclass

from models.rl_losses import PolicyLoss, kl_k3
from tasks.stages.rl.batch import RowPlan, completion_logps, padded_behaviour, padded_rows


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


@dataclass
class Totals:
    """What a step's passes add up, per trained token (the first pass's where a later one repeats it)."""

    loss: float = 0.0
    clipped: float = 0.0
    entropy: float = 0.0
    kl: float = 0.0
    tokens: int = 0
    weight: float = 0.0
    capped: float = 0.0
    mismatch: float = 0.0


@dataclass(frozen=True)
class PolicyUpdate:
    """The update an rl stage takes each step, its settings bound once (`of(stage)`)."""

    plan: RowPlan
    loss: PolicyLoss
    num_iterations: int
    temperature: float
    max_tokens: int
    weighted: bool  # rows another engine sampled (a server) carry its log-probs: importance-weighted
    pad_id: int

    @classmethod
    def of(cls, stage, pad_id: int) -> "PolicyUpdate":
        loss = PolicyLoss(stage.epsilon_low, stage.epsilon_high, stage.loss_aggregation, stage.beta,
                          stage.importance_sampling_level, stage.importance_cap)
        return cls(RowPlan.of(stage), loss, stage.num_iterations, stage.temperature, stage.max_tokens,
                   stage.rollout.samples_elsewhere, pad_id)

    def __call__(self, training, reference, groups: list[list]) -> tuple[dict, int]:
        """`num_iterations` clipped policy-gradient steps on a step's rows, each over its micro-batches;
        returns (metrics, policy tokens)."""
        step_rows = self.plan.rows(groups)  # advantages over whole groups first; then each process its share
        learner = training.learner
        max_length = max(self.max_tokens, *(len(r.completion_ids) for r in step_rows))  # multi-turn rows are longer
        denominator = self.loss.denominator([sum(r.mask) for r in step_rows], max_length) / learner.shards(step_rows)
        pieces = self.pieces(training, reference, training.shard(step_rows))
        totals = Totals()
        for iteration in range(self.num_iterations):
            for index, piece in enumerate(pieces):
                self.backward(training, piece, iteration, index == len(pieces) - 1, max_length, denominator, totals)
            learner.update()
        return self.metrics(totals, pieces), totals.tokens

    def pieces(self, training, reference, share: list) -> list[Piece]:
        """This process's rows in micro-batches, as tensors, with the reference's log-probs."""
        import torch

        learner, device = training.learner, training.accelerator.device
        micro_batches = learner.equalized(learner.buckets(share, [(len(r.prompt_ids), len(r.completion_ids))
                                                                  for r in share]))
        pieces = [Piece(padded_rows(rows, self.pad_id, device),
                        torch.tensor([r.advantage for r in rows], device=device),
                        behaviour_logps=padded_behaviour(rows, device) if self.weighted else None, weight=weight)
                  for rows, weight in micro_batches]
        for piece in pieces:
            piece.ref_logps = reference_logps(training, reference, piece.batch, self.temperature) \
                if self.loss.beta else None
        return pieces

    def backward(self, training, piece: Piece, iteration: int, last: bool, max_length: int, denominator: float,
                 totals: Totals) -> None:
        """One micro-batch's loss and gradients in pass `iteration`; its share of the totals."""
        prompt, prompt_mask, completion, completion_mask, loss_mask = piece.batch
        with training.accelerator.autocast():
            logps, entropy = completion_logps(training.model, prompt, prompt_mask, completion, completion_mask,
                                              self.temperature, with_entropy=iteration == 0)
            if iteration == 0:  # the ratio is 1 on the first pass
                piece.old_logps = logps.detach()
                if piece.behaviour_logps is not None:
                    piece.importance_weights = self.loss.importance_weights(piece.old_logps, piece.behaviour_logps,
                                                                            loss_mask)
            loss, clip_fraction = self.loss(logps, piece.old_logps, piece.advantages, loss_mask,
                                            ref_logps=piece.ref_logps, max_completion_length=max_length,
                                            denominator=denominator, importance_weights=piece.importance_weights)
        training.learner.backward(loss * piece.weight, last=last)
        if not piece.weight:  # it only keeps a sharded model's collectives in step
            return
        tokens = int(loss_mask.sum())
        totals.loss += loss.item() / self.num_iterations
        totals.clipped += clip_fraction.item() * tokens / self.num_iterations
        if iteration == 0:
            self.first_pass_totals(piece, entropy, loss_mask, tokens, totals)

    def first_pass_totals(self, piece: Piece, entropy, loss_mask, tokens: int, totals: Totals) -> None:
        mask = loss_mask.float()
        totals.tokens += tokens
        totals.entropy += (entropy * mask).sum().item()
        if piece.ref_logps is not None:
            totals.kl += (kl_k3(piece.old_logps, piece.ref_logps) * mask).sum().item()
        if piece.importance_weights is not None:
            totals.weight += piece.importance_weights.sum().item()
            totals.capped += ((piece.importance_weights >= self.loss.importance_cap) & (mask > 0)).sum().item()
            totals.mismatch += ((piece.old_logps - piece.behaviour_logps).abs() * mask).sum().item()

    def metrics(self, totals: Totals, pieces: list[Piece]) -> dict:
        trained = max(1, totals.tokens)
        metrics = {"loss": totals.loss, "clip_fraction": totals.clipped / trained,
                   "entropy": totals.entropy / trained, "rows": sum(len(p.advantages) for p in pieces if p.weight)}
        if self.loss.beta:
            metrics["kl"] = totals.kl / trained
        if self.weighted:  # how far the server's log-probs are from the trainer's, and what the weights made of it
            metrics.update(importance_weight=totals.weight / trained, importance_capped=totals.capped / trained,
                           logp_mismatch=totals.mismatch / trained)
        return metrics


def train_step(training, reference, groups: list[list], stage, pad_id: int) -> tuple[dict, int]:
    """One step of `stage`'s update on `groups` (a PolicyUpdate built for the call)."""
    return PolicyUpdate.of(stage, pad_id)(training, reference, groups)
