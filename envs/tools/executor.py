"""Where tool calls run: a `Toolset` lists its tools and answers one call with the text the model
reads in the `tool` turn. Python functions here; MCP servers implement the same protocol."""

from __future__ import annotations

import json
from typing import Callable, Protocol, Sequence

from envs.tools.calls import ToolCall, ToolFailed
from envs.tools.schema import ToolSpec, tool_from_function


class Toolset(Protocol):
    def specs(self) -> list[ToolSpec]:
        """The tools, as the model is shown them (their order is the prompt's)."""

    def call(self, call: ToolCall) -> str:
        """Run one call; its result as text. Raises ToolFailed (one line) for an unknown tool, bad
        arguments or a tool's own error: the episode answers it with an error `tool` turn."""


def check_arguments(spec: ToolSpec, arguments: dict) -> None:
    """Names only (types are the tool's to check): unknown arguments and missing required ones."""
    unknown = sorted(set(arguments) - set(spec.properties))
    if unknown:
        raise ToolFailed(f"{spec.name}: unknown argument(s) {', '.join(unknown)}; takes {', '.join(spec.properties)}")
    missing = [key for key in spec.required if key not in arguments]
    if missing:
        raise ToolFailed(f"{spec.name}: missing required argument(s) {', '.join(missing)}")


def as_text(result) -> str:
    return result if isinstance(result, str) else json.dumps(result, default=str)


class FunctionToolset:
    """Python callables as tools: each one's schema from its type hints and docstring."""

    def __init__(self, functions: Sequence[Callable]):
        self.functions = {fn.__name__: fn for fn in functions}
        self.by_name = {fn.__name__: tool_from_function(fn) for fn in functions}

    def specs(self) -> list[ToolSpec]:
        return list(self.by_name.values())

    def call(self, call: ToolCall) -> str:
        if call.name not in self.by_name:
            raise ToolFailed(f"unknown tool {call.name!r}; tools: {', '.join(self.by_name)}")
        check_arguments(self.by_name[call.name], call.arguments)
        try:
            return as_text(self.functions[call.name](**call.arguments))
        except ToolFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - a tool's error is the model's to read, not the episode's end
            raise ToolFailed(f"{call.name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
