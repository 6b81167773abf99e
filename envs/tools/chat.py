"""How the policy's own chat template writes a tool episode: the prompt with its tools, the model's
calls (read back by the family's parser) and the `tool` turns that answer them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from envs.tools.calls import ToolCall
from envs.tools.parsers import ToolParser, family_of_template, parser_for

# where the assistant's own text would stand: what follows it in a rendering is the env's part
SENTINEL = "\x1fposttrain-assistant-turn\x1f"
Template = Callable[[list[dict], "list[dict] | None", bool], str]  # (messages, tools, add_generation_prompt) -> text


def speaks_tools(env) -> bool:
    """Whether an env writes and reads tool calls in the policy's own format (a kind from a package
    need not say: it does not)."""
    return getattr(env, "speaks_tools", False)


def use_policy_chat(env, tokenizer) -> None:
    """Give a tool-speaking env the policy's tokenizer: its oracle writes calls, and its episodes read
    the model's, in that chat template's format."""
    if tokenizer is not None and speaks_tools(env):
        env.use_chat(tokenizer)


@dataclass(frozen=True)
class ToolChat:
    parser: ToolParser
    template: Template
    end_of_turn: str  # the text of the token that ends an assistant turn (the model stops on it: not the env's)

    @classmethod
    def of(cls, tokenizer, family: str = "auto") -> ToolChat:
        """The chat of a tokenizer's template; `family` "auto": read from the template's text."""
        if not isinstance(tokenizer.chat_template, str):
            raise ValueError("the tokenizer has no chat template to render tools with")
        family = family_of_template(tokenizer.chat_template) if family == "auto" else family
        kwargs = dict(getattr(tokenizer, "posttrain_template_kwargs", {}))  # the spec's chat_template_kwargs

        def template(messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
            return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt, **kwargs)

        return cls(parser_for(family), template, tokenizer.eos_token or "")

    def prompt(self, messages: list[dict], tools: list[dict]) -> str:
        return self.template(messages, tools, True)

    def replies(self, tool_turns: list[dict]) -> str:
        """The template's text of `tool` turns after an assistant turn, through the next generation
        prompt, less the end token the model itself wrote: the observation of a turn of calls. Taken
        as what follows a placeholder assistant turn in one rendering, so a template that writes
        consecutive tool turns as one block (Qwen3's user turn of <tool_response>s) is honoured."""
        text = self.template([{"role": "user", "content": "-"}, {"role": "assistant", "content": SENTINEL},
                              *tool_turns], None, True)
        after = text[text.index(SENTINEL) + len(SENTINEL):]
        return after.removeprefix(self.end_of_turn) if self.end_of_turn else after

    def action(self, calls: list[ToolCall], content: str = "") -> str:
        """The text the model writes for these calls (an oracle's actions, SFT traces)."""
        return self.parser.render(calls, content)


def tool_turn(call_id: str, name: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


def task_tools(task) -> list[dict] | None:
    """The OpenAI tool schemas a task is prompted with (`Task.info["tools"]`), if it has any."""
    return task.info.get("tools") or None
