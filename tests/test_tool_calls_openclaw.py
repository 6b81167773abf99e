"""openclaw with `tool_format: native`: its workspace tools as schema tools, shown by the model's own
chat template (the real Qwen3 and LFM2 templates), called in the model's own format and run by the
same sandboxed tools as the tag format; the oracle, rendered in that format, plays every task to full
reward; a malformed call or a failing tool is answered with an error turn and counted."""

import re

import pytest
from test_tool_calls import tokenizer_with

from envs.openclaw.env import TOOLS_HELP, OpenClawEnv, OpenClawEnvConfig
from envs.tools import ToolCall
from envs.tools.chat import task_tools
from models.sampling import chat_prompt
from tasks.rollout.env_check import check_env


def native_env(**fields) -> OpenClawEnv:
    return OpenClawEnv(OpenClawEnvConfig(kind="openclaw", tool_format="native", **fields))


def lfm2_tokenizer():
    """LFM2's template, its call markers special tokens, as in LFM2's own tokenizer (the rollout must
    not skip them when it decodes an action)."""
    tokenizer = tokenizer_with("lfm2")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool_call_start|>", "<|tool_call_end|>"]})
    return tokenizer


@pytest.mark.parametrize("template, opens", [("qwen3", "<tool_call>"), ("lfm2", "<|tool_call_start|>"),
                                             ("lfm2-special", "<|tool_call_start|>")])
def test_tool_call_openclaw_native_oracle_plays_every_task_to_full_reward(template, opens):
    env, tokenizer = native_env(), lfm2_tokenizer() if template == "lfm2-special" else tokenizer_with(template)
    rows = check_env(env, tokenizer)  # gives the env the tokenizer's format (use_chat), as a stage does
    assert len(rows) >= 15 and all(row.ok for row in rows), [row for row in rows if not row.ok]
    task = env.all_tasks()[0]
    prompt = tokenizer.decode(chat_prompt(tokenizer, task.prompt, task_tools(task)))
    assert TOOLS_HELP not in prompt and '"name": "memory_search"' in prompt and "<tool>" not in prompt
    actions = env.oracle_actions(task)
    assert actions[0].startswith(opens) and "<tool>" not in "".join(actions)
    assert env.speaks_tools and env.action_stop == ()


def test_tool_call_openclaw_native_malformed_and_failing_calls_get_error_turns_and_are_counted():
    env = native_env()
    env.use_chat(tokenizer_with("qwen3"))
    task = next(task for task in env.all_tasks() if task.id == "edit_debug")
    episode = env.start(task)
    call = env.chat.action
    try:
        wrote = episode.step(call([ToolCall("write", {"path": "memory/a.md", "content": "- port is 8080\n"})]))
        assert "<tool_response>\nwrote 15 bytes to memory/a.md\n</tool_response>" in wrote.observation
        for broken, error in (('<tool_call>\n{"name": "read", "arguments": {"path": }\n</tool_call>', "malformed"),
                              (call([ToolCall("rm", {"path": "x"})]), "unknown tool 'rm'"),
                              (call([ToolCall("read", {"path": 3})]), "every argument is a string"),
                              (call([ToolCall("read", {})]), "missing required argument(s) path"),
                              (call([ToolCall("read", {"path": "../../etc/passwd"})]), "outside the workspace"),
                              (call([ToolCall("exec", {"command": "false"})]), "error: ")):
            turn = episode.step(broken)
            assert not turn.done and "<tool_response>\nerror: " in turn.observation and error in turn.observation
        searched = episode.step(call([ToolCall("memory_search", {"query": "port"})]))
        assert "memory/a.md:1: - port is 8080" in searched.observation
        assert episode.step("All done.").done
    finally:
        outcome = episode.finish()
    assert outcome == {"graded": 0.0, "tool_calls": 7.0, "malformed_calls": 1.0, "tool_errors": 5.0, "replied": 1.0}
    assert not env.is_formatted("", task, outcome)


def test_tool_call_openclaw_native_needs_a_template_family_or_tool_parser():
    from models.loading import load_tokenizer
    from models.presets import materialize

    tiny = load_tokenizer(materialize("tiny-llama"))  # its template writes no known tool-call format
    message = "env openclaw: tool_parser: the chat template writes no known tool-call format; name its family: " \
              "hermes | lfm2 | llama3"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        native_env().use_chat(tiny)
    with pytest.raises(RuntimeError, match="no tool-call format"):
        native_env().oracle_actions(native_env().all_tasks()[0])
    named = native_env(tool_parser="hermes")
    named.use_chat(tiny)
    assert named.oracle_actions(named.all_tasks()[0])[0].startswith("<tool_call>\n")


def test_tool_call_openclaw_tag_format_is_unchanged():
    tags = OpenClawEnv(OpenClawEnvConfig(kind="openclaw"))
    assert not tags.speaks_tools and tags.action_stop == ("</tool>",)
    task = tags.all_tasks()[0]
    assert task.prompt.startswith(TOOLS_HELP) and task_tools(task) is None
    assert tags.oracle_actions(task)[0].startswith("<tool>{")
