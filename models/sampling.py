"""The generation engine: batched decoding with a KV cache, token-in / token-out.

Every completion comes back with its token ids, the log-prob of each token, its text and
why it ended. Prompts are token ids, so a multi-turn rollout appends the completion and the
environment's observation tokens to the previous ids and continues: earlier turns are never
re-tokenized.

Log-probs are those of the distribution the token was drawn from before top-k/top-p
truncation: the model's own for greedy decoding, the temperature-scaled one when sampling.
"""

from __future__ import annotations

import json

from dataclasses import dataclass, field


STOP_WINDOW = 16  # recent tokens searched for a stop string each step


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float | None = None  # None: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    stop: tuple[str, ...] = ()  # strings that end a completion (not included in its text)
    top_logprobs: int = 0  # the most likely tokens to report at each step, with their log-probs


@dataclass
class Generation:
    text: str
    token_ids: list[int]  # what the model emitted, the end token included when it stopped on it
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" (end token or stop string) | "length" (budget spent)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, if asked for
    policy_version: int = 0  # the weights' version that produced it (an RL stage's weight syncs)


CONVERSATION_PREFIX = '[{"role": '  # a conversational prompt, kept as JSON turns (data_contracts/formats.py)


def prompt_turns(prompt: str) -> list[dict]:
    """A task's prompt as chat turns: its own turns when it is a stored conversation (a system turn,
    earlier exchanges), else one user turn."""
    if prompt.startswith(CONVERSATION_PREFIX):
        try:
            return json.loads(prompt)
        except json.JSONDecodeError:
            pass
    return [{"role": "user", "content": prompt}]


def chat_prompt(tokenizer, prompt: str, tools: list[dict] | None = None) -> list[int]:
    """The ids of a chat prompt; `tools` (OpenAI tool schemas) rendered by the template, where the task has them."""
    text = tokenizer.apply_chat_template(prompt_turns(prompt), tokenize=False, add_generation_prompt=True,
                                         **({"tools": tools} if tools else {}), **template_kwargs(tokenizer))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def template_kwargs(tokenizer) -> dict:
    """What the spec's `model.chat_template_kwargs` passes to the chat template (Qwen3's
    `enable_thinking`), kept on the tokenizer by models/loading.py: load_tokenizer."""
    return dict(getattr(tokenizer, "posttrain_template_kwargs", {}))


def generate(model, tokenizer, prompts: list[str], *, max_new_tokens: int, temperature: float | None = None,
             top_p: float = 1.0, top_k: int = 0, stop: tuple[str, ...] = (), batch_size: int = 64,
             seed: int = 0) -> list[Generation]:
    """Complete chat prompts (text in); see `generate_tokens`."""
    params = SamplingParams(max_new_tokens, temperature, top_p, top_k, tuple(stop))
    return generate_tokens(model, tokenizer, [chat_prompt(tokenizer, p) for p in prompts], params,
                           batch_size=batch_size, seed=seed)


def generate_tokens(model, tokenizer, prompts: list[list[int]], params: SamplingParams, *, batch_size: int = 64,
                    seed: int = 0, on_batch=None, row_seeds: list[int] | None = None,
                    abandoned=None, on_step=None) -> list[Generation]:
    """Complete each prompt (token ids in), `batch_size` prompts at a time; `on_batch(done)` after
    each batch, with the number of prompts completed so far. `abandoned()`, asked every step, names
    the prompts (indices) nobody waits for any more: their rows stop decoding there. `on_step(prompts,
    tokens, logprobs, tops)` after each step: the token each still-decoding prompt drew, its log-prob
    and (with `params.top_logprobs`) its alternatives, else None (a streaming server's feed).

    Each prompt samples from its own generator, seeded `row_seeds[i]` (default `seed + i`): what a
    prompt gets depends on its seed, not on the batch it shares, so a workload split across
    processes (tasks/common/ranks.py) samples what one process would."""
    model.eval()
    row_seeds = row_seeds if row_seeds is not None else [seed + i for i in range(len(prompts))]
    results: list[Generation] = []
    for start in range(0, len(prompts), batch_size):
        gone = None if abandoned is None else \
            (lambda first=start: {i - first for i in abandoned()})
        stepped = None if on_step is None else \
            (lambda rows, *drawn, first=start: on_step([first + r for r in rows], *drawn))
        results += _decode_batch(model, tokenizer, prompts[start:start + batch_size], params,
                                 row_seeds[start:start + batch_size], gone, stepped)
        if on_batch is not None:
            on_batch(len(results))
    return results


def left_padded(prompts: list[list[int]], pad_id: int, device):
    import torch

    width = max(len(ids) for ids in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompts):  # left padding keeps every prompt's last token in the last column
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention[row, width - len(ids):] = 1
    return input_ids.to(device), attention.to(device)


def next_tokens(logits, params: SamplingParams, uniforms=None):
    """Pick one token per row; returns (tokens, their log-probs). Sampling draws row i's token with
    `uniforms[i]` (float64 in [0, 1), from the row's own generator); greedy decoding needs none."""
    import torch

    if params.temperature is None:
        logprobs, tokens = torch.log_softmax(logits.float(), dim=-1).max(dim=-1)  # the first maximum, as argmax
        return tokens, logprobs
    logprobs = torch.log_softmax(logits.float() / params.temperature, dim=-1)
    filtered = logprobs.clone() if params.top_k > 0 else logprobs  # top-k cuts in place
    if params.top_k > 0:
        kth = torch.topk(filtered, min(params.top_k, filtered.size(-1)), dim=-1).values[:, -1:]
        filtered[filtered < kth] = -float("inf")
    if params.top_p < 1.0:
        filtered = nucleus(filtered, params.top_p)
    # inverse-CDF sampling, every row's search at once (a torch.multinomial call per row cost ~30 µs), on
    # the logits' device: only the rows' draws go there, nothing vocabulary-sized comes back to the host
    cdf = torch.softmax(filtered, dim=-1).double().cumsum(-1)
    draws = uniforms.to(cdf.device)
    # `right`: the first token whose cumulative mass exceeds the draw, never a token of zero mass
    tokens = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=cdf.shape[1] - 1)
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


NUCLEUS_CANDIDATES = 64  # the likeliest tokens ranked first: a nucleus that closes among them needs no full sort


def nucleus(logprobs, top_p: float):
    """`logprobs` [rows, vocab] with every token outside its row's nucleus at -inf: a token stays when
    the probability of the tokens ranked above it is at most `top_p` (so the likeliest always stays).

    The ranking is a top-k of NUCLEUS_CANDIDATES first: sorting a whole vocabulary every decode step
    cost more than the step's matmuls, and a nucleus almost always closes within the first few dozen
    tokens. Where a row's does not, the whole vocabulary is sorted. Both give the same tokens (the
    cumulative sums are the same prefix; only the order of exactly tied log-probs may differ)."""
    import torch

    vocabulary = logprobs.size(-1)
    ranked, order, probs, mass = _ranked(logprobs, min(NUCLEUS_CANDIDATES, vocabulary))
    if ranked.size(-1) < vocabulary and not bool((mass[:, -1] > top_p).all()):
        ranked, order, probs, mass = _ranked(logprobs, vocabulary)
    outside = mass - probs > top_p  # ranked after the nucleus is full
    kept = torch.full_like(logprobs, -float("inf"))
    return kept.scatter_(-1, order, ranked.masked_fill(outside, -float("inf")))


def _ranked(logprobs, count: int):
    """Each row's `count` likeliest tokens, likeliest first: (log-probs, token ids, probabilities,
    cumulative probabilities)."""
    ranked, order = logprobs.topk(count, dim=-1) if count < logprobs.size(-1) else \
        logprobs.sort(dim=-1, descending=True)
    probs = ranked.exp()
    return ranked, order, probs, probs.cumsum(-1)


def row_uniforms(row_seeds: list[int], steps: int):
    """[rows, steps] float64 draws, row i's from a generator seeded `row_seeds[i]`: step s of row i
    samples with [i, s] (drawn in one call per row, the stream one draw a step would give)."""
    import torch

    return torch.stack([torch.rand(steps, generator=torch.Generator().manual_seed(seed % 2**63), dtype=torch.float64)
                        for seed in row_seeds])


def _decode_batch(model, tokenizer, prompts: list[list[int]], params: SamplingParams,
                  row_seeds: list[int], abandoned=None, on_step=None) -> list[Generation]:
    import torch

    from models.decoding import fast_decoder

    uniforms = row_uniforms(row_seeds, params.max_new_tokens) if params.temperature is not None else None
    ends, pad = torch.tensor(end_token_ids(model, tokenizer), dtype=torch.long), tokenizer.pad_token_id
    input_ids, attention = left_padded(prompts, pad, model.device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    rows = len(prompts)
    done = torch.zeros(rows, dtype=torch.bool)
    length = torch.full((rows,), params.max_new_tokens, dtype=torch.long)  # tokens each row keeps
    active = torch.arange(rows)  # the rows still decoding, in the engine's row order
    engine = fast_decoder(model) or _Generic(model, pad)
    steps_tokens, steps_logprobs, steps_top = [], [], []
    with torch.no_grad():
        logits = engine.start(input_ids, attention, positions, input_ids.shape[1] + params.max_new_tokens)
        position = positions[:, -1].clone().cpu()  # the active rows' last position
        for step in range(params.max_new_tokens):
            draws = None if uniforms is None else uniforms[active, step]
            picked, picked_logprobs = (x.cpu() for x in next_tokens(logits, params, draws))
            steps_tokens.append(_every_row(picked, active, rows, pad))
            steps_logprobs.append(_every_row(picked_logprobs, active, rows, 0.0))  # float32 already
            tops = top_tokens(logits, params) if params.top_logprobs else None
            if tops is not None:
                steps_top.append(tuple(_every_row(x, active, rows, 0) for x in tops))
            if on_step is not None:
                on_step(active.tolist(), picked.tolist(), picked_logprobs.tolist(),
                        None if tops is None else [list(zip(i, v)) for i, v in zip(*(x.tolist() for x in tops))])
            ended = torch.isin(picked, ends)  # of the active rows
            if params.stop:
                ended |= _stop_hits(tokenizer, torch.stack(steps_tokens[-STOP_WINDOW:], 1)[active], params.stop)
            if abandoned is not None:
                gone = abandoned()
                ended |= torch.tensor([row in gone for row in active.tolist()], dtype=torch.bool)
            if bool(ended.any()):
                length[active[ended]] = step + 1
                done[active[ended]] = True
                still = ~ended
                if not bool(still.any()):
                    break
                engine.keep(still.nonzero()[:, 0].to(model.device))  # finished rows leave the batch
                active, picked, position = active[still], picked[still], position[still]
            if step == params.max_new_tokens - 1:
                break  # the budget is spent: no logits for a token that will not be drawn
            position += 1
            logits = engine.step(picked.to(model.device), position.to(model.device))
    token_rows, logprob_rows = torch.stack(steps_tokens, 1).tolist(), torch.stack(steps_logprobs, 1).tolist()
    gens = []
    for row, n in enumerate(length.tolist()):
        gen = Generation("", token_rows[row][:n], logprob_rows[row][:n], "stop" if done[row] else "length")
        gen.text = before_stop(tokenizer.decode(gen.token_ids, skip_special_tokens=True), params.stop)
        gens.append(gen)
    if steps_top:
        _add_top_logprobs(gens, steps_top)
    return gens


def end_token_ids(model, tokenizer) -> list[int]:
    """The ids that end a completion, as vLLM ends one: the tokenizer's end token and every
    `eos_token_id` of the model's generation_config (Qwen3's <|im_end|> and <|endoftext|>), so that a
    local rollout stops where a server's would."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= {configured} if isinstance(configured, int) else {i for i in configured or () if isinstance(i, int)}
    return sorted(ids)


def top_tokens(logits, params: SamplingParams):
    """([rows, k] ids, [rows, k] log-probs) of each row's `params.top_logprobs` likeliest tokens, in
    the distribution the sampled token's log-prob comes from (temperature-scaled when sampling)."""
    import torch

    scaled = logits.float() if params.temperature is None else logits.float() / params.temperature
    values, ids = torch.log_softmax(scaled, -1).topk(min(params.top_logprobs, logits.shape[-1]), -1)
    return ids.cpu(), values.cpu()


def _add_top_logprobs(gens: list[Generation], steps_top: list[tuple]) -> None:
    import torch

    ids, values = (torch.stack(part, 1).tolist() for part in zip(*steps_top))  # [rows, steps, k]
    for row, gen in enumerate(gens):
        gen.top_logprobs = [list(zip(i, v)) for i, v in zip(ids[row], values[row])][:len(gen.token_ids)]


def _every_row(values, active, rows: int, fill):
    """The active rows' `values` as one entry per row of the batch, `fill` at the finished rows."""
    import torch

    if len(active) == rows:
        return values
    every = torch.full((rows, *values.shape[1:]), fill, dtype=values.dtype)
    every[active] = values
    return every


class _Generic:
    """Any architecture through its transformers forward and the cache it builds (KV, or LFM2's
    hybrid conv state). Every row stays in the batch (a finished one is fed the pad token); only
    the logits of the rows still decoding are returned."""

    def __init__(self, model, pad: int):
        self.model, self.pad = model, pad

    def start(self, input_ids, attention, positions, capacity: int):
        import torch

        self.attention, self.position = attention, positions[:, -1].clone()
        self.rows = torch.arange(len(input_ids), device=input_ids.device)
        output = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True,
                            logits_to_keep=1)
        self.cache = output.cache
        return output.logits[:, -1, :]

    def step(self, tokens, positions):
        """`tokens` of the rows still decoding; every row's position moves on by one."""
        import torch

        every_token = torch.full((len(self.attention),), self.pad, dtype=torch.long, device=tokens.device)
        every_token[self.rows] = tokens
        self.position += 1
        self.attention = torch.cat([self.attention, torch.ones_like(self.attention[:, :1])], dim=-1)
        output = self.model(input_ids=every_token[:, None], attention_mask=self.attention,
                            position_ids=self.position[:, None], cache=self.cache, use_cache=True)
        self.cache = output.cache
        return output.logits[self.rows, -1, :]

    def keep(self, rows) -> None:
        self.rows = self.rows[rows]


def _stop_hits(tokenizer, generated, stop: tuple[str, ...]):
    """Rows of `generated` (each row's recent tokens) whose text contains a stop string."""
    import torch

    return torch.tensor([any(s in tokenizer.decode(ids, skip_special_tokens=True) for s in stop)
                         for ids in generated.tolist()], dtype=torch.bool)


def before_stop(text: str, stop: tuple[str, ...]) -> str:
    """The text before the first stop string (a generation's text)."""
    cut = min((text.find(s) for s in stop if s in text), default=-1)
    return text[:cut] if cut >= 0 else text
