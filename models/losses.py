"""Training losses as pure functions over tensors."""

from __future__ import annotations

IGNORE_INDEX = -100


def completion_nll(logits, labels):
    """Completion-only causal LM loss.

    L = -(1/|C|) · Σ_{t∈C} log πθ(y_t | y_<t),  C = positions whose label is not IGNORE_INDEX
    (prompt and padding are IGNORE_INDEX). Logits at position t predict the label at t+1.
    Returns (loss, number of completion tokens).
    """
    import torch.nn.functional as F

    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    tokens = (shift_labels != IGNORE_INDEX).sum()
    loss = F.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")
    return loss / tokens.clamp(min=1), tokens


def token_logps(logits, targets):
    """log softmax(logits)[target] at every position: [..., V] logits, [...] targets -> [...]."""
    logits = logits.float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


def sequence_logps(logits, labels):
    """Summed completion log-probs of each sequence.

    logp(y|x) = Σ_{t∈C} log πθ(y_t | y_<t, x), with C as in `completion_nll`.
    Returns (logps [N], completion tokens [N]).
    """
    shift_labels = labels[:, 1:]
    mask = shift_labels != IGNORE_INDEX
    per_token = token_logps(logits[:, :-1, :], shift_labels.masked_fill(~mask, 0))
    return (per_token * mask).sum(-1), mask.sum(-1)


def preference_loss(method: str, beta: float, chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                    chosen_tokens, rejected_tokens):
    """Per-pair preference loss; returns (losses [B], chosen rewards [B], rejected rewards [B]).

    With h_w = log πθ(y_w|x) − log πref(y_w|x) and h_l likewise for the rejected completion:
      dpo     L = −log σ(β·(h_w − h_l))                            (Rafailov et al. 2023)
      ln_dpo  L = −log σ(β·(h_w/|y_w| − h_l/|y_l|))                (length-normalized, Liquid's form)
      ipo     L = (h_w/|y_w| − h_l/|y_l| − 1/(2β))²               (Azar et al. 2023, per-token average
                                                                   as TRL and the IPO authors use it)
    |y| counts completion tokens. The implicit rewards β·h are returned for metrics.
    """
    import torch.nn.functional as F

    chosen_logratio = chosen_logps - ref_chosen_logps  # h_w
    rejected_logratio = rejected_logps - ref_rejected_logps  # h_l
    if method == "dpo":
        losses = -F.logsigmoid(beta * (chosen_logratio - rejected_logratio))
    else:
        delta = chosen_logratio / chosen_tokens.clamp(min=1) - rejected_logratio / rejected_tokens.clamp(min=1)
        if method == "ln_dpo":
            losses = -F.logsigmoid(beta * delta)
        elif method == "ipo":
            losses = (delta - 1 / (2 * beta)) ** 2
        else:
            raise ValueError(f"unknown preference method {method!r}")
    return losses, beta * chosen_logratio.detach(), beta * rejected_logratio.detach()


REFERENCE_FREE = ("orpo", "simpo", "cpo")  # preference methods trained without a reference model


def reference_free_loss(method: str, beta: float, chosen_logps, rejected_logps, chosen_tokens, rejected_tokens,
                        simpo_gamma: float = 0.5):
    """Per-pair loss of a preference method without a reference model; returns (losses [B], chosen
    rewards [B], rejected rewards [B]).

    With ℓ = log πθ(y|x) summed over the completion's tokens and ℓ̄ = ℓ/|y| its per-token mean:
      orpo   L = −β·log σ(o_w − o_l),  o = ℓ̄ − log(1 − exp ℓ̄) the log-odds   (Hong et al. 2024; TRL's β is λ)
      simpo  L = −log σ(β·(ℓ̄_w − ℓ̄_l) − γ)                                   (Meng et al. 2024; γ = simpo_gamma)
      cpo    L = −log σ(β·(ℓ_w − ℓ_l))                                       (Xu et al. 2024)
    ORPO and CPO add an NLL term of the chosen side (the stage's step, `chosen_nll`). The rewards
    are β·ℓ (orpo and simpo: β·ℓ̄), as TRL logs them.
    """
    import torch.nn.functional as F

    if method == "cpo":
        chosen, rejected = chosen_logps, rejected_logps
        losses = -F.logsigmoid(beta * (chosen - rejected))
    else:
        chosen, rejected = chosen_logps / chosen_tokens.clamp(min=1), rejected_logps / rejected_tokens.clamp(min=1)
        if method == "orpo":
            log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
            losses = -beta * F.logsigmoid(log_odds)
        elif method == "simpo":
            losses = -F.logsigmoid(beta * (chosen - rejected) - simpo_gamma)
        else:
            raise ValueError(f"unknown reference-free preference method {method!r}")
    return losses, beta * chosen.detach(), beta * rejected.detach()


def log1mexp(x):
    """log(1 − exp x) for x < 0, without cancellation on either side of −log 2."""
    import torch

    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def chosen_nll(logps_sum, tokens):
    """The NLL term of ORPO and CPO: −(1/N)·Σ log πθ over the N tokens of a batch's chosen sequences
    (a token mean over the batch, as TRL's cross-entropy; `logps_sum` and `tokens` over the batch)."""
    return -logps_sum / max(tokens, 1)


def kto_loss(beta: float, logps, ref_logps, desirable, kl, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0):
    """Per-row KTO loss on unpaired completions (Ethayarajh et al. 2024, eq. 7, as TRL's KTOTrainer);
    returns (losses [B], rewards [B]).

    With h = log πθ(y|x) − log πref(y|x) and z₀ the KL baseline (`kto_baseline`):
      desirable    L = w_D·(1 − σ(β·(h − z₀)))
      undesirable  L = w_U·(1 − σ(β·(z₀ − h)))
    A batch's loss is the mean over its rows. The rewards β·h are returned for metrics.
    """
    import torch

    logratio = logps - ref_logps
    desirable_losses = desirable_weight * (1 - torch.sigmoid(beta * (logratio - kl)))
    undesirable_losses = undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratio)))
    return torch.where(desirable, desirable_losses, undesirable_losses), beta * logratio.detach()


def kto_baseline(kl_logratio_sum: float, rows: int) -> float:
    """KTO's reference point z₀ = max(0, mean over a batch of log πθ(y'|x) − log πref(y'|x)), y' the
    completion of another row of the batch (a mismatched pair); a constant of the step (no gradient)."""
    return max(0.0, kl_logratio_sum / max(rows, 1))


def reward_model_loss(chosen_scores, rejected_scores, margins=None, center_coefficient: float | None = None):
    """Bradley–Terry loss of a scalar reward model, per pair; returns losses [B].

      L = −log σ(r_w − r_l − m) + c·(r_w + r_l)²

    r_w, r_l the scores of the chosen and rejected completion, m the pair's margin (0 unless given),
    c `center_coefficient` (None: no centering term), as TRL's RewardTrainer (its batch mean is the
    mean of these).
    """
    import torch.nn.functional as F

    delta = chosen_scores - rejected_scores
    losses = -F.logsigmoid(delta if margins is None else delta - margins)
    if center_coefficient is not None:
        losses = losses + center_coefficient * (chosen_scores + rejected_scores) ** 2
    return losses
