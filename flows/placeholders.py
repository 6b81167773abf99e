"""`${VAR}` in a spec: filled from the environment where the spec is parsed, and put back as
placeholders in what travels as a Prefect parameter, so a value from the orchestrator's
environment (a token in a URL, a bucket name) is never stored by the Prefect API: the worker
fills each placeholder from its own environment, and refuses to run when that gives another
request than the orchestrator's (the stage would not be what its cache key says).

A path is a tuple of keys and list indices from the document's root (`("stages", 2, "url")`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping

ENV_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
MIN_HIDDEN_CHARS = 8


class UnsetVariable(ValueError):
    """A `${VAR}` without a default names a variable the environment does not set."""

    def __init__(self, path: tuple, name: str):
        super().__init__(f"{dotted(path)}: environment variable {name} is not set")


def dotted(path: tuple) -> str:
    """`("stages", 3, "policy")` -> `stages[3].policy`."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def fill(template: str, path: tuple, environ: Mapping[str, str]) -> str:
    """`template` with every ${VAR} / ${VAR:-default} replaced from `environ`."""

    def substitute(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        if name in environ:
            return environ[name]
        if default is not None:
            return default
        raise UnsetVariable(path, name)

    return ENV_VAR.sub(substitute, template)


def interpolate(document, filled: dict[str, str], path: tuple = (), check_name=None):
    """The parsed YAML `document` with its strings filled from this process's environment;
    `filled` collects {name: value} of every variable the environment set (a default written in
    the spec is in the spec's text: nothing to hide). `check_name(path, name)`, when given, is
    called for every variable a string names before that string is filled, and raises to refuse
    it (a spec read back from the store: flows/worker_allows.py)."""
    if isinstance(document, dict):
        return {key: interpolate(value, filled, (*path, key), check_name) for key, value in document.items()}
    if isinstance(document, list):
        return [interpolate(value, filled, (*path, index), check_name) for index, value in enumerate(document)]
    if not isinstance(document, str) or not ENV_VAR.search(document):
        return document
    for match in ENV_VAR.finditer(document) if check_name is not None else ():
        check_name(path, match.group(1))
    filled.update({match.group(1): os.environ[match.group(1)] for match in ENV_VAR.finditer(document)
                   if match.group(1) in os.environ})
    return fill(document, path, os.environ)


def with_placeholders(payload: dict, filled: dict[str, str]) -> tuple[dict, list[dict]]:
    """`payload` (JSON, changed in place) with every occurrence of a filled value, wherever it went
    (a field, or a string derived from one: a base model's identity, a normalised URI), replaced by
    `${NAME}`; returns it with [{path, names}] of the strings that now hold placeholders. Values
    shorter than MIN_HIDDEN_CHARS are left alone: they are no secret, and replacing them would
    rewrite unrelated text."""
    hidden = sorted(((text, name, mark) for name, value in filled.items() for text, mark in _variants(name, value)),
                    key=lambda item: (-len(item[0]), item[0]))
    placed: list[dict] = []

    def walk(node, path: tuple) -> None:
        for key, value in (node.items() if isinstance(node, dict) else enumerate(node)):
            if isinstance(value, (dict, list)):
                walk(value, (*path, key))
            elif isinstance(value, str):
                masked = value
                for text, _, mark in hidden:
                    masked = masked.replace(text, mark)
                if masked != value:
                    node[key] = masked
                    placed.append({"path": [*path, key], "names": sorted({name for _, name, mark in hidden
                                                                          if mark in masked})})

    walk(payload, ())
    return payload, placed


def _variants(name: str, value: str) -> list[tuple[str, str]]:
    """(text, placeholder) of the forms a value takes in a request: as given (`${NAME}`), and
    without its trailing slashes, as a normalised URI has it (`${NAME%/}`, as in the shell)."""
    forms = {value.rstrip("/"): "${" + name + "%/}", value: "${" + name + "}"}  # the plain form wins a tie
    return [(text, mark) for text, mark in forms.items() if len(text) >= MIN_HIDDEN_CHARS]


def fill_placeholders(payload: dict, placed: list[dict], environ: Mapping[str, str]) -> dict:
    """The worker's side: each `${NAME}` that `with_placeholders` put at a path filled from `environ`
    (in place); nothing else is interpolated (a reward module's source may hold `${HOME}`)."""
    for entry in placed:
        path = tuple(entry["path"])
        parent = _parent(payload, path)
        if parent is None or not isinstance(parent[path[-1]], str):
            raise ValueError(f"placeholder at {dotted(path)}: the request holds no text there")
        text = parent[path[-1]]
        for name in entry["names"]:
            if name not in environ:
                raise UnsetVariable(path, name)
            text = text.replace("${" + name + "%/}", environ[name].rstrip("/")).replace("${" + name + "}", environ[name])
        parent[path[-1]] = text
    return payload


def digest(payload: dict) -> str:
    """What the worker checks its filled request against: the orchestrator's, hashed."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _parent(payload, target: tuple):
    """The container holding `target`'s last key, or None when the path is not in the payload."""
    node = payload
    for part in target[:-1]:
        if not _has(node, part):
            return None
        node = node[part]
    return node if target and _has(node, target[-1]) else None


def _has(node, part) -> bool:
    if isinstance(node, dict):
        return part in node
    return isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
