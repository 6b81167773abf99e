"""TRL's dataset formats, and how a user's rows become the rows a stage trains on.

Formats (plain or conversational, as in TRL): language modeling (`text`, or `messages`),
prompt-completion (`prompt`, `completion`), preference (`prompt`, `chosen`, `rejected`; an
implicit prompt shared by conversational chosen/rejected is split off), prompt-only (`prompt` plus
any other columns, e.g. `answer`, which travel to reward functions), unpaired preference (`prompt`,
`completion`, `label`: true for a desirable completion, false for an undesirable one; TRL's KTO format).

In the store a conversation is a JSON text (a list of `{role, content, ...}` messages): one
column type whatever the turns carry (tool calls, names), readable by any Parquet reader.
"""

from __future__ import annotations

import json

FORMATS = ("text", "prompt_completion", "messages", "preference", "prompts", "unpaired")
NEEDS = {"text": ("text",), "prompt_completion": ("prompt", "completion"), "messages": ("messages",),
         "preference": ("chosen", "rejected"), "prompts": ("prompt",), "unpaired": ("prompt", "completion", "label")}
# what the spec's graph sees a dataset of each format as (tasks/config.py `produces`)
PRODUCES = {"text": "dataset", "prompt_completion": "dataset", "messages": "dataset",
            "preference": "preference dataset", "prompts": "prompts dataset",
            "unpaired": "unpaired preference dataset"}
DETECT_ORDER = ("preference", "unpaired", "messages", "prompt_completion", "text", "prompts")
ROLES = ("system", "user", "assistant", "tool")
CONVERSATIONAL = {"prompt_completion": ("prompt", "completion"), "messages": ("messages",),
                  "preference": ("prompt", "chosen", "rejected"), "prompts": ("prompt",), "text": (),
                  "unpaired": ("prompt", "completion")}


class FormatError(ValueError):
    """A row or a column set that fits no format; str() is one line."""


def detect(columns: list[str]) -> str | None:
    """The format the columns fit (preference before unpaired before messages before prompt-completion
    before text before prompt-only), or None."""
    return next((name for name in DETECT_ORDER if fits(name, columns)), None)


def fits(name: str, columns: list[str]) -> bool:
    return all(column in columns for column in NEEDS[name])


def no_format(columns: list[str]) -> str:
    """Why no format fits: the columns found and what each format needs."""
    needs = "; ".join(f"{name} needs {' and '.join(NEEDS[name])}" for name in FORMATS)
    return f"columns {', '.join(columns) or '(none)'} fit no format ({needs})"


def renamed(columns: list[str], mapping: dict[str, str]) -> list[str]:
    """The column names once `mapping` (ours <- theirs) is applied."""
    theirs = {their: our for our, their in mapping.items()}
    return [theirs.get(column, column) for column in columns]


def plain(value):
    """Nested numpy arrays and scalars (what Parquet and pandas give back) as Python lists and values."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


def message(raw, where: str) -> dict:
    """One turn as `{role, content[, tool_calls, name, tool_call_id]}`; text parts are joined."""
    if not isinstance(raw, dict) or "role" not in raw:
        raise FormatError(f"{where}: a message must be a mapping with a role (got {str(raw)[:60]!r})")
    content = raw.get("content")
    if isinstance(content, list):  # OpenAI content parts
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    turn = {"role": raw["role"], "content": "" if content is None else content}
    for key in ("tool_calls", "name", "tool_call_id"):
        if raw.get(key) is not None:
            turn[key] = raw[key]
    return turn


def conversation(value, where: str) -> list[dict] | None:
    """A list of messages as turns; None when `value` is plain text."""
    if isinstance(value, str):
        return None
    if not isinstance(value, list):
        raise FormatError(f"{where}: expected text or a list of messages (got {type(value).__name__})")
    return [message(item, f"{where}[{i}]") for i, item in enumerate(value)]


def split_implicit_prompt(chosen: list[dict], rejected: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """TRL's implicit prompt: the turns chosen and rejected share at the start become the prompt."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
        shared += 1
    return chosen[:shared], chosen[shared:], rejected[shared:]


def stored(value) -> str | None:
    return None if value is None else (value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))


def normalize(name: str, row: dict, number: int, tools: list | None = None) -> dict:
    """A source row (columns already renamed) as the stored row of format `name`: `id` (`row-<n>`,
    n the row's number in the source), the format's columns with conversations as JSON text,
    `conversational`, and (prompt-only) every other column as it was."""
    where = f"row {number}"
    out: dict = {"id": f"row-{number}", "row": number}
    turns = {column: conversation(row.get(column), f"{where}.{column}") if row.get(column) is not None else None
             for column in CONVERSATIONAL[name]}
    if name == "preference":
        if turns["prompt"] is None and isinstance(row.get("prompt"), str):
            out["prompt"] = row["prompt"]
        elif turns["prompt"] is None and turns["chosen"] is not None and turns["rejected"] is not None:
            turns["prompt"], turns["chosen"], turns["rejected"] = split_implicit_prompt(turns["chosen"],
                                                                                     turns["rejected"])
    for column in NEEDS[name] + (("prompt",) if name == "preference" else ()):
        if column not in out:
            out[column] = stored(turns[column]) if turns.get(column) is not None else row.get(column)
    out["conversational"] = any(value is not None for value in turns.values())
    row_tools = row.get("tools")
    if isinstance(row_tools, str):
        row_tools = json.loads(row_tools)
    out["tools"] = stored(row_tools if row_tools is not None else tools)
    if name == "prompts":
        out.update({column: value for column, value in row.items() if column not in out and column != "tools"})
    if name == "unpaired" and not isinstance(out["label"], bool):
        raise FormatError(f"{where}.label: must be true (desirable) or false (undesirable), got {out['label']!r}")
    return out


def decoded(value):
    """A stored conversational column back as turns (plain text stays text)."""
    if isinstance(value, str) and value.startswith("["):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def conversation_problems(turns, trained: bool) -> dict[str, int]:
    """What a conversation's data contract counts: unknown roles, empty turns, turns out of order
    (a system turn after the first, a user turn right after a user turn, an assistant turn not after
    a user or tool turn, a tool turn not after an assistant or tool turn), and for a conversation
    trained on (not a prompt): no assistant turn, a last turn that is not the assistant's."""
    problems = {"unknown_roles": 0, "empty_turns": 0, "turns_out_of_order": 0, "no_assistant_turn": 0,
                "not_ending_on_assistant": 0}
    if not isinstance(turns, list) or not turns:
        return {**problems, "empty_turns": 1}
    previous = None
    for index, turn in enumerate(turns):
        role = turn.get("role")
        problems["unknown_roles"] += role not in ROLES
        problems["empty_turns"] += not str(turn.get("content") or "").strip() and not turn.get("tool_calls")
        allowed = {"system": previous is None, "user": previous != "user",
                   "assistant": previous in ("user", "tool"), "tool": previous in ("assistant", "tool")}
        problems["turns_out_of_order"] += not allowed.get(role, True)
        previous = role
    problems["no_assistant_turn"] = int(trained and not any(turn.get("role") == "assistant" for turn in turns))
    problems["not_ending_on_assistant"] = int(trained and turns[-1].get("role") != "assistant")
    return problems
