"""An episode of tool use in the model's own format (envs/base.Episode): each action is read by the
family's parser; a turn with calls is answered by the `tool` turns of their results, rendered by the
chat template (the observation, masked from the loss, so only the assistant's tokens train); a turn
without calls is the final reply and ends the episode. A call that cannot be read, or a tool that
fails, is counted and answered with an error `tool` turn; the episode goes on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from envs.base import NO_OUTCOME, Outcome, Turn
from envs.tools.calls import ParsedTurn, ToolFailed
from envs.tools.chat import ToolChat, tool_turn
from envs.tools.executor import Toolset

ERROR = "error: {reason}"


@dataclass
class ToolMetrics:
    """What an episode's tool use counts, reported in its outcome (evaluate's `outcome_<name>`)."""

    tool_calls: int = 0  # calls read and run (failed ones included)
    malformed_calls: int = 0  # calls the parser could not read
    tool_errors: int = 0  # calls a tool refused or failed
    replied: int = 0  # the episode ended with a reply without calls

    def outcome(self) -> dict[str, float]:
        return {"tool_calls": float(self.tool_calls), "malformed_calls": float(self.malformed_calls),
                "tool_errors": float(self.tool_errors), "replied": float(self.replied)}


class ToolEpisode:
    """`grade(transcript, final_reply)` gives the env's own outcome when the episode ends (None: it
    grades nothing); `close()` releases what the toolset holds (a sandbox), both at `finish`."""

    def __init__(self, toolset: Toolset, chat: ToolChat, grade: Callable[[str, ParsedTurn | None], Outcome] | None = None,
                 close: Callable[[], None] = lambda: None):
        self.toolset, self.chat = toolset, chat
        self.grade, self.close = grade, close
        self.metrics = ToolMetrics()
        self.transcript = ""
        self.final: ParsedTurn | None = None

    def step(self, action: str) -> Turn:
        parsed = self.chat.parser.parse(action)
        self.transcript += action
        if not parsed.calls and not parsed.malformed:
            self.metrics.replied, self.final = 1, parsed
            return Turn(done=True)
        observation = self.chat.replies(self.answers(parsed))
        self.transcript += observation
        return Turn(observation=observation)

    def answers(self, parsed: ParsedTurn) -> list[dict]:
        """A `tool` turn per call, in order, then one per call that could not be read."""
        turns = []
        for call in parsed.calls:
            self.metrics.tool_calls += 1
            try:
                turns.append(tool_turn(call.id, call.name, self.toolset.call(call)))
            except ToolFailed as exc:
                self.metrics.tool_errors += 1
                turns.append(tool_turn(call.id, call.name, ERROR.format(reason=exc)))
        for reason in parsed.malformed:
            self.metrics.malformed_calls += 1
            turns.append(tool_turn("", "", ERROR.format(reason=f"malformed tool call: {reason}")))
        return turns

    def finish(self) -> Outcome:
        try:
            graded = self.grade(self.transcript, self.final) if self.grade is not None else NO_OUTCOME
        finally:
            self.close()
        return {**graded, **self.metrics.outcome()}
