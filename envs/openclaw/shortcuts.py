"""The openclaw teacher's shortcuts (envs/shortcuts.py): per generated family, the tag-format
actions of a plausible move that acts without reading and fails the task's grader, made from the
oracle's actions with one step skipped or guessed. write-file (nothing to read) and task files
have none."""

from __future__ import annotations

import re
from typing import Callable

from envs.base import Task
from envs.families import word_pool
from envs.openclaw.families import call
from envs.openclaw.tools import parse_call
from envs.shortcuts import guess_draw, guessed

_WORD = re.compile(r"[a-z]+")


def guessed_word(task: Task) -> str:
    """A made-up word of the task's split that neither is in, nor holds a word of, its workspace."""
    text = "\n".join(task.info["workspace"].values())
    words, pool, draw = set(_WORD.findall(text)), word_pool(task.info["split"]), guess_draw(task)
    return guessed(lambda: draw.choice(pool), lambda g: g not in text and not any(word in g for word in words))


def guessed_old_value(task: Task) -> list[str]:
    """Edits the setting's old value as it guesses it, without reading the file (the edit finds none)."""
    edit, reply = parse_call(task.info["oracle"][0]), task.info["oracle"][-1]
    key = edit["old"].split(" = ")[0]
    return [call("edit", path=edit["path"], old=f"{key} = {guessed_word(task)}", new=edit["new"]), reply]


def answered_unread(task: Task) -> list[str]:
    """Replies with a guessed value, without searching memory or reading the file."""
    return [task.info["oracle"][-1].replace(task.info["grader_args"]["text"], guessed_word(task))]


def guessed_count(task: Task) -> list[str]:
    """Writes a guessed line count, without counting."""
    write, reply, number = parse_call(task.info["oracle"][1]), task.info["oracle"][-1], task.info["grader_args"]["text"]
    draw = guess_draw(task)
    guess = guessed(lambda: str(draw.randint(1, 2 * int(number) + 2)), lambda g: g != number)
    return [call("write", path=write["path"], content=f"{guess}\n"),
            reply.replace(f" has {number} lines", f" has {guess} lines")]


def memory_overwritten(task: Task) -> list[str]:
    """Writes the fact over MEMORY.md (`>`), without reading what it already holds."""
    command = parse_call(task.info["oracle"][0])["command"]
    return [call("exec", command=command.replace(" >> MEMORY.md", " > MEMORY.md")), task.info["oracle"][-1]]


def moved_into_nothing(task: Task) -> list[str]:
    """Moves the file into the folder, without checking that the folder exists (it does not)."""
    command = parse_call(task.info["oracle"][0])["command"]
    return [call("exec", command=command.split(" && ", 1)[1]), task.info["oracle"][-1]]


SHORTCUTS: dict[str, Callable[[Task], list[str]]] = {
    "edit-config": guessed_old_value, "recall-memory": answered_unread, "read-field": answered_unread,
    "count-lines": guessed_count, "remember": memory_overwritten, "move-file": moved_into_nothing,
}


def shortcut_lines(task: Task) -> list[str] | None:
    """The shortcut's tag-format actions (calls, then the reply) for a generated task whose family
    has one, else None."""
    family = task.info["family"] if "family" in task.info else None
    return SHORTCUTS[family](task) if family in SHORTCUTS else None
