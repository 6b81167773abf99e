"""Environment configs and instances from the spec's `envs:` section."""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import Field, TypeAdapter

from envs.arith import ArithEnv, ArithEnvConfig
from envs.calc import CalcEnv, CalcEnvConfig

EnvConfig = Annotated[Union[ArithEnvConfig, CalcEnvConfig], Field(discriminator="kind")]
ENV_CONFIG = TypeAdapter(EnvConfig)
ENV_KINDS = ("arith", "calc")


def make_env(name: str, config: EnvConfig) -> ArithEnv | CalcEnv:
    if isinstance(config, ArithEnvConfig):
        return ArithEnv(config, name)
    if isinstance(config, CalcEnvConfig):
        return CalcEnv(config, name)
    raise TypeError(f"no environment for config {type(config).__name__}")
