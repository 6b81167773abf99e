"""The training forward of llama and qwen3 as plain torch calls over the model's own modules (LoRA
layers included; the layer math of models/decoding.py), returning the final hidden states at the
positions a loss scores.

At this project's CPU sizes a training step is matmul-bound (three quarters of it at the machine's
matmul rate), so what this saves is arithmetic and memory traffic, not framework calls:
- Attention through SDPA's causal kernel, without a mask. Rows are rolled so each row's tokens
  start at column 0 (an RL row's left-padded prompt then right-padded completion is contiguous,
  so rolling it left by its padding makes it right-padded); then every padded key sits after the
  row's last real query and causality alone hides it. transformers is handed the padding mask,
  so it builds a [B, 1, T, T] mask and takes SDPA's masked path.
- The last layer's output projection and MLP only at the scored positions (its attention still
  reads every position's keys and values): the prompt and padding columns stop there.

Log-probs equal the transformers forward's within float rounding (tests/test_direct_forward.py).
Anything else takes the transformers forward: other architectures, gradient checkpointing,
attention dropout while training, rows with holes or scored positions outside the real tokens.
"""

from __future__ import annotations

from models.decoding import direct_model, layers_of, shape_of


def trainable_directly(model):
    """The transformers model `model` can run its training forward as here, else None."""
    inner = direct_model(model)
    if inner is None or getattr(inner, "is_activation_checkpointing", False):
        return None
    if model.training and getattr(inner.config, "attention_dropout", 0.0):
        return None
    return inner


def scored_hidden(inner, input_ids, attention_mask, position_ids, scored):
    """Final hidden states [N, H] at the positions t where `scored[:, t]` ([B, T-1]: position t
    predicts token t + 1), in row-major order; None when the rows do not fit this path (a row
    whose tokens are not contiguous, or a scored position whose query or target is padding)."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention

    rows, length = input_ids.shape
    real = attention_mask.bool()
    shift = _contiguous_start(real)
    if shift is None or not bool((~scored | (real[:, :-1] & real[:, 1:])).all()):
        return None
    if position_ids is None:  # transformers numbers a training batch's columns 0..T-1
        position_ids = torch.arange(length, device=input_ids.device).expand(rows, -1)
    if bool(shift.any()):
        index = (torch.arange(length, device=input_ids.device) + shift[:, None]) % length
        input_ids, position_ids = input_ids.gather(1, index), position_ids.gather(1, index)
        scored = torch.cat([scored, scored.new_zeros(rows, 1)], dim=1).gather(1, index)[:, :-1]
    hidden = inner.model.embed_tokens(input_ids)
    cos, sin = inner.model.rotary_emb(hidden, position_ids)
    shape = shape_of(inner)
    layers = layers_of(inner)
    for number, layer in enumerate(layers):
        q, k, v = layer.attention_inputs(hidden, cos, sin, shape)
        attended = scaled_dot_product_attention(q, k, v, is_causal=True, scale=shape.scaling,
                                                enable_gqa=shape.heads != shape.kv_heads)
        attended = attended.transpose(1, 2).reshape(rows, length, -1)
        if number == len(layers) - 1:  # only the scored positions' outputs are read
            return inner.model.norm(layer.output(hidden[:, :-1][scored], attended[:, :-1][scored]))
        hidden = layer.output(hidden, attended)
    return None


def _contiguous_start(real):
    """Each row's first real column when every row's real tokens are contiguous, else None."""
    import torch

    start = real.int().argmax(-1)
    count = real.sum(-1)
    columns = torch.arange(real.size(1), device=real.device)
    expected = (columns >= start[:, None]) & (columns < (start + count)[:, None])
    return start if torch.equal(expected, real) else None
