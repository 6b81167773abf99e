"""The env kinds: the built-in ones and those packages declare in the entry-point group
`posttrain.envs` (`NAME = "package.module:EnvClass"`, NAME being its config's `kind`). An env
class names its pydantic config as `config_class`; the spec's `envs:` union is built from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Union

from pydantic import BaseModel, Field, TypeAdapter

from envs.arith import ArithEnv
from envs.base import EnvKindError
from envs.calc import CalcEnv
from envs.cod import CodEnv
from envs.dataset import DatasetEnv
from envs.mcp import McpEnv
from envs.openclaw import OpenClawEnv
from envs.plugins import declared
from envs.rlm import RlmEnv
from envs.search import SearchEnv
from envs.terminal import TerminalEnv

ENTRY_POINT_GROUP = "posttrain.envs"
BUILTIN_ENVS = (ArithEnv, CalcEnv, SearchEnv, CodEnv, OpenClawEnv, RlmEnv, TerminalEnv, DatasetEnv, McpEnv)
# what the rollout loop, the stages and the spec check use of an env class (envs/base.Environment;
# `name`, `rubric` and `max_turns` may be set per instance, from the config)
PROTOCOL = ("tasks", "all_tasks", "start", "oracle_actions", "reference_completion", "is_correct", "is_formatted",
            "action_stop", "restarts_context", "pays_per_step")


@dataclass(frozen=True)
class EnvKind:
    env_class: type
    package: str | None = None  # the distribution that declared it (None: built in)
    version: str | None = None

    @property
    def source(self) -> str:
        return "built-in" if self.package is None else f"{self.package} {self.version}"


def check_env_class(env_class, name: str) -> None:
    """A package's env class must name a pydantic config whose `kind` is `name` and carry the protocol."""
    config = getattr(env_class, "config_class", None)
    if not (isinstance(config, type) and issubclass(config, BaseModel)):
        raise EnvKindError(f"env kind {name!r}: {env_class!r} does not name its pydantic config as `config_class`")
    kind = config.model_fields.get("kind")
    if kind is None or getattr(kind.annotation, "__args__", (None,)) != (name,):
        raise EnvKindError(f"env kind {name!r}: {config.__name__} needs the field `kind: Literal[{name!r}]`")
    missing = [attr for attr in PROTOCOL if not hasattr(env_class, attr)]
    if missing:
        raise EnvKindError(f"env kind {name!r}: {env_class.__name__} lacks {', '.join(missing)} (envs/base.py)")


def _all_kinds() -> dict[str, EnvKind]:
    builtin = {env.config_class.model_fields["kind"].annotation.__args__[0]: env for env in BUILTIN_ENVS}
    packages = declared(ENTRY_POINT_GROUP, "env kind", EnvKindError, builtin, check_env_class)
    return {**{name: EnvKind(env) for name, env in builtin.items()},
            **{kind.name: EnvKind(kind.obj, kind.package, kind.version) for kind in packages}}


ENV_KINDS_BY_NAME: dict[str, EnvKind] = _all_kinds()
ENV_CLASSES = {kind.env_class.config_class: kind.env_class for kind in ENV_KINDS_BY_NAME.values()}
EnvConfig = Annotated[Union[tuple(ENV_CLASSES)], Field(discriminator="kind")]
ENV_CONFIG = TypeAdapter(EnvConfig)
ENV_KINDS = tuple(ENV_KINDS_BY_NAME)


def make_env(name: str, config: EnvConfig):
    """The environment of a config (its id in the spec is `name`)."""
    return ENV_CLASSES[type(config)](config, name)


def env_package(config) -> str | None:
    """`<distribution> <version>` of the package an env config's kind comes from; None if built in."""
    kind = ENV_KINDS_BY_NAME[config.kind]
    return None if kind.package is None else kind.source
