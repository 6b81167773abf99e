"""Environment configs and instances from the spec's `envs:` section."""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import Field, TypeAdapter

from envs.arith import ArithEnv, ArithEnvConfig
from envs.calc import CalcEnv, CalcEnvConfig
from envs.cod import CodEnv, CodEnvConfig
from envs.openclaw import OpenClawEnv, OpenClawEnvConfig
from envs.rlm import RlmEnv, RlmEnvConfig
from envs.search import SearchEnv, SearchEnvConfig
from envs.terminal import TerminalEnv, TerminalEnvConfig

ENV_CLASSES = {ArithEnvConfig: ArithEnv, CalcEnvConfig: CalcEnv, SearchEnvConfig: SearchEnv, CodEnvConfig: CodEnv,
               OpenClawEnvConfig: OpenClawEnv, RlmEnvConfig: RlmEnv,
               TerminalEnvConfig: TerminalEnv}
EnvConfig = Annotated[Union[tuple(ENV_CLASSES)], Field(discriminator="kind")]
ENV_CONFIG = TypeAdapter(EnvConfig)
ENV_KINDS = tuple(config.model_fields["kind"].annotation.__args__[0] for config in ENV_CLASSES)


def make_env(name: str, config: EnvConfig):
    """The environment of a config (its id in the spec is `name`)."""
    return ENV_CLASSES[type(config)](config, name)

