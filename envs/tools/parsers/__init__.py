"""Tool-call parsers, one module per chat-template family, chosen by name or by the template's text."""

from __future__ import annotations

from envs.tools.parsers import hermes, lfm2, llama3
from envs.tools.parsers.base import ToolParser

PARSERS: dict[str, ToolParser] = {parser.family: parser for parser in (hermes.PARSER, lfm2.PARSER, llama3.PARSER)}
ALIASES = {"qwen3": "hermes", "qwen2.5": "hermes", "llama3_json": "llama3"}
# a string only one family's template writes -> that family (checked in this order)
TEMPLATE_MARKS = (("<tool_call>", "hermes"), ("<|tool_call_start|>", "lfm2"), ("<|tool_list_start|>", "lfm2"),
                  ("<|python_tag|>", "llama3"), ("<|eom_id|>", "llama3"))


class UnknownToolFormat(ValueError):
    """No parser for a family name or a chat template (one line)."""


def parser_for(family: str) -> ToolParser:
    name = ALIASES.get(family, family)
    if name not in PARSERS:
        raise UnknownToolFormat(f"unknown tool-call family {family!r}; known: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]


def family_of_template(template_text: str) -> str:
    """The tool-call family a chat template writes (hermes for Qwen3, lfm2, llama3)."""
    for mark, family in TEMPLATE_MARKS:
        if mark in template_text:
            return family
    raise UnknownToolFormat(f"the chat template writes no known tool-call format; name its family: "
                            f"{' | '.join(sorted(PARSERS))}")


__all__ = ["PARSERS", "ToolParser", "UnknownToolFormat", "family_of_template", "parser_for"]
