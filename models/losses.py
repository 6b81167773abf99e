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
