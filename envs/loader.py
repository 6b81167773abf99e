"""Environment configs and instances from the spec's `envs:` section."""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import Field, TypeAdapter

from envs.arith import ArithEnv, ArithEnvConfig

EnvConfig = Annotated[Union[ArithEnvConfig], Field(discriminator="kind")]
ENV_CONFIG = TypeAdapter(EnvConfig)


def make_env(name: str, config: EnvConfig) -> ArithEnv:
    if isinstance(config, ArithEnvConfig):
        return ArithEnv(config, name)
    raise TypeError(f"no environment for config {type(config).__name__}")
