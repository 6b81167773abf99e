"""Rollout backends: where a stage's episodes decode (`rollout:` of generate, evaluate and rl).

The built-in ones and those packages declare in the entry-point group `posttrain.rollouts`
(`NAME = "package.module:ConfigClass"`, NAME being the class's `backend` literal), as stage kinds are
declared (tasks/kinds.py). The spec's `rollout:` union is derived from them, chosen by `backend`
(default `local`). What a backend implements: tasks/rollout/backends/base.py and docs/EXTENDING.md.
"""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import Discriminator, Tag

from envs.plugins import declared
from tasks.rollout.backends.base import RolloutBackend, RolloutBackendError
from tasks.rollout.backends.local import LocalRollout
from tasks.rollout.backends.server import ServerRollout

ENTRY_POINT_GROUP = "posttrain.rollouts"
BUILTIN_BACKENDS = (LocalRollout, ServerRollout)
DEFAULT_BACKEND = "local"

__all__ = ["BUILTIN_BACKENDS", "ROLLOUT_BACKENDS", "LocalRollout", "Rollout", "RolloutBackend", "ServerRollout"]


def check_declaration(config: type, name: str) -> None:
    """A backend's config class must be a RolloutBackend whose `backend` literal is its name, and a
    complete pydantic model."""
    if not (isinstance(config, type) and issubclass(config, RolloutBackend)):
        raise RolloutBackendError(f"rollout backend {name!r}: {config!r} is not a subclass of "
                                  "tasks.rollout.backends.RolloutBackend")
    field = config.model_fields.get("backend")
    if field is None or getattr(field.annotation, "__args__", (None,)) != (name,):
        raise RolloutBackendError(f"rollout backend {name!r}: {config.__name__} needs the field "
                                  f"`backend: Literal[{name!r}]`")
    try:
        config.model_rebuild(force=True)
    except Exception as exc:
        raise RolloutBackendError(f"rollout backend {name!r}: {config.__name__} is not a complete pydantic "
                                  f"model: {type(exc).__name__}: {exc}".splitlines()[0]) from None


def _all_backends() -> dict[str, type[RolloutBackend]]:
    backends = {config.backend_name(): config for config in BUILTIN_BACKENDS}
    for package_backend in declared(ENTRY_POINT_GROUP, "rollout backend", RolloutBackendError, backends,
                                    check_declaration):
        backends[package_backend.name] = package_backend.obj
    return backends


ROLLOUT_BACKENDS: dict[str, type[RolloutBackend]] = _all_backends()


def backend_of(data) -> str | None:
    """The variant a `rollout:` mapping (or config) names, `local` when it names none; None for
    anything else (pydantic then refuses it)."""
    if isinstance(data, dict):
        return data.get("backend", DEFAULT_BACKEND)
    return data.backend if isinstance(data, RolloutBackend) else None


Rollout = Annotated[Union[tuple(Annotated[config, Tag(name)] for name, config in ROLLOUT_BACKENDS.items())],
                    Discriminator(backend_of)]
"""The `rollout:` field's type: one of the registered backends, chosen by `backend`."""
