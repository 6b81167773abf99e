"""Tools in the OpenAI tool-calling format, rendered by the model's own chat template.

The interface (other modules, the `mcp` env kind included, build on these names; keep them stable):

- `schema.ToolSpec(name, description, parameters)`: one tool; `.openai()` is
  `{"type": "function", "function": {"name", "description", "parameters"}}`, what
  `apply_chat_template(tools=[...])` and `/v1/chat/completions` take. `tool_from_function(fn)` (type
  hints + Google docstring, via transformers' `get_json_schema`), `tool_from_schema(dict)` (the OpenAI
  shape or its bare `function` part); both raise `ToolSchemaError` with one line naming the field.
- `calls.ToolCall(name, arguments: dict, id)`; `calls.ParsedTurn(content, calls, malformed)`: one
  assistant turn read by a parser (`malformed`: one reason per call it could not read);
  `calls.MalformedCall` (a parser's one-line reason); `calls.ToolFailed` (a tool's one-line error).
- `parsers.parser_for(family)` -> `ToolParser(family, parse(text) -> ParsedTurn, render(calls, content)
  -> text, vllm_parser, stop, renders_tool_calls)`; families: hermes (Qwen3, Hermes: `<tool_call>{json}
  </tool_call>`), lfm2 (`<|tool_call_start|>[f(a=1)]<|tool_call_end|>`), llama3 (`{"name", "parameters"}`).
  `parsers.family_of_template(chat_template_text)` -> the family name.
- `executor.Toolset` (Protocol): `specs() -> list[ToolSpec]`; `call(ToolCall) -> str`, raising
  `ToolFailed` for an unknown tool, bad arguments or the tool's own error (the episode answers with an
  error `tool` turn and counts it). `executor.FunctionToolset(functions)`: Python callables.
- `episode.ToolEpisode`: an `Episode` over a Toolset that parses each action with the family's parser,
  runs the calls and answers with the template's rendering of the `tool` turns (see its docstring).
"""

from envs.tools.calls import MalformedCall, ParsedTurn, ToolCall, ToolFailed
from envs.tools.executor import FunctionToolset, Toolset
from envs.tools.schema import ToolSchemaError, ToolSpec, tool_from_function, tool_from_schema

__all__ = ["FunctionToolset", "MalformedCall", "ParsedTurn", "ToolCall", "ToolFailed", "ToolSchemaError",
           "ToolSpec", "Toolset", "tool_from_function", "tool_from_schema"]
