"""Training examples as token ids: a chat prompt (masked from the loss) + a completion (trained
on, except where the env wrote it), a conversation (trained on its assistant turns), plain text,
and batches of them padded for the model. Shared by sft, preference and the dataset stage's token
counts, so all see the same tokenization."""

from __future__ import annotations

import json
from dataclasses import dataclass

from data_contracts.formats import decoded
from models.losses import IGNORE_INDEX
from models.sampling import chat_prompt, template_kwargs


class TemplateError(ValueError):
    """The model's chat template cannot give assistant-only masks; str() is one line."""


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]
    truncated: bool

    @property
    def scored_tokens(self) -> int:
        """The tokens a loss scores: labels after the first that are not IGNORE_INDEX."""
        return sum(label != IGNORE_INDEX for label in self.labels[1:])


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


def render(tokenizer, turns: list[dict], tools: list | None, generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(turns, tools=tools or None, tokenize=False,
                                         add_generation_prompt=generation_prompt, **template_kwargs(tokenizer))


class RewritesEarlierTurns(TemplateError):
    """The template renders an earlier turn differently once a later one follows."""


def assistant_spans(tokenizer, turns: list[dict], tools: list | None, trained_from: int = 0) -> tuple[str, list]:
    """The conversation rendered by the model's chat template, and the character spans of the
    assistant turns at index >= `trained_from`. Rendered turn by turn, each span from after its
    generation prompt to the end of its rendering; a template that rewrites earlier turns when a
    later one is added (Qwen3 drops the reasoning of answers before the last question, and gives
    the last answer an empty think block) is rendered whole instead (`whole_spans`)."""
    try:
        return turn_by_turn_spans(tokenizer, turns, tools, trained_from)
    except RewritesEarlierTurns:
        return whole_spans(tokenizer, turns, tools, trained_from)


def turn_by_turn_spans(tokenizer, turns: list[dict], tools: list | None, trained_from: int) -> tuple[str, list]:
    text, spans = "", []
    for k, turn in enumerate(turns):
        full = render(tokenizer, turns[:k + 1], tools)
        start = len(text)
        if turn["role"] == "assistant" and k >= trained_from and k > 0:
            head = render(tokenizer, turns[:k], tools, generation_prompt=True)
            if not head.startswith(text) or not full.startswith(head):
                raise _rewrites(tokenizer)
            start = len(head)
            spans.append((start, len(full)))
        elif not full.startswith(text):
            raise _rewrites(tokenizer)
        text = full
    return text, spans


def _rewrites(tokenizer) -> RewritesEarlierTurns:
    return RewritesEarlierTurns(f"the chat template of {tokenizer.name_or_path} rewrites earlier turns when a later "
                                "one is added, so assistant-only masks cannot come from it; train on "
                                "prompt_completion rows instead")


SENTINEL = "\u2063posttrain-answer\u2063"  # an answer no template writes on its own


def whole_spans(tokenizer, turns: list[dict], tools: list | None, trained_from: int) -> tuple[str, list]:
    """The conversation rendered whole (the context the model reads before its last answer), each
    assistant turn's span found by the template's own assistant header and end-of-turn text, and
    holding that turn's answer; a template where they cannot be found is refused."""
    header, end = assistant_framing(tokenizer, tools)
    text, spans, cursor = render(tokenizer, turns, tools), [], 0
    for k, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        start = text.find(header, cursor)
        stop = text.find(end, start + len(header)) if start >= 0 else -1
        if stop < 0 or visible_answer(turn) not in text[start + len(header):stop]:
            raise TemplateError(str(_rewrites(tokenizer)))
        cursor = stop + len(end)
        if k >= trained_from and k > 0:
            spans.append((start + len(header), cursor))
    return text, spans


def assistant_framing(tokenizer, tools: list | None) -> tuple[str, str]:
    """(what the template writes before an answer, what it writes after one), read off a probe: an
    answer followed by another question (no last-answer rewriting there)."""
    question = [{"role": "user", "content": "u"}]
    answered = question + [{"role": "assistant", "content": SENTINEL}]
    base, probe = render(tokenizer, question, tools), render(tokenizer, answered + question, tools)
    last = render(tokenizer, answered, tools)
    if not probe.startswith(base) or SENTINEL not in probe[len(base):] or SENTINEL not in last:
        raise TemplateError(str(_rewrites(tokenizer)))
    header = probe[len(base):].split(SENTINEL)[0]
    end = last.split(SENTINEL)[-1]
    if not header or not end:
        raise TemplateError(str(_rewrites(tokenizer)))
    return header, end


def visible_answer(turn: dict) -> str:
    """The part of an assistant turn every template shows: its text after any reasoning block."""
    content = turn.get("content")
    if not isinstance(content, str):
        return ""
    return content.split("</think>")[-1].strip()


def encode_conversation(tokenizer, turns: list[dict], max_len: int, tools: list | None = None,
                        trained_from: int = 0) -> Example:
    """A conversation through the chat template, trained on exactly the tokens of its assistant
    turns (from `trained_from` on: a prompt-completion row's completion); system, user and tool
    turns are masked."""
    text, spans = assistant_spans(tokenizer, turns, tools, trained_from)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    labels = [token if any(lo <= start and end <= hi for lo, hi in spans) else IGNORE_INDEX
              for token, (start, end) in zip(ids, encoded["offset_mapping"])]
    return Example(ids[:max_len], labels[:max_len], len(ids) > max_len)


def encode_text(tokenizer, text: str, max_len: int) -> Example:
    """Plain language modeling: every token and the end token trained on."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return Example(ids[:max_len], ids[:max_len], len(ids) > max_len)


def row_tools(row: dict) -> list | None:
    tools = row.get("tools")
    return json.loads(tools) if isinstance(tools, str) else None


def encode_row(tokenizer, row: dict, max_len: int) -> Example:
    """An SFT row: a multi-turn row with its token ids and loss mask (the env's observation tokens are
    not trained on), a conversation (`messages`), conversational prompt + completion, plain text,
    or a text prompt (as the user's turn) + its completion (the assistant's answer)."""
    if "token_ids" in row and row.get("token_ids") is not None:
        return encode_ids([], list(row["token_ids"]), max_len, list(row["loss_mask"]))
    if row.get("messages") is not None:
        return encode_conversation(tokenizer, decoded(row["messages"]), max_len, row_tools(row))
    if row.get("text") is not None:
        return encode_text(tokenizer, row["text"], max_len)
    if row.get("conversational"):
        prompt = as_turns(row["prompt"], "user")
        return encode_conversation(tokenizer, prompt + as_turns(row["completion"], "assistant"), max_len,
                                   row_tools(row), len(prompt))
    return encode_example(tokenizer, row["prompt"], row["completion"], max_len)


def as_turns(value, role: str) -> list[dict]:
    """A stored prompt or answer as turns: a conversation as it is, plain text as one `role` turn."""
    value = decoded(value)
    return [{"role": role, "content": value}] if isinstance(value, str) else value


def prompt_ids(tokenizer, row: dict) -> list[int]:
    """A prompt-only row's prompt through the chat template, ready for the assistant's answer."""
    return tokenizer(render(tokenizer, as_turns(row["prompt"], "user"), row_tools(row), generation_prompt=True),
                     add_special_tokens=False)["input_ids"]


def preference_examples(tokenizer, row: dict, max_len: int) -> tuple[Example, Example]:
    """An imported preference row's chosen and rejected sides: the prompt's turns (masked) + each
    answer's assistant turns (trained on)."""
    return tuple(answer_example(tokenizer, row.get("prompt"), row[side], max_len, row_tools(row))
                 for side in ("chosen", "rejected"))


def answer_example(tokenizer, prompt, answer, max_len: int, tools: list | None = None) -> Example:
    """A prompt (text or turns; None: none) and an answer to it through the chat template, the
    answer's assistant turns trained on: one side of a pair, or what a reward model scores."""
    turns = as_turns(prompt, "user") if prompt is not None else []
    return encode_conversation(tokenizer, turns + as_turns(answer, "assistant"), max_len, tools, len(turns))


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
