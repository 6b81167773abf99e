"""The fake's `/v1/chat/completions`, with vLLM's tool calling (vllm/entrypoints/openai/chat_completion:
protocol.py's tool checks, serving.py's answer; docs/features/tool_calling.md): the messages (an
assistant's `tool_calls`, their arguments decoded from JSON text as vLLM's chat_utils does, and `tool`
turns) and `tools` rendered by the checkpoint's chat template; under `--enable-auto-tool-choice
--tool-call-parser NAME` (`FakeVllmConfig.tool_call_parser`) an answer's calls come back as
`tool_calls` (finish_reason "tool_calls"), read by the project's parser of that vLLM name
(envs/tools/parsers, as vLLM's hermes / lfm2 / llama3_json parsers read them). Not modelled:
streaming, `required` and named tool choice (vLLM's guided decoding: a 501 here), reasoning parsers."""

from __future__ import annotations

import json
import uuid

from fake_vllm.protocol import VllmError, bad_request

CHAT_ONLY = ("messages", "tools", "tool_choice", "max_completion_tokens", "add_generation_prompt",
             "continue_final_message", "chat_template_kwargs", "parallel_tool_calls")
AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


def tool_parser(name: str | None):
    """The project's parser vLLM's `--tool-call-parser NAME` stands for (None: no auto tool choice)."""
    if name is None:
        return None
    from envs.tools.parsers import PARSERS

    by_vllm_name = {parser.vllm_parser: parser for parser in PARSERS.values()}
    if name not in by_vllm_name:
        raise ValueError(f"tool_call_parser {name!r}: the fake knows {', '.join(sorted(by_vllm_name))}")
    return by_vllm_name[name]


def tool_choice_of(body: dict, parser) -> str:
    """vLLM's defaulting and checks: "auto" when tools come without a choice, "none" without tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise bad_request("When using `tool_choice`, `tools` must be set.")
    if choice == "auto" and parser is None:
        raise bad_request(AUTO_NEEDS_FLAGS)
    if choice != "auto" and choice != "none":
        raise VllmError(501, "the fake vLLM server has no guided decoding (tool_choice required or named)",
                        "NotImplementedError")
    return choice


def template_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise bad_request("messages: a non-empty list of message objects expected", "messages")
    return [{**message, "tool_calls": [decoded(call) for call in message["tool_calls"]]}
            if message.get("tool_calls") else message for message in messages]


def decoded(call: dict) -> dict:
    function = call.get("function", {})
    arguments = function.get("arguments")
    return {**call, "function": {**function, "arguments": json.loads(arguments)}} if isinstance(arguments, str) \
        else call


def prompt_ids(tokenizer, body: dict) -> list[int]:
    """The rendered prompt's ids (vLLM renders tools even under tool_choice "none", without
    --exclude-tools-when-tool-choice-none)."""
    text = tokenizer.apply_chat_template(template_messages(body.get("messages")), tools=body.get("tools"),
                                         tokenize=False, add_generation_prompt=body.get("add_generation_prompt", True),
                                         **(body.get("chat_template_kwargs") or {}))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def completion_body(body: dict, prompt: list[int], max_model_len: int) -> dict:
    """The /v1/completions request the chat request decodes as (no max_tokens: the context left)."""
    budget = body.get("max_completion_tokens") or body.get("max_tokens") or max_model_len - len(prompt)
    return {**{k: v for k, v in body.items() if k not in CHAT_ONLY}, "prompt": prompt, "max_tokens": budget}


def message_of(text: str, finish_reason: str, parser, choice: str) -> tuple[dict, str]:
    """The assistant message vLLM answers: calls as `tool_calls` (arguments as JSON text, ids
    `chatcmpl-tool-...`), the text before them as content (None when empty)."""
    parsed = parser.parse(text) if parser is not None and choice == "auto" else None
    if parsed is None or not parsed.calls:
        return {"role": "assistant", "content": text, "tool_calls": [], "reasoning_content": None}, finish_reason
    calls = [{**call.openai(), "id": f"chatcmpl-tool-{uuid.uuid4().hex}"} for call in parsed.calls]
    return ({"role": "assistant", "content": parsed.content or None, "tool_calls": calls, "reasoning_content": None},
            "tool_calls" if finish_reason == "stop" else finish_reason)
