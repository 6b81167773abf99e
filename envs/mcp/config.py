"""The `mcp` env's config: the server (a stdio command, started per episode or kept and shared, or a
streamable HTTP URL), the task rows (as the `dataset` env's: envs/dataset/config.py `TaskRows`) and
how a task's success is checked (the answer, a TRL-style function, or a grader tool of the server)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from envs.dataset.config import RewardConfig, TaskRows
from envs.sandbox.launch import SandboxLimits


class StdioServer(BaseModel):
    """A server the env starts as `command` and speaks to over its stdin and stdout. `episode`: a
    fresh server per episode (its state is new every time); `shared`: servers are kept and reused,
    one episode at a time each (as many as episodes run at once), and `reset_tool` is called before
    every episode but a server's first. `sandbox: true` runs it under the project's bwrap + seccomp
    sandbox (envs/mcp/sandboxed.py) with `sandbox_limits` on its processes."""

    model_config = ConfigDict(extra="forbid")

    command: list[str] = Field(min_length=1)  # a file argument's relative path: against the spec's folder
    lifetime: Literal["episode", "shared"] = "episode"
    sandbox: bool = False
    sandbox_limits: SandboxLimits = SandboxLimits(memory_mb=2048, processes=64)  # a Python server's threads

    @property
    def shown(self) -> str:
        return " ".join(self.command)


class HttpServer(BaseModel):
    """A server already running behind a streamable HTTP URL (`http://127.0.0.1:8765/mcp`): each
    episode opens its own MCP session. Episodes run at once share the server, so its state must be
    per session or left alone by the tasks; `reset_tool` is called at each episode's start."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(pattern=r"^https?://\S+$")

    @property
    def shown(self) -> str:
        return re.sub(r"//[^/@]*@", "//", self.url)  # no credentials in logs


def server_kind(value) -> str | None:
    keys = value if isinstance(value, dict) else vars(value)
    return "stdio" if "command" in keys else "http" if "url" in keys else None


Server = Annotated[Annotated[StdioServer, Tag("stdio")] | Annotated[HttpServer, Tag("http")],
                   Discriminator(server_kind, custom_error_type="server_kind",
                                 custom_error_message="a server is a `command:` list (stdio) "
                                                      "or a `url:` (streamable HTTP)")]


class AnswerCheck(BaseModel):
    """The model's last message (its text, tool calls taken out) against the row's `answer` column:
    `exact` as written, `normalized` case, spaces and end punctuation aside."""

    model_config = ConfigDict(extra="forbid")

    answer: Literal["exact", "normalized"]


class GraderCheck(BaseModel):
    """A tool of the server (hidden from the model) called after the episode's last turn, with the
    row's `grader_arguments` column (an object; none: no argument): its text, normalized, against the
    row's `answer` column. What the episode did to the server's state is checked, not what it said."""

    model_config = ConfigDict(extra="forbid")

    grader: str = Field(min_length=1)


def check_kind(value) -> str | None:
    keys = value if isinstance(value, dict) else vars(value)
    return next((tag for key, tag in (("answer", "answer"), ("grader", "grader"), ("function", "function"))
                 if key in keys), None)


Check = Annotated[Annotated[AnswerCheck, Tag("answer")] | Annotated[GraderCheck, Tag("grader")]
                  | Annotated[RewardConfig, Tag("function")],
                  Discriminator(check_kind, custom_error_type="check_kind",
                                custom_error_message="a check is `answer: exact|normalized`, `grader: TOOL` "
                                                     "or `function: module:function`")]


class McpEnvConfig(TaskRows):
    kind: Literal["mcp"]
    server: Server
    check: Check = AnswerCheck(answer="normalized")
    reset_tool: str | None = None  # called before an episode on a server another episode used
    tools: list[str] | None = None  # the tools the model is shown; default all but the reset and grader tools
    # the policy's tool-call format (envs/tools/parsers); auto: read from its chat template (the tiny
    # presets' template writes none: name one)
    tool_format: Literal["auto", "hermes", "lfm2", "llama3"] = "auto"
    max_turns: int = Field(6, ge=1)  # assistant turns, tool calls and the final answer included
    format_weight: float = 0.1  # paid for an episode whose every call parsed and named a tool
    connect_seconds: float = Field(30.0, gt=0)  # a server's start and handshake
    call_seconds: float = Field(10.0, gt=0)  # one tool call; past it the server is taken as hung
    # a teacher with a fixable flaw: on this share of the tasks (a fixed choice per task, by its id)
    # whose row has a `shortcut` column, the synthesize stage's oracle teacher answers that at once,
    # without looking; SFT imitates it, and only the env's reward, on the model's own samples, tells
    # the shortcut from the look-up. The env's checks (`posttrain envs check`) play the oracle.
    teacher_shortcut_rate: float = Field(0.0, ge=0, le=1)

    def reward_functions(self) -> list[RewardConfig]:
        return [self.check] if isinstance(self.check, RewardConfig) else []

    def find_rewards_in(self, folder: Path) -> None:
        """The spec's folder (flows/spec_data.py): also what a stdio command's relative file arguments
        are relative to, as a source's path is (made absolute here, before the stages get the config)."""
        super().find_rewards_in(folder)
        if isinstance(self.server, StdioServer):
            self.server.command = [str((folder / arg).resolve()) if i and not Path(arg).is_absolute()
                                   and (folder / arg).is_file() else arg for i, arg in enumerate(self.server.command)]

    @property
    def hidden_tools(self) -> tuple[str, ...]:
        grader = (self.check.grader,) if isinstance(self.check, GraderCheck) else ()
        return tuple(name for name in (self.reset_tool, *grader) if name is not None)
