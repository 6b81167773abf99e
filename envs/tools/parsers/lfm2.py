"""LFM2 tool calls: `<|tool_call_start|>[name(arg=value, ...), ...]<|tool_call_end|>`, a Python list of
calls with literal keyword arguments (read with `ast`, never evaluated), or a JSON list of
`{"name", "arguments"}` objects (LFM2 writes JSON when its system prompt asks for it). LFM2's template
renders an assistant turn's content only, so a call is part of the content the model wrote."""

from __future__ import annotations

import ast
import json

from envs.tools.calls import MalformedCall, ParsedTurn, ToolCall, call_from_object
from envs.tools.parsers.base import ToolParser, parse_blocks

OPEN, CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"


def parse(text: str) -> ParsedTurn:
    return parse_blocks(text, OPEN, CLOSE, calls_of_block)


def calls_of_block(payload: str) -> list[ToolCall]:
    if payload.startswith(("[{", "{")):
        try:
            data = json.loads(payload)
        except json.JSONDecodeError as exc:
            raise MalformedCall(f"not JSON: {exc.msg} at char {exc.pos}") from None
        return [call_from_object(item, index) for index, item in enumerate(data if isinstance(data, list) else [data])]
    try:
        tree = ast.parse(payload, mode="eval").body
    except SyntaxError as exc:
        raise MalformedCall(f"not a Python list of calls: {exc.msg}") from None
    nodes = tree.elts if isinstance(tree, ast.List) else [tree]
    return [call_of_node(node, index) for index, node in enumerate(nodes)]


def call_of_node(node: ast.expr, index: int) -> ToolCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise MalformedCall("each entry must be a call name(arg=value, ...)")
    if node.args:
        raise MalformedCall(f"{node.func.id}: positional arguments; name each (arg=value)")
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise MalformedCall(f"{node.func.id}: **arguments are not literal")
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, SyntaxError):
            raise MalformedCall(f"{node.func.id}: argument {keyword.arg} is not a literal") from None
    return ToolCall(node.func.id, arguments, f"call_{index}")


def render(calls: list[ToolCall], content: str = "") -> str:
    """As LFM2 writes calls: Python literals (repr) for the values."""
    written = ", ".join(f"{call.name}({', '.join(f'{key}={value!r}' for key, value in call.arguments.items())})"
                        for call in calls)
    return content + f"{OPEN}[{written}]{CLOSE}"


PARSER = ToolParser("lfm2", parse, render, vllm_parser="lfm2", renders_tool_calls=False)
