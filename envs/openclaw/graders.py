"""Graders of `openclaw` tasks: small named functions of (transcript, workspace, **args) -> score.

A task names its grader in its front matter (`grader: file_contains`) with JSON arguments
(`grader_args: {"path": "out.txt", "text": "42"}`), so task files stay data. `workspace` is the
sandbox's snapshot of /work after the episode ({relative path: bytes}); `transcript` is the
episode's actions and observations, whose last action (when it holds no tool call) is the
final reply.
"""

from __future__ import annotations

import inspect
from typing import Callable, Mapping

Workspace = Mapping[str, bytes]
RESULT_END = "</result>\n"  # how every observation ends; tool output never holds it (escaped)
TOOL_OPEN = "<tool>"
MAX_REPLY_CHARS = 200  # a reply that lists every candidate answer does not pay


def final_reply(transcript: str) -> str:
    """The last action when it is a reply (no tool call), else ''."""
    last = transcript.rsplit(RESULT_END, 1)[-1]
    return "" if TOOL_OPEN in last else last


def is_memory_file(path: str) -> bool:
    return path == "MEMORY.md" or (path.startswith("memory/") and path.endswith(".md"))


def text_of(workspace: Workspace, path: str) -> str | None:
    data = workspace[path] if path in workspace else None
    return None if data is None else data.decode("utf-8", "replace")


def file_contains(transcript: str, workspace: Workspace, path: str, text: str) -> float:
    """The file exists and holds `text`."""
    content = text_of(workspace, path)
    return float(content is not None and text in content)


def file_equals(transcript: str, workspace: Workspace, path: str, text: str) -> float:
    """The file holds exactly `text`, up to surrounding whitespace."""
    content = text_of(workspace, path)
    return float(content is not None and content.strip() == text.strip())


def file_lines(transcript: str, workspace: Workspace, path: str, lines: list[str]) -> float:
    """The file's non-blank lines, stripped, are exactly `lines`."""
    content = text_of(workspace, path)
    return float(content is not None and [line.strip() for line in content.splitlines() if line.strip()] == lines)


def file_moved(transcript: str, workspace: Workspace, source: str, target: str, text: str) -> float:
    """`source` is gone and `target` holds `text` (a rename or move that kept the content)."""
    content = text_of(workspace, target)
    return float(source not in workspace and content is not None and text in content)


def memory_contains(transcript: str, workspace: Workspace, text: str) -> float:
    """MEMORY.md or a memory/*.md file holds `text` (case-insensitive)."""
    memory = [path for path in workspace if is_memory_file(path)]
    return float(any(text.lower() in text_of(workspace, path).lower() for path in memory))


def answer_contains(transcript: str, workspace: Workspace, text: str) -> float:
    """The final reply is short and holds `text` (case-insensitive)."""
    reply = final_reply(transcript).strip()
    return float(len(reply) <= MAX_REPLY_CHARS and text.lower() in reply.lower())


def all_of(transcript: str, workspace: Workspace, checks: list[dict]) -> float:
    """1 when every check passes: each check is {"grader": name, "args": {...}}. All or nothing, so
    a check that already holds before the episode (a file left as it was) never pays by itself."""
    return float(all(grade(check["grader"], check["args"], transcript, workspace) == 1.0 for check in checks))


GRADERS: dict[str, Callable[..., float]] = {fn.__name__: fn for fn in (
    file_contains, file_equals, file_lines, file_moved, memory_contains, answer_contains, all_of)}


def grade(name: str, args: Mapping[str, object], transcript: str, workspace: Workspace) -> float:
    return GRADERS[name](transcript, workspace, **args)


def check_grader(name: object, args: object) -> None:
    """ValueError (one line) unless `name` is a grader and `args` fit its parameters."""
    if not isinstance(name, str) or name not in GRADERS:
        raise ValueError(f"unknown grader {name!r} (known: {', '.join(GRADERS)})")
    if not isinstance(args, dict):
        raise ValueError(f"grader_args of {name} must be a JSON object, not {args!r}")
    try:
        inspect.signature(GRADERS[name]).bind("", {}, **args)
    except TypeError as exc:
        raise ValueError(f"grader {name}: {exc}") from None
    parameters = inspect.signature(GRADERS[name]).parameters
    for key, value in args.items():
        wanted = parameters[key].annotation
        if not isinstance(value, list if wanted.startswith("list") else str):
            raise ValueError(f"grader {name}: {key} must be {wanted}, not {value!r}")
    if name == "all_of":
        for check in args["checks"]:
            if not isinstance(check, dict) or set(check) != {"grader", "args"}:
                raise ValueError(f"all_of: each check is {{\"grader\": name, \"args\": {{...}}}}, not {check!r}")
            check_grader(check["grader"], check["args"])
