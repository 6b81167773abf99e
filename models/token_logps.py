"""Per-token log-probs of the tokens a loss scores, without a whole batch's full-vocabulary logits.

A training step needs log π(y_t | y_<t) only where a loss looks (completion tokens, not prompts or
padding). The model runs with its output head taken out, so its forward returns hidden states
[B, T, H]; the head is applied to the scored positions only, in chunks of at most CHUNK_BYTES of
fp32 logits. With gradients on and more than one chunk, each chunk is recomputed in the backward
pass (activation checkpointing), so at most one chunk's logits [chunk, V] live at a time: what
lets LFM2's 65k vocabulary train on ~1k-token RL rows.

llama and qwen3 (LoRA or not, unwrapped) compute those hidden states through
models/direct_forward.py instead of their transformers forward: the same arithmetic with the causal
attention kernel and the last layer only where a loss looks.

Models whose forward does more than `lm_head(hidden)` (logit soft-capping or scaling), and models
sharded by FSDP or DeepSpeed (their head is not a plain module to take out), take the plain path:
the forward's logits, sliced to the scored positions.
"""

from __future__ import annotations

import contextlib

from models.losses import IGNORE_INDEX
CHUNK_BYTES = 64 * 2**20  # fp32 logits per chunk: 256 positions of a 65k vocabulary


def label_logps(model, input_ids, attention_mask, labels, position_ids=None, temperature: float = 1.0,
                with_entropy: bool = False):
    """log π(labels[:, t+1] | input_ids[:, :t+1]) / temperature-scaled, at every position t whose
    next label is not IGNORE_INDEX.

    Returns (logps [B, T-1] fp32, 0 where nothing is scored; entropy [B, T-1] of the same
    distribution without gradient, or None; scored [B, T-1] bool).
    """
    targets = labels[:, 1:]
    scored = targets != IGNORE_INDEX
    head = output_head(model)
    hidden = _direct_hidden(model, head, input_ids, attention_mask, position_ids, scored)
    if hidden is None:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        with head_taken_out(model, head):
            hidden = model(**inputs).logits[:, :-1][scored]  # hidden states when the head is out
    if head is None:
        chosen = _chunk_logps(lambda x: x, hidden, targets[scored], temperature, with_entropy)
    else:
        chosen = chunked_logps(head, hidden, targets[scored], temperature, with_entropy)
    return (*_placed(scored, *chosen), scored)


def shared_prefix_logps(model, prefixes, prefix_mask, suffixes, suffix_mask, owner, suffix_labels,
                        temperature: float = 1.0, with_entropy: bool = False):
    """log π of each scored suffix token (`suffix_labels` not IGNORE_INDEX), temperature-scaled,
    given its prefix and the suffix before it, each prefix computed once for the suffixes that
    continue it (models/direct_forward.py: `shared_prefix_hidden`). Returns (logps [S, Ls] fp32, 0
    where unscored; entropy [S, Ls] without gradient, or None; scored [S, Ls] bool), as
    `label_logps` does over the suffix columns; None where the model does not run directly."""
    from models.direct_forward import shared_prefix_hidden

    head = output_head(model)
    inner = _run_directly(model, head)
    scored = suffix_labels != IGNORE_INDEX
    hidden = shared_prefix_hidden(inner, prefixes, prefix_mask, suffixes, suffix_mask, owner, scored) \
        if inner is not None else None
    if hidden is None:
        return None
    return (*_placed(scored, *chunked_logps(head, hidden, suffix_labels[scored], temperature, with_entropy)),
            scored)


def _placed(scored, chosen, chosen_entropy):
    """The scored positions' log-probs (and entropies, or None) placed in [rows, columns] tensors, 0 elsewhere."""
    import torch

    logps = torch.zeros(scored.shape, dtype=torch.float32, device=scored.device)
    logps[scored] = chosen
    if chosen_entropy is None:
        return logps, None
    entropy = torch.zeros_like(logps)
    entropy[scored] = chosen_entropy
    return logps, entropy


def _direct_hidden(model, head, input_ids, attention_mask, position_ids, scored):
    """The scored positions' final hidden states through models/direct_forward.py, or None where
    the model takes its own forward."""
    from models.direct_forward import scored_hidden

    inner = _run_directly(model, head)
    return scored_hidden(inner, input_ids, attention_mask, position_ids, scored) if inner is not None else None


def runs_directly(model) -> bool:
    """Whether `model`'s training forward runs through models/direct_forward.py (callers check
    before preparing rows only that path reads)."""
    return _run_directly(model, output_head(model)) is not None


def _run_directly(model, head):
    """The transformers model models/direct_forward.py runs in `model`'s place, or None: no plain
    head to apply, wrapped by DDP, FSDP or DeepSpeed, or not an architecture run directly there."""
    from models.direct_forward import trainable_directly

    if head is None or _unwrapped(model) is not model:
        return None
    return trainable_directly(model)


def chunked_logps(head, hidden, targets, temperature: float, with_entropy: bool):
    """`head` over hidden states [N, H] in chunks: log-probs [N] of `targets` (and entropies [N])."""
    import torch
    from torch.utils.checkpoint import checkpoint

    per_chunk = max(1, CHUNK_BYTES // (4 * _vocab_size(head)))
    recompute = torch.is_grad_enabled() and hidden.size(0) > per_chunk
    logps, entropies = [], []
    for start in range(0, hidden.size(0), per_chunk):
        part = (hidden[start:start + per_chunk], targets[start:start + per_chunk])
        if recompute:
            chosen, entropy = checkpoint(_chunk_logps, head, *part, temperature, with_entropy, use_reentrant=False)
        else:
            chosen, entropy = _chunk_logps(head, *part, temperature, with_entropy)
        logps.append(chosen)
        entropies.append(entropy)
    if not logps:
        nothing = hidden.new_zeros(0, dtype=torch.float32)
        return nothing, nothing if with_entropy else None
    return torch.cat(logps), torch.cat(entropies) if with_entropy else None


def _chunk_logps(head, hidden, targets, temperature: float, with_entropy: bool):
    """One log-softmax serves both: log p(target) and, detached, the entropy −Σ p·log p."""
    import torch

    logits = head(hidden).float()
    if temperature != 1.0:  # at 1 a division of every logit, and its backward, for nothing
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    chosen = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return chosen, None
    detached = log_probs.detach()
    return chosen, -(detached.exp() * detached).sum(-1)


def output_head(model):
    """The output head to apply by hand, or None where the model must compute its own logits."""
    inner = _unwrapped(model)
    if inner is None or not hasattr(inner, "get_output_embeddings"):
        return None
    config = getattr(inner, "config", None)
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) \
            or getattr(inner, "logit_scale", None) is not None:
        return None
    return inner.get_output_embeddings()


@contextlib.contextmanager
def head_taken_out(model, head):
    """The model's forward returns its final hidden states: the head is an identity meanwhile."""
    if head is None:
        yield
        return
    import torch

    inner = _unwrapped(model)
    inner.set_output_embeddings(torch.nn.Identity())
    try:
        yield
    finally:
        inner.set_output_embeddings(head)


def _unwrapped(model):
    """The module under DDP; None under FSDP or DeepSpeed (sharded: no plain head to take out)."""
    import torch

    if type(model).__name__ in ("FullyShardedDataParallel", "DeepSpeedEngine") \
            or any(cls.__name__ == "FSDPModule" for cls in type(model).__mro__):
        return None
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _vocab_size(head) -> int:
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None else 32_000
