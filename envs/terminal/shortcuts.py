"""The terminal teacher's shortcuts (envs/shortcuts.py): per generated family, the commands of a
plausible move that acts without inspecting and fails the hidden tests. Each reads what it needs
from the task's oracle commands, setup files and test; families without a sensible shortcut
(sort-lines, head-lines, replace-word, pipe: the instruction says all there is) and task folders
have none."""

from __future__ import annotations

import re
from typing import Callable

from envs.base import Task
from envs.shortcuts import guess_draw, guessed
from envs.terminal.families import TYPOS

_NUMBER_CHECK = re.compile(r"< (\S+)\)\" = (\d+) \]")  # families.holds_number's test line: its file, its number
_SED_TYPO = re.compile(r"sed -i 's/(\w+)/echo/' (\S+)")
_FIND = re.compile(r"cp \"\$\(find (\S+) -name (\S+)\)\" (\S+)")
_RENAME = re.compile(r"for f in (\S+)/\*\.\w+; do mv \"\$f\" \"\$\{f%\.\w+\}\.(\w+)\"; done")
_EXTRACT = re.compile(r"tail -n \+2 (\S+) \| (cut -d, -f\d+) > (\S+)")
_DEDUPE = re.compile(r"sort -u (\S+) > (\S+)")


def _match(pattern: re.Pattern, task: Task, command: int = 0) -> re.Match:
    match = pattern.fullmatch(task.info["solution"][command])
    if match is None:
        raise ValueError(f"{task.id}: the {task.info['family']} family's oracle changed shape; update its shortcut")
    return match


def guessed_number(task: Task) -> list[str]:
    """Writes a number without counting or looking (count-files, count-lines, count-matches, find-max)."""
    out, number = _NUMBER_CHECK.search(task.info["tests"]["test.sh"]).groups()
    draw, top = guess_draw(task), 999 if task.info["family"] == "find-max" else max(9, 2 * int(number))
    guess = guessed(lambda: str(draw.randint(1, top)), lambda g: g != number)
    return [f"echo {guess} > {out}"]


def guessed_typo(task: Task) -> list[str]:
    """Seds the typo it guesses, without reading the script (the typo the file has is another)."""
    typo, script = _match(_SED_TYPO, task, 1).groups()
    guess = guess_draw(task).choice([other for other in TYPOS if other != typo])
    return [f"sed -i 's/{guess}/echo/' {script}", *task.info["solution"][2:]]


def copied_from_top(task: Task) -> list[str]:
    """Copies the file from the folder's top, without finding where it is (it lies deeper)."""
    folder, target, out = _match(_FIND, task).groups()
    return [f"cp {folder}/{target} {out}"]


def renamed_all(task: Task) -> list[str]:
    """Renames every file in the folder, without listing it (one file has another extension)."""
    folder, new = _match(_RENAME, task).groups()
    return [f'for f in {folder}/*; do mv "$f" "${{f%.*}}.{new}"; done']


def header_kept(task: Task) -> list[str]:
    """Cuts the column without looking at the file's first line (the header stays in)."""
    name, cut, out = _match(_EXTRACT, task).groups()
    return [f"{cut} {name} > {out}"]


def uniq_unsorted(task: Task) -> list[str] | None:
    """`uniq`, as if the file were sorted, without looking (its repeats are not adjacent)."""
    name, out = _match(_DEDUPE, task).groups()
    lines = task.info["setup"][name].splitlines()
    adjacent_dropped = [line for i, line in enumerate(lines) if i == 0 or line != lines[i - 1]]
    return None if adjacent_dropped == sorted(set(lines)) else [f"uniq {name} > {out}"]


SHORTCUTS: dict[str, Callable[[Task], list[str] | None]] = {
    "count-files": guessed_number, "count-lines": guessed_number, "count-matches": guessed_number,
    "find-max": guessed_number, "fix-script": guessed_typo, "find-file": copied_from_top,
    "rename-extension": renamed_all, "extract-column": header_kept, "dedupe": uniq_unsorted,
}


def shortcut_commands(task: Task) -> list[str] | None:
    """The shortcut's commands for a generated task whose family has one, else None."""
    family = task.info["family"] if "family" in task.info else None
    return SHORTCUTS[family](task) if family in SHORTCUTS else None
