"""What a tool-call parser is: how one template family writes calls in an assistant turn."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from envs.tools.calls import MalformedCall, ParsedTurn, ToolCall


@dataclass(frozen=True)
class ToolParser:
    family: str  # the registry's name: hermes, lfm2, llama3
    parse: Callable[[str], ParsedTurn]  # one assistant turn's text -> its content and calls
    # the calls as the model writes them in its turn, after `content` (what a template that does not
    # render `tool_calls` itself is given as the assistant's content; oracle actions, SFT traces)
    render: Callable[[list[ToolCall], str], str]
    vllm_parser: str  # vLLM's `--tool-call-parser` for this family
    stop: tuple[str, ...] = ()  # strings that end a turn of calls besides the end token (none so far)
    renders_tool_calls: bool = True  # whether the family's templates render an assistant's `tool_calls`


def parse_blocks(text: str, open_tag: str, close_tag: str, read: Callable[[str], list[ToolCall]]) -> ParsedTurn:
    """A turn whose calls stand in `open_tag ... close_tag` blocks, each read by `read(payload)`;
    the calls are numbered call_0, call_1... across blocks, and a block cut off before its close tag
    (the token limit) is malformed."""
    block = re.compile(re.escape(open_tag) + r"(.*?)" + re.escape(close_tag), re.DOTALL)
    calls, malformed = [], []
    for match in block.finditer(text):
        try:
            calls += [ToolCall(call.name, call.arguments, f"call_{len(calls) + i}")
                      for i, call in enumerate(read(match.group(1).strip()))]
        except MalformedCall as exc:
            malformed.append(str(exc))
    content = block.sub("", text)
    if open_tag in content:
        content = content[:content.index(open_tag)]
        malformed.append(f"{open_tag} without {close_tag}")
    return ParsedTurn(content.strip(), calls, malformed)
