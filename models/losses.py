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
