"""Hermes / Qwen 2.5 / Qwen3 tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
one block per call, after the turn's text."""

from __future__ import annotations

import json

from envs.tools.calls import ParsedTurn, ToolCall, call_from_json
from envs.tools.parsers.base import ToolParser, parse_blocks

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def parse(text: str) -> ParsedTurn:
    return parse_blocks(text, OPEN, CLOSE, lambda payload: [call_from_json(payload, 0)])


def render(calls: list[ToolCall], content: str = "") -> str:
    """As Qwen3's template writes an assistant's `tool_calls`."""
    blocks = [f'{OPEN}\n{{"name": "{call.name}", "arguments": {json.dumps(call.arguments)}}}\n{CLOSE}'
              for call in calls]
    return "\n".join(([content] if content else []) + blocks)


PARSER = ToolParser("hermes", parse, render, vllm_parser="hermes")
