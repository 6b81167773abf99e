"""`mcp`: tasks played against the tools of an MCP server, in the policy's own tool-call format.

Each task is a row of a prompts dataset (envs/dataset/rows.py: `data:` or `source:`, held-out rows
by `eval_fraction` or `eval_data`), with the columns the check reads: `answer`, `oracle_calls` (the
reference calls, a list of `{name, arguments}` or its JSON text) and `grader_arguments` (a grader's).
The server's tools (envs/mcp/client.py; less the reset and grader tools) are the task's tools: the
prompt is rendered with them by the chat template, each action is read by the template family's
parser and its calls run on the server (envs/tools/episode.py: ToolEpisode); a reply without calls
ends the episode. A server that fails to start, crashes or hangs ends its episode as an error: the
outcome's `server_error` is 1 and the correctness check gives NaN, so rl gives that episode no
advantage and counts it (`reward_errors`), and evaluate counts it as unsolved; the rollout goes on.

Outcome (evaluate's `mean_outcome_<name>`): `correct` (answer and grader checks), `server_error`,
`turns`, `valid_call_rate` (calls that parsed, of all calls; NaN without a call), and the
ToolEpisode's counts (`tool_calls`, `malformed_calls`, `tool_errors`, `replied`).
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import replace

from envs.base import NO_OUTCOME, EnvBase, EnvFieldError, Outcome, Rubric, SubPolicy, Task, Turn
from envs.dataset.config import RewardConfig
from envs.dataset.reward_modules import load_function, trl_reward
from envs.dataset.rows import RowTasks
from envs.mcp.client import McpToolset, ToolsetFailed
from envs.mcp.config import AnswerCheck, GraderCheck, McpEnvConfig
from envs.mcp.servers import Servers
from envs.shortcuts import FlawedTeacher
from envs.tools import ToolCall, ToolFailed
from envs.tools.calls import ParsedTurn
from envs.tools.chat import ToolChat
from envs.tools.episode import ToolEpisode

LOG = logging.getLogger(__name__)
GRADER_DONE = "Done."  # the oracle's last reply where a grader checks the server's state


def normalized(text: str) -> str:
    """Case, runs of spaces, surrounding quotes and end punctuation aside."""
    return re.sub(r"\s+", " ", text).strip().strip("\"'`").rstrip(".!?;:,").strip().lower()


def matches(reply: str, answer: str, exact: bool) -> bool:
    return reply.strip() == answer.strip() if exact else normalized(reply) == normalized(answer)


def oracle_calls(task: Task) -> list[ToolCall]:
    """The row's `oracle_calls`: a list of {name, arguments} (or its JSON text). Arguments read back
    from Parquet hold every key any row's calls used, None where this call had none: those are dropped."""
    cell = task.info["columns"].get("oracle_calls")
    calls = json.loads(cell) if isinstance(cell, str) else cell or []
    return [ToolCall(call["name"], {key: value for key, value in (call.get("arguments") or {}).items()
                                    if value is not None}, f"call_{i}") for i, call in enumerate(calls)]


class McpEpisode:
    """A ToolEpisode over a connection to the server, or (the server failed at the start) none: the
    episode then ends at its first step. A ToolsetFailed during a step ends it as an error."""

    def __init__(self, env: McpEnv, task: Task, toolset: McpToolset | None, failure: str | None):
        self.env, self.task, self.toolset, self.failure = env, task, toolset, failure
        self.turns = 0
        self.inner = None if toolset is None else ToolEpisode(toolset, env.chat, grade=self.grade, close=self.release)

    def step(self, action: str) -> Turn:
        self.turns += 1
        if self.inner is None or self.failure is not None:
            return Turn(done=True)
        try:
            return self.inner.step(action)
        except ToolsetFailed as exc:
            self.failed(str(exc))
            return Turn(done=True)

    def failed(self, reason: str) -> None:
        self.failure = reason
        LOG.warning("env %s, task %s: the MCP server failed: %s", self.env.name, self.task.id, reason)

    def grade(self, transcript: str, final: ParsedTurn | None) -> Outcome:
        check = self.env.config.check
        if self.failure is not None or isinstance(check, RewardConfig):
            return NO_OUTCOME
        if isinstance(check, AnswerCheck):
            return {"correct": float(final is not None and matches(final.content, self.task.answer,
                                                                   check.answer == "exact"))}
        try:
            arguments = self.task.info["columns"].get("grader_arguments") or {}
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            graded = self.toolset.call_any(check.grader, arguments)
        except ToolFailed:
            return {"correct": 0.0}
        except ToolsetFailed as exc:
            self.failed(str(exc))
            return NO_OUTCOME
        return {"correct": float(matches(graded, self.task.answer, exact=False))}

    def release(self) -> None:
        self.env.servers.give_back(self.toolset, failed=self.failure is not None)

    def finish(self) -> Outcome:
        outcome = dict(self.inner.finish()) if self.inner is not None else {}
        calls = outcome.get("tool_calls", 0.0) + outcome.get("malformed_calls", 0.0)
        return {**outcome, "server_error": float(self.failure is not None), "turns": float(self.turns),
                "valid_call_rate": outcome.get("tool_calls", 0.0) / calls if calls else math.nan}


class McpEnv(FlawedTeacher, RowTasks, EnvBase):
    config_class = McpEnvConfig
    speaks_tools = True  # the stage gives it the policy's tokenizer (use_chat)

    def __init__(self, config: McpEnvConfig, name: str = "mcp"):
        super().__init__(config, name)
        both = sorted(set(config.tools or ()) & set(config.hidden_tools))
        if both:
            raise EnvFieldError("tools", f"{', '.join(both)} is the reset or grader tool, which the model is not shown")
        self.servers = Servers(config)
        self.chat: ToolChat | None = None
        self.schemas: list[dict] | None = None  # the shown tools, listed once from the server
        self.rubric = Rubric.paid_checks(self.correct_check(), formatted, config.format_weight)

    def correct_check(self):
        """1 when the check passes, NaN when the server failed (an error, never a silent 0)."""
        check = self.config.check
        if isinstance(check, RewardConfig):
            try:
                user = trl_reward(check, load_function(check, self.config.reward_folder)).fn
            except ValueError as exc:
                raise EnvFieldError("check.function", str(exc)) from None
        else:
            def user(completion, task, outcome):
                return outcome.get("correct", 0.0)

        def correct(completion: str, task: Task, outcome: Outcome = NO_OUTCOME):
            return math.nan if outcome.get("server_error") else user(completion, task, outcome)

        return correct

    def use_chat(self, tokenizer) -> None:
        self.chat = ToolChat.of(tokenizer, self.config.tool_format)

    def tool_schemas(self) -> list[dict]:
        """The shown tools' OpenAI schemas, listed from a server once."""
        if self.schemas is None:
            toolset = self.servers.take()
            self.schemas = [spec.openai() for spec in toolset.specs()]
            self.servers.give_back(toolset, failed=False)
        return self.schemas

    def with_tools(self, task: Task) -> Task:
        return replace(task, info={**task.info, "tools": self.tool_schemas()})

    def tasks(self, split: str, n: int, seed: int) -> list[Task]:
        return [self.with_tools(task) for task in super().tasks(split, n, seed)]

    def all_tasks(self) -> list[Task]:
        return [self.with_tools(task) for task in super().all_tasks()]

    @property
    def max_turns(self) -> int:
        return self.config.max_turns

    def start(self, task: Task, llm: SubPolicy | None = None) -> McpEpisode:
        if self.chat is None:
            raise RuntimeError(f"env {self.name}: no tool-call format (the stage gives it the tokenizer: use_chat)")
        try:
            return McpEpisode(self, task, self.servers.take(), None)
        except ToolsetFailed as exc:
            episode = McpEpisode(self, task, None, None)
            episode.failed(str(exc))
            return episode

    def oracle_actions(self, task: Task) -> list[str]:
        """Each reference call in a turn of its own, then the answer (or, where a grader checks, a word)."""
        final = GRADER_DONE if isinstance(self.config.check, GraderCheck) else task.answer
        return [self.chat.action([call]) for call in oracle_calls(task)] + [final]

    def shortcut_actions(self, task: Task) -> list[str] | None:
        """The row's `shortcut` column, replied at once without a call (envs/shortcuts.py: on the
        `teacher_shortcut_rate` share of the tasks); none for a row without it."""
        shortcut = task.info["columns"].get("shortcut")
        return [str(shortcut)] if shortcut else None


def formatted(completion: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
    """The episode called a tool, every call parsed, and it ended with a reply."""
    return float(outcome.get("tool_calls", 0) >= 1 and outcome.get("malformed_calls", 0) == 0
                 and outcome.get("replied", 0) == 1)
