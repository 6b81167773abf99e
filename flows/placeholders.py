"""`${VAR}` in a spec: filled from the environment where the spec is parsed, and put back as
placeholders in what travels as a Prefect parameter, so a value from the orchestrator's
environment (a token in a URL, a bucket name) is never stored by the Prefect API: the worker
fills each placeholder from its own environment.

A path is a tuple of keys and list indices from the document's root (`("stages", 2, "url")`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

ENV_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


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


def interpolate(document, filled: dict[tuple, tuple[str, str]], path: tuple = ()):
    """The parsed YAML `document` with its strings filled from this process's environment;
    `filled` collects {path: (template, value)} of every string that named a variable."""
    if isinstance(document, dict):
        return {key: interpolate(value, filled, (*path, key)) for key, value in document.items()}
    if isinstance(document, list):
        return [interpolate(value, filled, (*path, index)) for index, value in enumerate(document)]
    if not isinstance(document, str) or not ENV_VAR.search(document):
        return document
    value = fill(document, path, os.environ)
    filled[path] = (document, value)
    return value


def with_placeholders(payload: dict, filled: dict[tuple, tuple[str, str]],
                      prefixes: dict[tuple, tuple]) -> tuple[dict, list[list]]:
    """`payload` (JSON, changed in place) with each filled value put back as its template, and the
    payload paths that now hold one. `prefixes` maps a spec path to where that part of the spec
    sits in the payload (`("stages", 2)` -> `("stage",)`); a value the payload holds in another
    form (a number, a normalised path) stays as it is: it came through validation, so it is not
    free text a secret hides in."""
    placed = []
    for spec_path, (template, value) in filled.items():
        for spec_prefix, payload_prefix in prefixes.items():
            if spec_path[:len(spec_prefix)] != spec_prefix:
                continue
            target = (*payload_prefix, *spec_path[len(spec_prefix):])
            parent = _parent(payload, target)
            if parent is not None and parent[target[-1]] == value:
                parent[target[-1]] = template
                placed.append(list(target))
    return payload, placed


def fill_placeholders(payload: dict, placed: list[list], environ: Mapping[str, str]) -> dict:
    """The worker's side: the template at each of `placed` filled from `environ` (in place)."""
    for target in placed:
        parent = _parent(payload, tuple(target))
        if parent is None or not isinstance(parent[target[-1]], str):
            raise ValueError(f"placeholder at {dotted(tuple(target))}: the request holds no text there")
        parent[target[-1]] = fill(parent[target[-1]], tuple(target), environ)
    return payload


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
