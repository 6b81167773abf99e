"""On-policy distillation's loss as a pure function over logits (TRL's GKD, Agarwal et al. 2024, Eq. 1).

Shapes: B rows, T positions, V the shared vocabulary; `mask` [B, T] is 1 on the positions whose
next-token distributions are compared (the completion's, shifted as the logits are).
"""

from __future__ import annotations


def generalized_jsd(student_logits, teacher_logits, beta: float, temperature: float = 1.0):
    """Per-position generalized Jensen–Shannon divergence [B, T] between student S and teacher T:

        M = β·T + (1 − β)·S                       (in probabilities, per position)
        JSD_β = β · KL(T ‖ M) + (1 − β) · KL(S ‖ M)

    with β = 0 the forward KL(T ‖ S) and β = 1 the reverse KL(S ‖ T) (the mode-seeking on-policy
    distillation objective), both logits divided by `temperature` first. TRL's
    GKDTrainer.generalized_jsd_loss before its reduction (`kl_div` with log targets; the limits
    are taken as the KLs themselves, as TRL does).
    """
    import math

    import torch

    student = (student_logits / temperature).float().log_softmax(-1)
    teacher = (teacher_logits / temperature).float().log_softmax(-1)
    if beta == 0:
        return _kl(teacher, student)
    if beta == 1:
        return _kl(student, teacher)
    mixture = torch.logsumexp(torch.stack([student + math.log1p(-beta), teacher + math.log(beta)]), dim=0)
    return beta * _kl(teacher, mixture) + (1 - beta) * _kl(student, mixture)


def _kl(p_log, q_log):
    """KL(p ‖ q) = Σ_v p_v (log p_v − log q_v), both as log-probabilities over the last axis."""
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def distill_loss(student_logits, teacher_logits, mask, beta: float, temperature: float = 1.0,
                 denominator: float | None = None):
    """Σ mask · JSD_β / denominator: by default the masked positions' count (TRL's "batchmean" over
    the completion tokens); a micro-batch of a step passes the whole step's count, so the
    micro-batches' losses add up to the step's."""
    mask = mask.to(student_logits.device).float()
    total = (generalized_jsd(student_logits, teacher_logits, beta, temperature) * mask).sum()
    return total / (mask.sum().clamp(min=1) if denominator is None else max(1.0, denominator))
