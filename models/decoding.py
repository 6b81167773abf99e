"""Decoding without the per-call overhead of the transformers forward, for llama and qwen3.

At the model sizes this project trains on a CPU, a transformers forward of one token costs
several milliseconds, almost all of it framework work (mask building, cache objects, the
attention dispatch, output classes) rather than arithmetic. `Decoder` runs the same arithmetic
directly over the checkpoint's own weight tensors (nothing is copied): one preallocated
key/value buffer per layer written in place, the layer's math as plain torch calls, only the
rows still decoding computed (finished rows are dropped), and a prompt shared by several rows
(a group's samples) computed once. Greedy output equals `model.generate` token for token and
the log-probs a teacher-forced forward's (tests/test_decoding.py).

Architectures without a step function here (LFM2's convolutions, anything else), adapters other
than LoRA, models being trained and models whose weights are sharded (FSDP, DeepSpeed ZeRO-3)
keep the generic path (models/sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED = ("llama", "qwen3")


def fast_decoder(model) -> Decoder | None:
    """A Decoder over `model`'s weights when its architecture has a step function here, else None.
    A LoRA-wrapped model (peft) decodes through its wrapped modules: each projection is the peft
    layer itself, base weight plus adapter, as in its own forward."""
    if model.training:
        return None
    inner = direct_model(model)
    return Decoder(inner) if inner is not None else None


def direct_model(model):
    """The transformers model whose layers this module can run as plain torch calls (a PeftModel's
    base model, its LoRA layers in place), or None: another architecture, other adapters, sliding
    windows, another activation, or weights sharded by FSDP or DeepSpeed ZeRO-3."""
    if hasattr(model, "peft_config"):
        if any(config.peft_type != "LORA" for config in model.peft_config.values()):
            return None
        if hasattr(model, "get_base_model"):  # a PeftModel; transformers' own adapters sit in the model
            model = model.get_base_model()
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in SUPPORTED:
        return None
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return None  # sliding-window layers
    if config.hidden_act != "silu" or not _whole_weights(model):
        return None
    return model


def _whole_weights(model) -> bool:
    """Whether every layer holds its own full weight tensors: not sharded by FSDP or DeepSpeed
    ZeRO-3 (their hooks gather weights around a module's forward, which a direct step bypasses)."""
    import torch

    config = model.config
    expected = (config.num_attention_heads * _head_dim(config), config.hidden_size)
    return all(type(layer.self_attn.q_proj.weight) in (torch.nn.Parameter, torch.Tensor)
               and tuple(layer.self_attn.q_proj.weight.shape) == expected for layer in model.model.layers)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass
class _Layer:
    attention_norm: object
    q: object
    k: object
    v: object
    o: object
    q_norm: object  # qwen3's per-head norms (None for llama)
    k_norm: object
    mlp_norm: object
    gate: object
    up: object
    down: object

    def attention_inputs(self, hidden, cos, sin, shape: Shape):
        """Queries, keys and values [rows, heads, length, head_dim] of `hidden`, rotated."""
        normed = self.attention_norm(hidden)
        return self.heads(self.q(normed), self.k(normed), self.v(normed), hidden.shape[:2], cos, sin, shape)

    def heads(self, q, k, v, rows_length, cos, sin, shape: Shape):
        """Projected queries, keys and values (any leading shape holding rows × length tokens) as
        [rows, heads, length, head_dim], normed per head (qwen3) and rotated."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        rows, length = rows_length
        q = q.reshape(rows, length, shape.heads, shape.head_dim)
        k = k.reshape(rows, length, shape.kv_heads, shape.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = v.reshape(rows, length, shape.kv_heads, shape.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q, k, v

    def output(self, hidden, attended):
        """The layer's output: `hidden` plus the attention's projection, then plus the MLP's.
        `attended` is [..., heads × head_dim], shaped as `hidden`."""
        from torch.nn.functional import silu

        hidden = hidden + self.o(attended)
        normed = self.mlp_norm(hidden)
        return hidden + self.down(silu(self.gate(normed)) * self.up(normed))


@dataclass
class Shape:
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def scaling(self) -> float:
        return self.head_dim ** -0.5


def layers_of(model) -> list[_Layer]:
    return [_Layer(layer.input_layernorm, layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                   layer.self_attn.o_proj, getattr(layer.self_attn, "q_norm", None),
                   getattr(layer.self_attn, "k_norm", None), layer.post_attention_layernorm, layer.mlp.gate_proj,
                   layer.mlp.up_proj, layer.mlp.down_proj) for layer in model.model.layers]


def shape_of(model) -> Shape:
    config = model.config
    return Shape(config.num_attention_heads, config.num_key_value_heads, _head_dim(config))


class Decoder:
    """Prefill with `start`, then one token a step with `step`; `keep` drops finished rows."""

    def __init__(self, model):
        inner = model.model
        self.embed, self.rotary = inner.embed_tokens, inner.rotary_emb
        self.norm, self.head = _plain(inner.norm), _plain(model.lm_head)
        self.shape = shape_of(model)
        self.layers = [_Layer(**{name: _plain(module) for name, module in vars(layer).items()})
                       for layer in layers_of(model)]
        self.keys: list = []
        self.values: list = []
        self.bias = None  # (rows, capacity): 0 at the cache columns a row attends to, -inf elsewhere
        self.cos = self.sin = None  # rotation tables by position (`_rotation_tables`)
        shape, weight = self.shape, self.embed.weight
        # the attention's 1/sqrt(head_dim), folded into the queries' rotation
        self.cos_scale = weight.new_tensor([shape.scaling] * shape.heads + [1.0] * shape.kv_heads)[:, None]
        self.length = 0  # cache columns written

    def start(self, input_ids, attention, positions, capacity: int):
        """Prefill left-padded prompts (rows with the same prompt computed once); returns the last
        position's logits, one row per prompt row. `capacity`: columns to hold, prompt included."""
        import torch

        rows, width = input_ids.shape
        unique, index = unique_rows(input_ids, attention)
        first = self.embed.weight
        cache = (rows, self.shape.kv_heads, capacity, self.shape.head_dim)
        self.keys = [first.new_zeros(cache) for _ in self.layers]
        self.values = [first.new_zeros(cache) for _ in self.layers]
        self.bias = first.new_full((rows, capacity), -float("inf"))
        self.bias[:, :width].masked_fill_(attention.bool(), 0.0)
        self.cos, self.sin = self._rotation_tables(int(positions.max()) + capacity - width + 1)
        causal = torch.ones(width, width, dtype=torch.bool, device=input_ids.device).tril()
        mask = causal[None, None] & attention[unique].bool()[:, None, None, :]
        # a fully padded query row (left padding) would softmax over nothing: let it see itself
        mask |= torch.eye(width, dtype=torch.bool, device=input_ids.device)[None, None]
        hidden = self._prefill(input_ids[unique], positions[unique], mask, index)
        self.length = width
        return self.head(self.norm(hidden[:, -1]))[index]

    def step(self, tokens, positions):
        """One new token per row still decoding (`tokens`, `positions`: (rows,)); returns its logits.
        Attention for one query is two batched matmuls and a softmax: SDPA's kernel costs several
        times its arithmetic at this size."""
        import torch

        column, end = self.length, self.length + 1
        self.bias[:, column] = 0.0
        bias = self.bias[:, None, None, :end]
        shape, rows = self.shape, len(tokens)
        cos = self.cos.index_select(0, positions)[:, None] * self.cos_scale
        sin = self.sin.index_select(0, positions)[:, None] * self.cos_scale
        hidden = self.embed(tokens)
        for layer, keys, values in zip(self.layers, self.keys, self.values):
            normed = layer.attention_norm(hidden)
            q, k = layer.q(normed).view(rows, shape.heads, -1), layer.k(normed).view(rows, shape.kv_heads, -1)
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            rotated = _rotated(torch.cat([q, k], 1), cos, sin)
            keys[:, :, column] = rotated[:, shape.heads:]
            values[:, :, column] = layer.v(normed).view(rows, shape.kv_heads, -1)
            # GQA: the queries grouped by the kv head they read
            grouped = rotated[:, :shape.heads].reshape(rows, shape.kv_heads, -1, shape.head_dim)
            scores = torch.matmul(grouped, keys[:, :, :end].transpose(-1, -2)).add_(bias)
            weights = torch.softmax(scores, -1, dtype=torch.float32).to(scores.dtype)
            hidden = layer.output(hidden, torch.matmul(weights, values[:, :, :end]).view(rows, -1))
        self.length = end
        return self.head(self.norm(hidden))

    def keep(self, rows) -> None:
        """Keep only these rows (indices into the current rows): finished rows stop costing work."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self.bias = self.bias.index_select(0, rows)

    def _rotation_tables(self, count: int):
        """cos and sin [count, head_dim] of positions 0..count-1 (the model's own rotary), sin's first
        half negated so that rotating half is a swap (`_rotated`)."""
        import torch

        weight = self.embed.weight
        cos, sin = self.rotary(weight[None, :1], torch.arange(count, device=weight.device)[None])
        half = cos.shape[-1] // 2
        return cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1)

    def _prefill(self, input_ids, positions, mask, expand):
        """The decoder layers over the distinct prompts, their keys and values written to the cache's
        columns 0.. of every row that shares them (`expand`: each cache row's prompt)."""
        from torch.nn.functional import scaled_dot_product_attention

        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, positions)
        rows, length = input_ids.shape
        shape = self.shape
        for layer, keys, values in zip(self.layers, self.keys, self.values):
            q, k, v = layer.attention_inputs(hidden, cos, sin, shape)
            keys[:, :, :length], values[:, :, :length] = k[expand], v[expand]
            attended = scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=shape.scaling,
                                                    enable_gqa=shape.heads != shape.kv_heads)
            hidden = layer.output(hidden, attended.transpose(1, 2).reshape(rows, length, -1))
        return hidden


def _rotated(heads, cos, sin):
    """Rotary embedding of `heads` [..., head_dim] with `Decoder._rotation_tables`' cos and sin:
    x·cos + rotate_half(x)·sin, where rotate_half(x) = (-x2, x1) is the swap (x2, x1) times sin's signs."""
    import torch

    half = heads.shape[-1] // 2
    return heads * cos + torch.cat([heads[..., half:], heads[..., :half]], -1) * sin


def _plain(module):
    """`module` as a plain call when it is a torch Linear or an RMSNorm: a module call's Python costs
    about as much as a small matmul's arithmetic at this size. Anything else (a peft LoRA layer, an
    absent qwen3 norm) stays as it is."""
    import torch
    from torch.nn.functional import linear

    if type(module) is torch.nn.Linear:
        weight, bias = module.weight, module.bias
        return lambda x: linear(x, weight, bias)
    if type(module).__name__ in ("LlamaRMSNorm", "Qwen3RMSNorm"):
        weight, eps = module.weight, module.variance_epsilon

        def normed(x):  # as the module computes it: in float32, weighted in the input's dtype
            x32 = x.float()
            return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return normed
    return module


def unique_rows(input_ids, attention):
    """(indices of the first row of each distinct prompt, for every row the index of its prompt
    among those): a group's samples share one prefill."""
    import torch

    seen: dict[tuple, int] = {}
    first, index = [], []
    for row, (ids, mask) in enumerate(zip(input_ids.tolist(), attention.tolist())):
        key = (tuple(ids), tuple(mask))
        if key not in seen:
            seen[key] = len(first)
            first.append(row)
        index.append(seen[key])
    device = input_ids.device
    return torch.tensor(first, device=device), torch.tensor(index, device=device)
