"""A tool as the OpenAI tool-calling format states it: a name, a description and a JSON schema of
its arguments; made from a Python function (type hints + Google docstring, as transformers'
`get_json_schema` reads them) or from a JSON schema written by hand (TRL's `tools` column)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


class ToolSchemaError(ValueError):
    """A tool schema that cannot be used: the message is one line naming the field."""


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    def openai(self) -> dict:
        """The OpenAI shape, what `apply_chat_template(tools=...)` and `/v1/chat/completions` take."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    @property
    def required(self) -> list[str]:
        return list(self.parameters.get("required", []))

    @property
    def properties(self) -> dict:
        return dict(self.parameters.get("properties", {}))


def tool_from_function(fn: Callable) -> ToolSpec:
    """The spec of a Python function: every argument type-hinted and described in its docstring."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    try:
        schema = get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException) as exc:
        name = getattr(fn, "__name__", repr(fn))
        raise ToolSchemaError(f"tool {name}: {str(exc).splitlines()[0]}") from None
    return tool_from_schema(schema)


def tool_from_schema(schema: dict) -> ToolSpec:
    """The spec of an OpenAI tool schema, `{"type": "function", "function": {...}}`, or of its bare
    `function` part `{"name", "description", "parameters"}`."""
    if not isinstance(schema, dict):
        raise ToolSchemaError(f"tool: a JSON object expected, got {type(schema).__name__}")
    if "function" in schema or "type" in schema:
        if schema.get("type") != "function":
            raise ToolSchemaError(f"tool.type: 'function' expected, got {schema.get('type')!r}")
        schema = schema.get("function")
        if not isinstance(schema, dict):
            raise ToolSchemaError("tool.function: a JSON object expected")
    name = schema.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ToolSchemaError("tool.function.name: a non-empty string expected")
    description = schema.get("description", "")
    if not isinstance(description, str):
        raise ToolSchemaError(f"tool {name}: function.description: a string expected")
    parameters = schema.get("parameters", {"type": "object", "properties": {}})
    check_parameters(name, parameters)
    return ToolSpec(name, description, parameters)


def check_parameters(name: str, parameters) -> None:
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise ToolSchemaError(f"tool {name}: function.parameters: a JSON schema of type 'object' expected")
    properties = parameters.get("properties", {})
    if not isinstance(properties, dict):
        raise ToolSchemaError(f"tool {name}: function.parameters.properties: a JSON object expected")
    required = parameters.get("required", [])
    if not isinstance(required, list) or any(key not in properties for key in required):
        raise ToolSchemaError(f"tool {name}: function.parameters.required: names not among its properties")
