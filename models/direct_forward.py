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
- `shared_prefix_hidden`: rows that begin alike (a preference pair's prompt, then its chosen and
  its rejected completion) compute the shared beginning once.

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
    device = input_ids.device
    real = attention_mask.bool()
    shift = _contiguous_start(real)
    if shift is None or not bool((~scored | (real[:, :-1] & real[:, 1:])).all()):
        return None
    if position_ids is None:  # transformers numbers a training batch's columns 0..T-1
        position_ids = torch.arange(length, device=device).expand(rows, -1)
    if bool(shift.any()):
        index = (torch.arange(length, device=device) + shift[:, None]) % length
        input_ids, position_ids = input_ids.gather(1, index), position_ids.gather(1, index)
        scored = torch.cat([scored, scored.new_zeros(rows, 1)], dim=1).gather(1, index)[:, :-1]
        real = real.gather(1, index)
    slots = real.flatten().nonzero()[:, 0]
    hidden = inner.model.embed_tokens(input_ids.flatten()[slots])
    cos, sin = inner.model.rotary_emb(hidden, position_ids)
    shape = shape_of(inner)

    def attend(layer, projected):
        q, k, v = layer.heads(*(_padded(x, slots, rows * length) for x in projected), (rows, length), cos, sin, shape)
        attended = scaled_dot_product_attention(q, k, v, is_causal=True, scale=shape.scaling,
                                                enable_gqa=shape.heads != shape.kv_heads)
        return _flat(attended, slots)

    return _packed_layers(inner, hidden, attend, _flat_index(slots, real.shape)[:, :-1][scored])


def _packed_layers(inner, hidden, attend, wanted):
    """The decoder layers over real tokens only, flat [tokens, H]: the projections and the MLP see
    no padding (where most of the arithmetic is); `attend(layer, (q, k, v))` does the attention
    over whatever padded layout it needs. Returns the final normed hidden states of the tokens
    `wanted` (flat indices): the last layer computes its output only there."""
    layers = layers_of(inner)
    for number, layer in enumerate(layers):
        normed = layer.attention_norm(hidden)
        attended = attend(layer, (layer.q(normed), layer.k(normed), layer.v(normed)))
        if number == len(layers) - 1:
            return inner.model.norm(layer.output(hidden.index_select(0, wanted), attended.index_select(0, wanted)))
        hidden = layer.output(hidden, attended)
    return None


def _padded(flat, slots, size: int):
    """Flat rows [n, D] placed at `slots` of a zero [size, D] matrix (the padded layout, row-major)."""
    return flat.new_zeros(size, flat.size(-1)).index_copy(0, slots, flat)


def _flat(attended, slots):
    """SDPA's output [rows, heads, length, head_dim] as the flat rows [n, heads × head_dim] at `slots`
    (index_select: its backward is several times faster than advanced indexing's)."""
    return attended.transpose(1, 2).flatten(0, 1).flatten(1).index_select(0, slots)


def _flat_index(slots, shape, offset: int = 0):
    """[rows, length]: each padded position's index among the flat tokens (`offset` + its rank in
    `slots`), -1 on padding."""
    import torch

    index = torch.full((shape.numel(),), -1, dtype=torch.long, device=slots.device)
    index[slots] = offset + torch.arange(len(slots), device=slots.device)
    return index.view(shape)


def _contiguous_start(real):
    """Each row's first real column when every row's real tokens are contiguous, else None."""
    import torch

    start = real.int().argmax(-1)
    count = real.sum(-1)
    columns = torch.arange(real.size(1), device=real.device)
    expected = (columns >= start[:, None]) & (columns < (start + count)[:, None])
    return start if torch.equal(expected, real) else None


def _right_padded(real) -> bool:
    """Whether every row's real tokens start at column 0 and run without a gap."""
    return bool(real[:, 0].all()) and _contiguous_start(real) is not None


def shared_prefix_hidden(inner, prefixes, prefix_mask, suffixes, suffix_mask, owner, scored):
    """Final hidden states [N, H] predicting the scored suffix tokens (`scored` [S, Ls]), in
    row-major order, for rows that continue a shared prefix: a preference pair's prompt, or an RL
    group's, computed once, then each completion. `prefixes` [P, Lp] and `suffixes` [S, Ls] are
    right-padded; suffix row s continues prefix row `owner[s]`. A suffix's first token is
    predicted from its prefix's last token, the others from the suffix's own positions.

    Only real tokens go through the projections and the MLP, all in one flat [tokens, H] matrix
    (two half-size matmuls are slower than one; padding there would be arithmetic for nothing).
    Attention alone sees the padded rows: the prefixes attend causally among themselves; each
    suffix attends to its prefix's real tokens and causally to itself (an explicit mask). None
    when the rows do not fit this path."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention

    prefix_real, suffix_real = prefix_mask.bool(), suffix_mask.bool()
    if not _right_padded(prefix_real) or not _right_padded(suffix_real) or bool((scored & ~suffix_real).any()):
        return None
    width = suffixes.size(1)
    device = suffixes.device
    shape = shape_of(inner)
    prefix_lengths = prefix_real.sum(-1)
    prefix_slots, suffix_slots = prefix_real.flatten().nonzero()[:, 0], suffix_real.flatten().nonzero()[:, 0]
    split = len(prefix_slots)  # flat tokens: the prefixes' real ones, then the suffixes'
    hidden = inner.model.embed_tokens(torch.cat([prefixes.flatten()[prefix_slots], suffixes.flatten()[suffix_slots]]))
    prefix_positions = torch.arange(prefixes.size(1), device=device).expand(prefixes.size(0), -1)
    suffix_positions = prefix_lengths[owner][:, None] + torch.arange(width, device=device)
    prefix_rotation = inner.model.rotary_emb(hidden, prefix_positions)
    suffix_rotation = inner.model.rotary_emb(hidden, suffix_positions)
    own = torch.ones(width, width, dtype=torch.bool, device=device).tril() & suffix_real[:, None, :]
    own |= torch.eye(width, dtype=torch.bool, device=device)  # a padded query sees itself: nothing is NaN
    mask = torch.cat([prefix_real[owner][:, None, :].expand(-1, width, -1), own], dim=-1)[:, None]
    wanted = _predictors(prefix_slots, suffix_slots, prefixes.shape, suffixes.shape, prefix_lengths, owner)[scored]
    gqa = shape.heads != shape.kv_heads

    def attend(layer, projected):
        q, k, v = layer.heads(*(_padded(x[:split], prefix_slots, prefixes.numel()) for x in projected),
                              prefixes.shape, *prefix_rotation, shape)
        suffix_q, suffix_k, suffix_v = layer.heads(*(_padded(x[split:], suffix_slots, suffixes.numel())
                                                     for x in projected), suffixes.shape, *suffix_rotation, shape)
        prefix_attended = scaled_dot_product_attention(q, k, v, is_causal=True, scale=shape.scaling, enable_gqa=gqa)
        # index_select, not k[owner]: advanced indexing's backward adds a shared prefix's rows with
        # atomic float adds across threads on the CPU, in an order that varies from run to run
        suffix_attended = scaled_dot_product_attention(
            suffix_q, torch.cat([k.index_select(0, owner), suffix_k], dim=2),
            torch.cat([v.index_select(0, owner), suffix_v], dim=2),
            attn_mask=mask, scale=shape.scaling, enable_gqa=gqa)
        return torch.cat([_flat(prefix_attended, prefix_slots), _flat(suffix_attended, suffix_slots)])

    return _packed_layers(inner, hidden, attend, wanted)


def _predictors(prefix_slots, suffix_slots, prefix_shape, suffix_shape, prefix_lengths, owner):
    """[S, Ls]: the flat token whose output predicts each suffix token: its prefix's last token
    for the first, the suffix's own previous token for the others (real, as rows are right-padded)."""
    predictors = _flat_index(suffix_slots, suffix_shape, len(prefix_slots)).roll(1, dims=1)
    predictors[:, 0] = _flat_index(prefix_slots, prefix_shape).flatten()[owner * prefix_shape[1]
                                                                          + prefix_lengths[owner] - 1]
    return predictors
