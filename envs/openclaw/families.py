"""Generated openclaw task families: workspaces and requests made of made-up words, many variants
of each (write, edit a config, recall from memory, read a field, move, remember, count), so a
held-out request tests the skill and not the memory of a task. Names and contents come from the
split's word pool (envs/families.py): no held-out variant shares one with a train variant.

A variant is what a task file of envs/data/openclaw/tasks holds: the request, the workspace, the
grader with its arguments and the oracle's actions (tool calls, then the final reply).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Callable, Literal

from pydantic import Field

from envs.families import EXTENSIONS, GeneratedTasks, Words, variant_words


@dataclass(frozen=True)
class Request:
    family: str
    prompt: str
    workspace: dict[str, str]
    grader: str
    grader_args: dict
    oracle: tuple[str, ...]


def call(name: str, **arguments: str) -> str:
    return "<tool>" + json.dumps({"name": name, **arguments}, separators=(",", ":")) + "</tool>"


def _facts(w: Words, n: int) -> dict[str, str]:
    return {w(): w() for _ in range(n)}


def write_file(d: random.Random, w: Words) -> Request:
    path, line = f"{w()}.txt", f"{w()} {w()}"
    return Request("write-file", f"Write the line '{line}' to {path}.", {}, "file_equals",
                   {"path": path, "text": line}, (call("write", path=path, content=line + "\n"), f"Wrote {path}."))


def edit_config(d: random.Random, w: Words) -> Request:
    path, settings = f"{w()}.cfg", _facts(w, 3)
    key, new = d.choice(list(settings)), w()
    lines = [f"{k} = {v}" for k, v in settings.items()]
    changed = [f"{k} = {new if k == key else v}" for k, v in settings.items()]
    return Request("edit-config", f"Change {key} in {path} to {new}.", {path: "\n".join(lines) + "\n"},
                   "file_lines", {"path": path, "lines": changed},
                   (call("edit", path=path, old=f"{key} = {settings[key]}", new=f"{key} = {new}"),
                    f"{key} is now {new}."))


def recall_memory(d: random.Random, w: Words) -> Request:
    facts = _facts(w, 3)
    key = d.choice(list(facts))
    memory = "# Memory\n" + "".join(f"- {k}: {v}\n" for k, v in facts.items())
    return Request("recall-memory", f"What is the {key}? Search memory.", {"MEMORY.md": memory}, "answer_contains",
                   {"text": facts[key]}, (call("memory_search", query=key), f"The {key} is {facts[key]}."))


def read_field(d: random.Random, w: Words) -> Request:
    path, fields = f"{w()}.txt", _facts(w, 3)
    key = d.choice(list(fields))
    return Request("read-field", f"Read {path}: what is its {key}?",
                   {path: "".join(f"{k}: {v}\n" for k, v in fields.items())}, "answer_contains",
                   {"text": fields[key]}, (call("read", path=path), f"Its {key} is {fields[key]}."))


def move_file(d: random.Random, w: Words) -> Request:
    folder, names = w(), [f"{w()}.{d.choice(EXTENSIONS)}" for _ in range(3)]
    workspace = {name: w() + "\n" for name in names}
    moved = d.choice(names)
    return Request("move-file", f"Move {moved} into a {folder}/ folder.", workspace, "all_of",
                   {"checks": [{"grader": "file_moved", "args": {"source": moved, "target": f"{folder}/{moved}",
                                                                 "text": workspace[moved].strip()}},
                               *[{"grader": "file_contains", "args": {"path": name, "text": workspace[name].strip()}}
                                 for name in names if name != moved]]},
                   (call("exec", command=f"mkdir -p {folder} && mv {moved} {folder}/"), f"Moved {moved}."))


def remember(d: random.Random, w: Words) -> Request:
    kept, key, value = _facts(w, 1), w(), w()
    memory = "# Memory\n" + "".join(f"- {k}: {v}\n" for k, v in kept.items())
    (old_key, old_value), = kept.items()
    return Request("remember", f"Remember this in MEMORY.md: the {key} is {value}.", {"MEMORY.md": memory}, "all_of",
                   {"checks": [{"grader": "memory_contains", "args": {"text": f"{key}: {value}"}},
                               {"grader": "file_contains", "args": {"path": "MEMORY.md",
                                                                    "text": f"{old_key}: {old_value}"}}]},
                   (call("exec", command=f"echo '- {key}: {value}' >> MEMORY.md"), "Saved to MEMORY.md."))


def count_lines(d: random.Random, w: Words) -> Request:
    path, out, n = f"{w()}.txt", f"{w()}.txt", d.randint(2, 9)
    return Request("count-lines", f"Count the lines of {path} and write the number to {out}.",
                   {path: "".join(f"{w()}\n" for _ in range(n))}, "file_equals", {"path": out, "text": str(n)},
                   (call("exec", command=f"wc -l < {path}"), call("write", path=out, content=f"{n}\n"),
                    f"{path} has {n} lines."))


FAMILIES: dict[str, Callable[[random.Random, Words], Request]] = {
    "write-file": write_file, "edit-config": edit_config, "recall-memory": recall_memory, "read-field": read_field,
    "move-file": move_file, "remember": remember, "count-lines": count_lines,
}


def request(family: str, split: str, index: int, seed: int) -> Request:
    """Variant `index` of a family in a split: the same on every machine."""
    return FAMILIES[family](*variant_words(f"openclaw:{family}", split, index, seed))


class GeneratedClawTasks(GeneratedTasks):
    """`generated:` of an openclaw env."""

    families: list[Literal[tuple(FAMILIES)]] = Field(default_factory=lambda: list(FAMILIES), min_length=1)
