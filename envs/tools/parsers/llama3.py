"""Llama 3.1+ JSON tool calls: the whole turn is `{"name": ..., "parameters": {...}}` (several joined by
`;`), optionally after `<|python_tag|>`; a turn that is not such JSON is plain text."""

from __future__ import annotations

import json

from envs.tools.calls import MalformedCall, ParsedTurn, ToolCall, call_from_json
from envs.tools.parsers.base import ToolParser

PYTHON_TAG = "<|python_tag|>"


def parse(text: str) -> ParsedTurn:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    elif not body.startswith("{"):
        return ParsedTurn(text.strip())
    calls, malformed = [], []
    for payload in split_calls(body):
        try:
            calls.append(call_from_json(payload, len(calls)))
        except MalformedCall as exc:
            malformed.append(str(exc))
    return ParsedTurn("", calls, malformed)


def split_calls(body: str) -> list[str]:
    """The JSON objects of `{...}; {...}` (a `;` inside a string stays)."""
    decoder, payloads, position = json.JSONDecoder(), [], 0
    while position < len(body):
        try:
            _, end = decoder.raw_decode(body, position)
        except json.JSONDecodeError:
            return payloads + [body[position:]]  # reported malformed by the caller's json.loads
        payloads.append(body[position:end])
        position = end
        while position < len(body) and body[position] in "; \n\t":
            position += 1
    return payloads


def render(calls: list[ToolCall], content: str = "") -> str:
    return "; ".join(json.dumps({"name": call.name, "parameters": call.arguments}) for call in calls)


PARSER = ToolParser("llama3", parse, render, vllm_parser="llama3_json")
