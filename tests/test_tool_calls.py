"""Tools in the model's own format (envs/tools): the real Qwen3 and LFM2 chat templates
(tests/data/chat_templates) render the tools and an assistant's calls, and the family's parser reads
those calls back; a tool episode answers with the template's `tool` turns, counts malformed calls
and failing tools (an error turn, never a crash) and trains on the assistant's tokens only."""

import json
from pathlib import Path

import pytest

from envs.base import EnvBase, Rubric, Task
from envs.tools import FunctionToolset, ToolCall, ToolSchemaError, tool_from_function, tool_from_schema
from envs.tools.chat import ToolChat, tool_turn
from envs.tools.episode import ToolEpisode
from envs.tools.parsers import UnknownToolFormat, family_of_template, parser_for
from models.loading import load_tokenizer
from models.presets import materialize
from models.sampling import SamplingParams, chat_prompt
from tasks.rollout.episodes import ScriptedPolicy, roll_out

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


CALL = ToolCall("add", {"a": 2, "b": 3}, "call_0")


def tokenizer_with(template: str):
    """tiny-llama's tokenizer under a production template, its end token the template's `<|im_end|>`."""
    tokenizer = load_tokenizer(materialize("tiny-llama"))
    tokenizer.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    tokenizer.add_special_tokens({"eos_token": "<|im_end|>"})
    return tokenizer


def test_tool_call_schema_comes_from_a_function_or_a_json_schema():
    spec = tool_from_function(add)
    assert spec.openai() == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "The first number."},
                                                        "b": {"type": "integer", "description": "The second number."}},
                       "required": ["a", "b"]}}}
    assert tool_from_schema(spec.openai()) == spec == tool_from_schema(spec.openai()["function"])


@pytest.mark.parametrize("schema, message", [
    ({"type": "function", "function": {"description": "x"}}, "tool.function.name: a non-empty string expected"),
    ({"type": "tool", "function": {"name": "f"}}, "tool.type: 'function' expected, got 'tool'"),
    ({"name": "f", "parameters": {"type": "string"}}, "tool f: function.parameters: a JSON schema of type 'object'"),
    ({"name": "f", "parameters": {"type": "object", "properties": {}, "required": ["x"]}},
     "tool f: function.parameters.required: names not among its properties"),
])
def test_tool_call_schema_errors_name_the_field(schema, message):
    with pytest.raises(ToolSchemaError, match=message.replace("(", r"\(")):
        tool_from_schema(schema)


def test_tool_call_schema_of_an_undocumented_function_is_one_line():
    def bare(x: int):
        return x

    with pytest.raises(ToolSchemaError, match="^tool bare: ") as error:
        tool_from_function(bare)
    assert "\n" not in str(error.value)


def test_tool_call_family_is_read_from_the_template():
    assert family_of_template((TEMPLATES / "qwen3.jinja").read_text()) == "hermes"
    assert family_of_template((TEMPLATES / "lfm2.jinja").read_text()) == "lfm2"
    with pytest.raises(UnknownToolFormat, match="writes no known tool-call format"):
        family_of_template(load_tokenizer(materialize("tiny-llama")).chat_template)
    with pytest.raises(UnknownToolFormat, match="unknown tool-call family 'mistral'; known: hermes, lfm2, llama3"):
        parser_for("mistral")


def test_tool_call_qwen3_template_renders_tools_and_its_calls_parse_back():
    tokenizer = tokenizer_with("qwen3")
    chat = ToolChat.of(tokenizer)
    tools = [tool_from_function(add).openai()]
    prompt = chat.prompt([{"role": "user", "content": "2+3?"}], tools)
    assert json.dumps(tools[0]) in prompt and "<tools>" in prompt  # the schema as the template shows it
    head = chat.prompt([{"role": "user", "content": "2+3?"}], tools)
    whole = chat.template([{"role": "user", "content": "2+3?"},
                           {"role": "assistant", "content": "", "tool_calls": [CALL.message()]}], tools, False)
    written = whole[len(head):].removesuffix("<|im_end|>\n")
    written = written.split("</think>\n\n")[-1]  # Qwen3 gives the last answer an empty think block
    assert written == chat.action([CALL])  # the parser writes calls as the template does
    assert chat.parser.parse(written).calls == [CALL]


def test_tool_call_lfm2_template_renders_tools_and_its_calls_parse_back():
    tokenizer = tokenizer_with("lfm2")
    chat = ToolChat.of(tokenizer)
    tools = [tool_from_function(add).openai(), tool_from_function(divide).openai()]
    prompt = chat.prompt([{"role": "user", "content": "2+3?"}], tools)
    assert prompt.startswith(f"<s><|im_start|>system\nList of tools: <|tool_list_start|>[{json.dumps(tools[0])}")
    action = chat.action([CALL, ToolCall("divide", {"a": 1.5, "b": -2}, "call_1")], "Let me compute.")
    whole = chat.template([{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": action}], tools, False)
    assert "<|tool_call_start|>[add(a=2, b=3), divide(a=1.5, b=-2)]<|tool_call_end|>" in whole
    parsed = chat.parser.parse(action)
    assert parsed.content == "Let me compute." and parsed.malformed == []
    assert parsed.calls == [CALL, ToolCall("divide", {"a": 1.5, "b": -2}, "call_1")]
    assert chat.replies([tool_turn("call_0", "add", "5")]) == \
        "\n<|im_start|>tool\n<|tool_response_start|>5<|tool_response_end|><|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("family, text, reason", [
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1</tool_call>', "not JSON"),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>', "the call names no function"),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": [1]}', "<tool_call> without </tool_call>"),
    ("lfm2", "<|tool_call_start|>[add(1, 2)]<|tool_call_end|>", "add: positional arguments"),
    ("lfm2", "<|tool_call_start|>[add(a=open('x'))]<|tool_call_end|>", "add: argument a is not a literal"),
    ("lfm2", "<|tool_call_start|>[add(a=1]<|tool_call_end|>", "not a Python list of calls"),
    ("llama3", '{"name": "add", "parameters": {"a": 1}; {"name"', "not JSON"),
])
def test_tool_call_parsers_report_malformed_calls_without_raising(family, text, reason):
    parsed = parser_for(family).parse(text)
    assert parsed.calls == [] or family == "llama3"
    assert len(parsed.malformed) == 1 and parsed.malformed[0].startswith(reason)


def test_tool_call_llama3_json_calls_parse():
    parsed = parser_for("llama3").parse('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                                        '{"name": "divide", "parameters": {"a": 1, "b": 2}}')
    assert [call.name for call in parsed.calls] == ["add", "divide"] and parsed.malformed == []
    assert parser_for("llama3").parse("The answer is 3.").calls == []


class AddEnv(EnvBase):
    """A two-tool env for the episode tests: the answer is the sum; its tools run as Python functions."""

    name, max_turns = "add", 4

    def __init__(self, tokenizer):
        self.chat = ToolChat.of(tokenizer)
        self.toolset = FunctionToolset([add, divide])
        self.rubric = Rubric([])

    def start(self, task, llm=None):
        return ToolEpisode(self.toolset, self.chat, grade=lambda transcript, final: {"answered": float(
            final is not None and final.content == task.answer)})

    def task(self) -> Task:
        return Task("t", "What is 2 + 3? Use the tools.", "5",
                    {"tools": [spec.openai() for spec in self.toolset.specs()]})


def test_tool_call_malformed_and_failing_calls_are_counted_and_answered_with_error_turns():
    env = AddEnv(tokenizer_with("qwen3"))
    episode = env.start(env.task())
    turn = episode.step('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
                        '<tool_call>\n{"name": "divide", "arguments": {"a": 1, "b": 0}}\n</tool_call>\n'
                        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "c": 3}}\n</tool_call>\n'
                        '<tool_call>\n{"name": "add", "arguments": {"a": 2,}}\n</tool_call>')
    assert not turn.done
    responses = turn.observation.split("<tool_response>\n")[1:]
    assert [response.split("\n</tool_response>")[0] for response in responses] == [
        "5", "error: divide: ZeroDivisionError: division by zero",
        "error: add: unknown argument(s) c; takes a, b",
        "error: malformed tool call: not JSON: Expecting property name enclosed in double quotes at char 37"]
    assert episode.step("5").done
    assert episode.finish() == {"answered": 1.0, "tool_calls": 3.0, "malformed_calls": 1.0, "tool_errors": 2.0,
                                "replied": 1.0}


@pytest.mark.parametrize("template", ["qwen3", "lfm2"])
def test_tool_call_episode_trains_only_the_assistant_tokens_of_the_templates_conversation(template):
    """Played through the rollout loop, the context of the second turn is exactly the template's
    rendering of the conversation so far (tools, the assistant's call, the tool's reply, the next
    generation prompt), and only the assistant's tokens carry the loss."""
    tokenizer = tokenizer_with(template)
    env = AddEnv(tokenizer)
    task = env.task()
    actions = [env.chat.action([CALL]), "5"]
    [trajectory] = roll_out(ScriptedPolicy(tokenizer, [actions]), tokenizer, env, [task], SamplingParams(64))
    assert trajectory.finished and trajectory.outcome["answered"] == 1.0 and trajectory.outcome["tool_calls"] == 1.0
    messages = [{"role": "user", "content": task.prompt},
                {"role": "assistant", "content": "" if template == "qwen3" else actions[0],
                 "tool_calls": [CALL.message()] if template == "qwen3" else None},
                tool_turn("call_0", "add", "5")]
    rendered = env.chat.template(messages, task.info["tools"], True)
    assert tokenizer.decode(trajectory.turns[1].context_ids) == rendered
    assert trajectory.prompt_ids == chat_prompt(tokenizer, task.prompt, task.info["tools"])
    ids, mask = trajectory.completion()
    trained = tokenizer.decode([token for token, keep in zip(ids, mask) if keep])
    assert trained == actions[0] + "<|im_end|>" + "5<|im_end|>"
    untrained = tokenizer.decode([token for token, keep in zip(ids, mask) if not keep])
    assert untrained == env.chat.replies([tool_turn("call_0", "add", "5")])


def test_tool_call_dataset_env_prompts_each_row_with_its_tools_column():
    from envs.dataset import DatasetEnv
    from envs.dataset.config import DatasetEnvConfig

    env = DatasetEnv(DatasetEnvConfig(kind="dataset", data="qa", rewards=[{"function": "trl.rewards:think_format_reward"}]),
                     "qa")
    tools = json.dumps([tool_from_function(add).openai()["function"]])  # TRL's column: schemas, stored as JSON text
    env.use_rows([{"id": "row-0", "prompt": "2+3?", "tools": tools}, {"id": "row-1", "prompt": "hi", "tools": None}],
                 [])
    with_tools, without = env.rows["train"]
    assert with_tools.info["tools"] == [tool_from_function(add).openai()] and "tools" not in without.info
    tokenizer = tokenizer_with("qwen3")
    assert json.dumps(with_tools.info["tools"][0]) in tokenizer.decode(
        chat_prompt(tokenizer, with_tools.prompt, with_tools.info["tools"]))
    with pytest.raises(ValueError, match="^env qa: row row-2: tools: tool.function.name: a non-empty string expected$"):
        env.use_rows([{"id": "row-2", "prompt": "x", "tools": '[{"description": "no name"}]'}])
