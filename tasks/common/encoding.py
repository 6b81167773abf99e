"""Training examples as token ids: a chat prompt (masked from the loss) + a completion (trained
on, except where the env wrote it), and batches of them padded for the model. Shared by sft and
preference, so both train on the same tokenization."""

from __future__ import annotations

from dataclasses import dataclass

from models.losses import IGNORE_INDEX
from models.sampling import chat_prompt


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]
    truncated: bool


def encode_ids(prompt_ids: list[int], completion_ids: list[int], max_len: int,
               loss_mask: list[int] | None = None) -> Example:
    """Prompt token ids (masked) + completion token ids (trained on where `loss_mask` is 1:
    not on env-written tokens), cut at `max_len`."""
    trained = completion_ids if loss_mask is None else \
        [token if keep else IGNORE_INDEX for token, keep in zip(completion_ids, loss_mask)]
    input_ids = (prompt_ids + completion_ids)[:max_len]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + trained)[:max_len]
    return Example(input_ids, labels, len(prompt_ids) + len(completion_ids) > max_len)


def encode_example(tokenizer, prompt: str, completion: str, max_len: int) -> Example:
    """Chat-formatted prompt (masked) + completion + end token (trained on)."""
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return encode_ids(chat_prompt(tokenizer, prompt), completion_ids, max_len)


def encode_row(tokenizer, row: dict, max_len: int) -> Example:
    """A text row (prompt, completion), or a multi-turn row with its token ids and loss mask
    (the env's observation tokens are not trained on)."""
    if "token_ids" not in row:  # single-turn datasets are text only
        return encode_example(tokenizer, row["prompt"], row["completion"], max_len)
    return encode_ids([], list(row["token_ids"]), max_len, list(row["loss_mask"]))


def collate(examples: list[Example], pad_id: int, device):
    import torch

    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        ids[row, :n] = torch.tensor(example.input_ids)
        labels[row, :n] = torch.tensor(example.labels)
        mask[row, :n] = 1
    return ids.to(device), mask.to(device), labels.to(device)
