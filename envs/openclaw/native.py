"""openclaw's workspace tools as schema tools (`tool_format: native`): the model is shown them by
its own chat template and calls them in its own format (envs/tools); each call runs the tag
format's tool (tools.py: the same sandboxed implementation) on the episode's workspace."""

from __future__ import annotations

from dataclasses import replace

from envs.base import Task
from envs.openclaw.tools import TOOL_ARGS, OpenClawEpisode, ToolError, parse_call, truncate
from envs.tools.calls import ToolCall, ToolFailed
from envs.tools.chat import ToolChat
from envs.tools.episode import ToolEpisode
from envs.tools.executor import check_arguments
from envs.tools.schema import ToolSpec

DESCRIPTIONS = {  # tool -> (what it does, {argument: what it holds}); the arguments are tools.TOOL_ARGS'
    "exec": ("Run a shell command in the workspace.", {"command": "The command line."}),
    "read": ("Read a workspace file.", {"path": "The file's path in the workspace."}),
    "write": ("Write a workspace file (replacing it).", {"path": "The file's path.", "content": "Its new text."}),
    "edit": ("Replace text that occurs exactly once in a workspace file.",
             {"path": "The file's path.", "old": "The text to replace.", "new": "Its replacement."}),
    "memory_search": ("Search MEMORY.md and memory/*.md by words.", {"query": "Words to look for."}),
    "memory_get": ("Read MEMORY.md or a memory/*.md file.", {"path": "The memory file's path."}),
    "web_search": ("Search the web.", {"query": "Words to look for."}),
    "web_fetch": ("Fetch a web page.", {"url": "The page's URL."}),
}


def tool_spec(name: str) -> ToolSpec:
    about, arguments = DESCRIPTIONS[name]
    properties = {key: {"type": "string", "description": arguments[key]} for key in TOOL_ARGS[name]}
    return ToolSpec(name, about, {"type": "object", "properties": properties, "required": list(TOOL_ARGS[name])})


SPECS = {name: tool_spec(name) for name in TOOL_ARGS}
SCHEMAS = [spec.openai() for spec in SPECS.values()]


class WorkspaceToolset:
    """The Toolset (envs/tools/executor.py) of one episode's workspace: a refused call, or an exec
    whose command failed, is a ToolFailed (the episode answers with an error turn and counts it)."""

    def __init__(self, workspace: OpenClawEpisode):
        self.workspace = workspace

    def specs(self) -> list[ToolSpec]:
        return list(SPECS.values())

    def call(self, call: ToolCall) -> str:
        if call.name not in SPECS:
            raise ToolFailed(f"unknown tool {call.name!r}; tools: {', '.join(SPECS)}")
        check_arguments(SPECS[call.name], call.arguments)
        if not all(isinstance(value, str) for value in call.arguments.values()):
            raise ToolFailed(f"{call.name}: every argument is a string")
        failed_before = self.workspace.tool_errors
        try:
            text = truncate(self.workspace.tools[call.name](**call.arguments))
        except ToolError as exc:
            raise ToolFailed(str(exc)) from None
        if self.workspace.tool_errors > failed_before:  # exec reports its command's failure as its output
            raise ToolFailed(text)
        return text


def native_episode(workspace: OpenClawEpisode, chat: ToolChat) -> ToolEpisode:
    """The episode in the model's format; graded on its final reply (never on a tool's output) and
    the workspace, as the tag format is."""
    def grade(transcript, final):
        return {"graded": workspace.graded(final.content if final is not None else "")}

    return ToolEpisode(WorkspaceToolset(workspace), chat, grade, close=workspace.sandbox.close)


def native_task(task: Task, tags_help: str) -> Task:
    """A task prompted without the tag format's help, its tools shown by the chat template instead."""
    return replace(task, prompt=task.prompt.removeprefix(tags_help + "\n"), info={**task.info, "tools": SCHEMAS})


def native_actions(chat: ToolChat, actions: list[str]) -> list[str]:
    """Tag-format oracle actions (calls, then the reply) in the model's own call format."""
    calls = [parse_call(action) for action in actions[:-1]]
    return [chat.action([ToolCall(call.pop("name"), call, f"call_{turn}")]) for turn, call in enumerate(calls)] \
        + actions[-1:]
