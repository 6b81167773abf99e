"""serve-model speaks OpenAI's tool calling, as vLLM does with --enable-auto-tool-choice
--tool-call-parser hermes: `tools`, `tool_choice`, assistant `tool_calls` and `tool` messages in,
through the official `openai` client, rendered by the checkpoint's own chat template (the prompt's
token ids are exactly the template's); an answer's calls out as OpenAI `tool_calls`, read by the
same envs/tools parser the rollout uses. The model is the untrained tiny-llama preset (no training:
the server's rendering and answer building are what is checked, not the model's skill)."""

import json

import openai
import pytest
from test_serve_model import running_app

from envs.tools import ToolCall, tool_from_function
from envs.tools.parsers import parser_for

NAME = "t/tools@0123456789abcdef"
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


TOOLS = [tool_from_function(add).openai()]
CALL = ToolCall("add", {"a": 2, "b": 3}, "call_7")
CONVERSATION = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [CALL.openai()]},
                {"role": "tool", "tool_call_id": CALL.id, "content": "5"}]


@pytest.fixture(scope="module")
def served():
    """(the app's ServedModel, an openai client of it), serving with the hermes parser."""
    from models.presets import materialize
    from models.serving.app import make_app

    app = make_app(materialize("tiny-llama"), NAME, tool_parser=parser_for("hermes"))
    with running_app(app) as url:
        yield app.state.served, openai.OpenAI(base_url=url, api_key="none", max_retries=0)


def test_tool_call_messages_are_rendered_by_the_checkpoints_template(served):
    model, client = served
    answer = client.chat.completions.create(model=NAME, messages=CONVERSATION, tools=TOOLS, tool_choice="auto",
                                            temperature=0, max_tokens=4, extra_body={"return_token_ids": True})
    # the template sees the call's arguments as an object (OpenAI sends them as JSON text) and the tool turn
    turns = [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [CALL.message()]},
             {"role": "tool", "tool_call_id": CALL.id, "content": "5"}]
    expected = model.tokenizer(model.tokenizer.apply_chat_template(turns, tools=TOOLS, tokenize=False,
                                                                   add_generation_prompt=True),
                               add_special_tokens=False)["input_ids"]
    assert answer.model_extra["prompt_token_ids"] == expected and answer.usage.prompt_tokens == len(expected)
    rendered = model.tokenizer.decode(expected)
    assert '"name": "add"' in rendered and '"arguments": {"a": 2, "b": 3}' in rendered
    assert "The first number." in rendered
    # tool_choice "none" hides the tools from the template, as OpenAI's API does
    hidden = client.chat.completions.create(model=NAME, messages=CONVERSATION, tools=TOOLS, tool_choice="none",
                                            max_tokens=1, extra_body={"return_token_ids": True})
    assert "The first number." not in model.tokenizer.decode(hidden.model_extra["prompt_token_ids"])


def test_tool_call_in_an_answer_becomes_openai_tool_calls(served):
    from openai.types.chat import ChatCompletionMessage

    from models.serving.requests import ChatRequest

    model, _ = served
    with_tools = ChatRequest.model_validate({"model": NAME, "messages": QUESTION, "tools": TOOLS})
    text = "Let me add.\n" + parser_for("hermes").render([ToolCall("add", {"a": 2, "b": 3})], "")
    message, finish = model.message(with_tools, text, "stop")
    read = ChatCompletionMessage.model_validate(message)  # as the openai client reads it
    [call] = read.tool_calls
    assert finish == "tool_calls" and read.content == "Let me add."
    assert call.type == "function" and call.function.name == "add" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    # no tools offered: the same text stays text; a reply without a call is the model's text
    plain = ChatRequest.model_validate({"model": NAME, "messages": QUESTION})
    assert model.message(plain, text, "stop") == ({"role": "assistant", "content": text}, "stop")
    assert model.message(with_tools, "5", "stop") == ({"role": "assistant", "content": "5"}, "stop")


def test_tool_call_answer_of_the_served_model_goes_through_the_parser(served):
    model, client = served
    answer = client.chat.completions.create(model=NAME, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=12,
                                            extra_body={"return_token_ids": True})
    choice = answer.choices[0]
    text = model.tokenizer.decode(choice.model_extra["token_ids"], skip_special_tokens=True)
    calls = parser_for("hermes").parse(text).calls
    assert (choice.finish_reason == "tool_calls") == bool(calls)
    assert [call.function.name for call in choice.message.tool_calls or []] == [call.name for call in calls]


def test_tool_call_requests_refused_in_one_line(served):
    from models.presets import materialize
    from models.serving.app import make_app

    _, client = served
    with pytest.raises(openai.BadRequestError, match="a tool message needs content"):
        client.chat.completions.create(model=NAME, messages=[*QUESTION, {"role": "tool", "tool_call_id": "x"}])
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        client.chat.completions.create(model=NAME, messages=QUESTION, tool_choice="auto")
    with pytest.raises(openai.BadRequestError, match="stream: tool calls are not streamed"):
        client.chat.completions.create(model=NAME, messages=QUESTION, tools=TOOLS, stream=True)
    with running_app(make_app(materialize("tiny-llama"), NAME)) as url:
        bare = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="needs serve-model started with --enable-auto-tool-choice"):
            bare.chat.completions.create(model=NAME, messages=QUESTION, tools=TOOLS, tool_choice="auto")
