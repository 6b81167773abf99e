"""What a parser reads out of one assistant turn: its text and the tool calls it made."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    id: str = ""  # the OpenAI `tool_call_id` a `tool` reply names; parsers number them call_0, call_1...

    def openai(self) -> dict:
        """The OpenAI `tool_calls` entry (arguments as a JSON string, as the API sends them)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}

    def message(self) -> dict:
        """The entry as chat templates read it from an assistant message (arguments as an object)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class MalformedCall(Exception):
    """A tool call that cannot be read (bad JSON, no name, arguments not an object): one-line reason."""


class ToolFailed(Exception):
    """A tool that ran and failed (a bad argument, a missing file): its one-line message becomes an
    error `tool` turn the model reads; the episode goes on."""


@dataclass(frozen=True)
class ParsedTurn:
    content: str  # the turn's text with the calls taken out
    calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)  # one reason per call that could not be read


def call_from_json(payload: str, index: int) -> ToolCall:
    """A call from `{"name": ..., "arguments": {...}}` (also `parameters` for arguments, Llama 3's key);
    arguments given as a JSON string are decoded too."""
    try:
        data = json.loads(payload)
    except json.JSONDecodeError as exc:
        raise MalformedCall(f"not JSON: {exc.msg} at char {exc.pos}") from None
    return call_from_object(data, index)


def call_from_object(data, index: int) -> ToolCall:
    if not isinstance(data, dict):
        raise MalformedCall(f"a JSON object expected, got {type(data).__name__}")
    if isinstance(data.get("function"), dict):
        data = data["function"]
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise MalformedCall("the call names no function ('name' missing)")
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise MalformedCall(f"{name}: arguments are not JSON: {exc.msg}") from None
    if not isinstance(arguments, dict):
        raise MalformedCall(f"{name}: arguments must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(name, arguments, f"call_{index}")
