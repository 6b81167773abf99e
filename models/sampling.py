"""Batched generation from a causal LM: greedy or sampled, with finish reasons."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end token) | "length" (token budget spent)


def chat_prompt(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def generate(model, tokenizer, prompts: list[str], *, max_new_tokens: int, temperature: float | None = None,
             top_p: float = 1.0, batch_size: int = 64, seed: int = 0) -> list[Generation]:
    """Complete each chat prompt; temperature None = greedy decoding."""
    import torch

    torch.manual_seed(seed)
    model.eval()
    encoded = [chat_prompt(tokenizer, p) for p in prompts]
    results: list[Generation] = []
    eos = tokenizer.eos_token_id
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start:start + batch_size]
        width = max(len(ids) for ids in chunk)
        input_ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for row, ids in enumerate(chunk):  # left padding keeps every prompt's end aligned
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention[row, width - len(ids):] = 1
        sampling = {"do_sample": False} if temperature is None else {
            "do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
        with torch.no_grad():
            output = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention.to(model.device),
                                    max_new_tokens=max_new_tokens, eos_token_id=eos,
                                    pad_token_id=tokenizer.pad_token_id, **sampling)
        for row in output[:, width:].tolist():
            finished = eos in row
            tokens = row[:row.index(eos)] if finished else row
            results.append(Generation(tokenizer.decode(tokens, skip_special_tokens=True), tokens,
                                      "stop" if finished else "length"))
    return results
