"""Tool calling against the vLLM fake (tests/fake_vllm), as vLLM serves it under
--enable-auto-tool-choice --tool-call-parser hermes: /v1/chat/completions renders `tools`, an
assistant's `tool_calls` and `tool` turns with the checkpoint's template and answers calls as
`tool_calls`, read by the project's parser of that vLLM name; "auto" without the flags is a 400.
A tool env's rollout through the server backend (tasks/rollout/server_policy.py) needs none of it:
the prompt, tools included, is rendered here and sent as token ids to /v1/completions."""

import json

import openai
import pytest
from fake_vllm import FakeVllmConfig, running_fake
from fake_vllm.chat import AUTO_NEEDS_FLAGS, message_of, tool_parser
from test_tool_calls_serving import CALL, CONVERSATION, QUESTION, TOOLS

from envs.tools import ToolCall
from models.presets import materialize


def config(**fields) -> FakeVllmConfig:
    return FakeVllmConfig(materialize("tiny-llama"), "policy", max_model_len=512, **fields)


@pytest.fixture(scope="module")
def fake():
    with running_fake(config(tool_call_parser="hermes")) as (url, server):
        yield openai.OpenAI(base_url=url, api_key="none", max_retries=0), url, server


def test_tool_call_fake_vllm_renders_tools_and_tool_turns_with_the_checkpoints_template(fake):
    client, _, server = fake
    answer = client.chat.completions.create(model="policy", messages=CONVERSATION, tools=TOOLS, temperature=0,
                                            max_tokens=4, extra_body={"return_token_ids": True})
    turns = [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [CALL.message()]},
             {"role": "tool", "tool_call_id": CALL.id, "content": "5"}]
    tokenizer = server.tokenizer
    expected = tokenizer(tokenizer.apply_chat_template(turns, tools=TOOLS, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
    assert answer.model_extra["prompt_token_ids"] == expected and answer.usage.prompt_tokens == len(expected)
    assert '"arguments": {"a": 2, "b": 3}' in tokenizer.decode(expected)
    choice = answer.choices[0]
    assert (choice.finish_reason == "tool_calls") == bool(choice.message.tool_calls)


def test_tool_call_fake_vllm_answers_a_call_as_tool_calls():
    hermes = tool_parser("hermes")
    text = "Adding.\n" + hermes.render([ToolCall("add", {"a": 2, "b": 3})], "")
    message, finish = message_of(text, "stop", hermes, "auto")
    read = openai.types.chat.ChatCompletionMessage.model_validate(message)
    assert finish == "tool_calls" and read.content == "Adding."
    assert read.tool_calls[0].function.name == "add" and json.loads(read.tool_calls[0].function.arguments) == {
        "a": 2, "b": 3}
    assert message_of(text, "stop", hermes, "none")[0]["content"] == text  # tool_choice none: not parsed
    assert tool_parser("lfm2").family == "lfm2" and tool_parser("llama3_json").family == "llama3"


def test_tool_call_fake_vllm_refuses_auto_tool_choice_without_the_flags(fake):
    client, _, _ = fake
    with pytest.raises(openai.BadRequestError, match="`tools` must be set"):
        client.chat.completions.create(model="policy", messages=QUESTION, tool_choice="auto")
    with running_fake(config()) as (url, _):
        bare = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match=AUTO_NEEDS_FLAGS):
            bare.chat.completions.create(model="policy", messages=QUESTION, tools=TOOLS)
        assert bare.chat.completions.create(model="policy", messages=QUESTION, max_tokens=2).choices[0].message.role \
            == "assistant"


def test_tool_call_dataset_env_rolls_out_through_the_server_backend_on_the_fake(fake):
    from envs.dataset import DatasetEnv
    from envs.dataset.config import DatasetEnvConfig
    from models.sampling import SamplingParams, chat_prompt
    from tasks.rollout.episodes import roll_out
    from tasks.rollout.server_policy import ServerPolicy

    _, url, server = fake
    rewards = [{"function": "trl.rewards:think_format_reward"}]
    env = DatasetEnv(DatasetEnvConfig(kind="dataset", data="qa", rewards=rewards), "qa")
    env.use_rows([{"id": f"row-{i}", "prompt": f"{i}+3?", "tools": json.dumps(TOOLS)} for i in range(2)], [])
    tasks = env.tasks("train", 2, 0)
    before = len(server.requests)
    trajectories = roll_out(ServerPolicy(url, "policy", server.tokenizer, max_model_len=512), server.tokenizer, env,
                            tasks, SamplingParams(8))
    for task, trajectory in zip(tasks, trajectories):
        assert trajectory.prompt_ids == chat_prompt(server.tokenizer, task.prompt, TOOLS)
        assert "The first number." in server.tokenizer.decode(trajectory.prompt_ids)  # the tools, rendered here
    sent = sorted(length for request in server.requests[before:] for length in request["prompt_tokens"])
    assert sent == sorted(len(t.prompt_ids) for t in trajectories)  # as token ids to /v1/completions
