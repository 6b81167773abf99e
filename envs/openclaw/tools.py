"""The `openclaw` episode: OpenClaw-style workspace tools, each going through the episode's sandbox.

One tool call per action, `<tool>{"name": "write", "path": "notes.md", "content": "hi"}</tool>`
(a JSON object: the tool's name and its arguments, all strings). The environment answers
`\n<result>...</result>\n` (truncated); an action without a call is the final reply and ends
the episode. The workspace is the sandbox's /work: file tools take paths relative to it, and
read, write and edit go through Sandbox commands, so nothing outside the sandbox is reachable
even where a path check were wrong.
"""

from __future__ import annotations

import base64
import json
import math
import posixpath
import re
import shlex
from typing import Callable

from envs.base import Outcome, Turn
from envs.openclaw.graders import grade, is_memory_file
from envs.sandbox import Sandbox

RESULT = "\n<result>{text}</result>\n"
OBSERVATION_CHARS = 300  # what the policy sees of one tool's answer
SEARCH_HITS = 5  # memory_search lines shown
WEB_HITS = 2  # web_search results shown
_CALL = re.compile(r"<tool>(.*?)</tool>", re.S)
_WORD = re.compile(r"[a-z0-9]+")
TOOL_ARGS: dict[str, tuple[str, ...]] = {
    "exec": ("command",), "read": ("path",), "write": ("path", "content"), "edit": ("path", "old", "new"),
    "memory_search": ("query",), "memory_get": ("path",), "web_search": ("query",), "web_fetch": ("url",),
}


class ToolError(Exception):
    """A call the tool refuses (bad syntax, bad arguments, a path outside the workspace, no such file)."""


def parse_call(action: str) -> dict[str, str] | None:
    """The action's tool call as {"name", ...arguments}; None when the action is a reply."""
    match = _CALL.search(action)
    if match is None:
        if "<tool>" in action:
            raise ToolError('a call is <tool>{"name": ..., arguments}</tool>')
        return None
    try:
        call = json.loads(match.group(1))
    except ValueError as exc:
        raise ToolError(f"the call is not JSON: {exc}") from None
    if not isinstance(call, dict) or call.get("name") not in TOOL_ARGS:
        raise ToolError(f"the call needs a name, one of: {', '.join(TOOL_ARGS)}")
    wanted = set(TOOL_ARGS[call["name"]])
    given = set(call) - {"name"}
    if given != wanted:
        raise ToolError(f"{call['name']} takes {', '.join(sorted(wanted))}; got {', '.join(sorted(given)) or 'none'}")
    if not all(isinstance(call[key], str) for key in wanted):
        raise ToolError(f"{call['name']}: every argument is a string")
    return call


def workspace_path(path: str) -> str:
    """`path` relative to the workspace, normalized; ToolError when it points outside it."""
    if path.startswith("/work/"):
        path = path[len("/work/"):]
    clean = posixpath.normpath(path) if path else ""
    if not clean or clean in (".", "..") or clean.startswith("../") or path.startswith("/") or "\0" in path:
        raise ToolError(f"path outside the workspace: {path}")
    return clean


def truncate(text: str, limit: int = OBSERVATION_CHARS) -> str:
    return text if len(text) <= limit else f"{text[:limit]}...[{len(text) - limit} more chars]"


def ranked(query: str, items: list[tuple[str, object]], limit: int) -> list[object]:
    """Items whose text shares a word with the query, most shared words first, then in order."""
    words = set(_WORD.findall(query.lower()))
    scores = [len(words & set(_WORD.findall(text.lower()))) for text, _ in items]
    order = sorted((i for i, score in enumerate(scores) if score), key=lambda i: -scores[i])
    return [items[i][1] for i in order[:limit]]


class OpenClawEpisode:
    """One task in a fresh sandbox workspace; graded from the workspace snapshot at `finish`."""

    def __init__(self, sandbox: Sandbox, web: list[dict[str, str]], grader: str, grader_args: dict):
        self.sandbox = sandbox
        self.web = web
        self.grader, self.grader_args = grader, grader_args
        self.transcript = ""
        self.tool_calls = self.tool_errors = self.bad_calls = self.replied = 0
        self.tools: dict[str, Callable[..., str]] = {
            "exec": self.exec, "read": self.read, "write": self.write, "edit": self.edit,
            "memory_search": self.memory_search, "memory_get": self.memory_get,
            "web_search": self.web_search, "web_fetch": self.web_fetch,
        }

    def step(self, action: str) -> Turn:
        self.transcript += action
        try:
            call = parse_call(action)
        except ToolError as exc:
            self.bad_calls += 1
            return self._answer(f"error: {exc}")
        if call is None:
            self.replied = 1
            return Turn(done=True)
        self.tool_calls += 1
        try:
            return self._answer(self.tools[call.pop("name")](**call))
        except ToolError as exc:
            self.tool_errors += 1
            return self._answer(f"error: {exc}")

    def _answer(self, text: str) -> Turn:
        observation = RESULT.format(text=truncate(text).replace("</result>", "<\\/result>"))
        self.transcript += observation
        return Turn(observation=observation)

    def finish(self) -> Outcome:
        try:
            graded = self.graded(self.transcript)
        finally:
            self.sandbox.close()
        return {"graded": graded, "tool_calls": float(self.tool_calls), "tool_errors": float(self.tool_errors),
                "bad_calls": float(self.bad_calls), "replied": float(self.replied)}

    def graded(self, transcript: str) -> float:
        """The task's grader on `transcript` (graders read its final reply) and the workspace now."""
        try:
            return grade(self.grader, self.grader_args, transcript, self.sandbox.files())
        except Exception:  # a grader bug on odd workspace content: reported as NaN by the rubric, never a silent 0
            return math.nan

    def _run(self, command: str) -> str:
        """A shell command's output; ToolError when it failed."""
        result = self.sandbox.run(command)
        if result.error or result.exit_code != 0:
            raise ToolError(result.observation())
        return result.output

    def _workspace_file(self, path: str) -> str:
        files = self.sandbox.files()
        if path not in files:
            raise ToolError(f"no such file: {path}")
        return files[path].decode("utf-8", "replace")

    def exec(self, command: str) -> str:
        result = self.sandbox.run(command)
        if result.error or result.exit_code != 0:
            self.tool_errors += 1
        return result.observation()

    def read(self, path: str) -> str:
        return self._run(f"cat -- {shlex.quote(workspace_path(path))}")

    def write(self, path: str, content: str) -> str:
        path, data = workspace_path(path), content.encode()
        # a shell command rather than Sandbox.write (meant for the env's own files): the policy's writes
        # then run under the same per-command limits (file size, CPU, wall clock) as its exec calls
        quoted, encoded = shlex.quote(path), base64.b64encode(data).decode()
        self._run(f'mkdir -p -- "$(dirname -- {quoted})" && printf %s {encoded} | base64 -d > {quoted}')
        return f"wrote {len(data)} bytes to {path}"

    def edit(self, path: str, old: str, new: str) -> str:
        path = workspace_path(path)
        content = self._workspace_file(path)
        found = content.count(old) if old else 0
        if found != 1:
            raise ToolError(f"old text must occur exactly once in {path}; found {found}")
        self.write(path, content.replace(old, new))
        return f"edited {path}"

    def memory_search(self, query: str) -> str:
        files = self.sandbox.files()
        lines = [(line, f"{path}:{number}: {line.strip()}") for path in sorted(files) if is_memory_file(path)
                 for number, line in enumerate(files[path].decode("utf-8", "replace").splitlines(), 1)]
        hits = ranked(query, lines, SEARCH_HITS)
        return "\n".join(hits) if hits else "no matches"

    def memory_get(self, path: str) -> str:
        path = workspace_path(path)
        if not is_memory_file(path):
            raise ToolError("memory_get reads MEMORY.md or memory/*.md")
        return self._workspace_file(path)

    def web_search(self, query: str) -> str:
        pages = [(f"{page['title']} {page['text']}", page) for page in self.web]
        hits = ranked(query, pages, WEB_HITS)
        return "\n".join(f"{page['title']} ({page['url']}): {page['text'][:80]}" for page in hits) or "no results"

    def web_fetch(self, url: str) -> str:
        for page in self.web:
            if page["url"] == url.strip():
                return f"{page['title']}\n{page['text']}"
        raise ToolError(f"no page at {url} (offline)")
