"""What installed packages declare in an entry-point group: env kinds (`posttrain.envs`,
envs/loader.py) and stage kinds (`posttrain.stages`, tasks/kinds.py) load through here, so both
turn a broken package into the same one-line error and refuse a name declared twice."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Callable


@dataclass(frozen=True)
class Declared:
    name: str  # the entry point's name: the kind
    obj: object  # what it points at
    package: str  # the distribution that declared it
    version: str


def declared(group: str, noun: str, error: type[Exception], builtin: dict[str, object],
             check: Callable[[object, str], None]) -> list[Declared]:
    """Load every entry point of `group`, sorted by name, and `check(obj, name)` each; `error` (one
    line naming the `noun` and the entry point) when one fails to import or its name is taken,
    by a built-in (`builtin`: name -> object) or by another package."""
    found: dict[str, Declared] = {}
    for entry in sorted(entry_points(group=group), key=lambda e: e.name):
        where = f"entry point {entry.name} = {entry.value}"
        try:
            obj = entry.load()
        except Exception as exc:  # a third-party package: any import error is its own
            raise error(f"{noun} {entry.name!r} ({where}) fails to load: "
                        f"{type(exc).__name__}: {exc}".splitlines()[0]) from None
        check(obj, entry.name)
        taken = found[entry.name].obj if entry.name in found else builtin.get(entry.name)
        if taken is not None and taken is not obj:
            raise error(f"{noun} {entry.name!r} is declared twice: {where} and "
                        f"{taken.__module__}.{taken.__qualname__}")
        dist = entry.dist
        found[entry.name] = Declared(entry.name, obj, dist.name if dist else "?", dist.version if dist else "?")
    return list(found.values())
