"""Env kinds: each env class names its pydantic config; packages add kinds through the
`posttrain.envs` entry points, and a broken one is a one-line error."""

import os
import subprocess
from typing import Literal

import pytest
from conftest import POSTTRAIN, ROOT
from pydantic import BaseModel
from toy_env import ECHO_MODULE
from toy_stage import write_package

from envs.arith import ArithEnv
from envs.base import EnvKindError
from envs.loader import BUILTIN_ENVS, ENV_KINDS, check_env_class, env_package


def test_every_builtin_env_kind_passes_the_package_check():
    for env_class in BUILTIN_ENVS:
        check_env_class(env_class, env_class.config_class.model_fields["kind"].annotation.__args__[0])
    assert ENV_KINDS == ("arith", "calc", "search", "cod", "openclaw", "rlm", "terminal", "dataset", "mcp")
    assert env_package(ArithEnv.config_class(kind="arith")) is None  # built in: the code version covers it


def test_a_wrong_env_class_names_what_is_wrong():
    class NoConfig:
        pass

    class Other(BaseModel):
        kind: Literal["other"]

    class Misnamed:
        config_class = Other

    class Echo(BaseModel):
        kind: Literal["echo"]

    class Partial:
        config_class = Echo
        max_turns = 1

        def tasks(self, split, n, seed):
            return []

    cases = [(NoConfig, "echo", "does not name its pydantic config as `config_class`"),
             (Misnamed, "echo", "env kind 'echo': Other needs the field `kind: Literal['echo']`"),
             (Partial, "echo", "env kind 'echo': Partial lacks all_tasks, start, oracle_actions, reference_completion, "
                               "is_correct, is_formatted, action_stop, restarts_context, pays_per_step (envs/base.py)")]
    for env_class, name, message in cases:
        with pytest.raises(EnvKindError) as error:
            check_env_class(env_class, name)
        assert message in str(error.value)


def envs_list(packages) -> subprocess.CompletedProcess:
    """`posttrain envs list` with the packages of folder `packages` installed (on the path)."""
    return subprocess.run([POSTTRAIN, "envs", "list"], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(packages)})


def test_a_broken_env_package_is_one_line(tmp_path):
    broken = write_package(tmp_path / "broken", "echo_env", ECHO_MODULE.replace("from envs.base", "from envs.nowhere"),
                           "[posttrain.envs]\necho = echo_env:EchoEnv\n")
    listed = envs_list(broken)
    assert listed.returncode == 2 and listed.stderr == (
        "error: env kind 'echo' (entry point echo = echo_env:EchoEnv) fails to load: "
        "ModuleNotFoundError: No module named 'envs.nowhere'\n")


def test_a_package_envs_release_changes_the_keys_of_the_stages_that_name_it(monkeypatch):
    from envs import loader
    from flows.spec import load_spec
    from flows.stage_requests import stage_request

    spec, _ = load_spec(ROOT / "pipelines" / "quickstart.yaml")
    warmup, sft = spec.stage("warmup"), spec.stage("sft")

    def keys() -> tuple[str, str]:
        requests = [stage_request(spec, stage, inputs, store=spec.store_location(), run_id="r", spec_hash=None)
                    for stage, inputs in ((warmup, {}), (sft, {"warmup": "quickstart/warmup@" + "0" * 16}))]
        return requests[0].cache_key, requests[1].cache_key

    built_in = keys()
    for version in ("0.3.0", "0.3.1"):  # arith as if a package had declared it
        monkeypatch.setitem(loader.ENV_KINDS_BY_NAME, "arith", loader.EnvKind(ArithEnv, "arith-env", version))
        assert env_package(ArithEnv.config_class(kind="arith")) == f"arith-env {version}"
        released = keys()
        assert released[0] != built_in[0] and released[1] == built_in[1]  # sft names no env
        built_in = released


def test_a_package_that_takes_a_builtin_kinds_name_is_one_line(tmp_path):
    clash = write_package(tmp_path / "clash", "echo_env", ECHO_MODULE.replace('Literal["echo"]', 'Literal["arith"]'),
                          "[posttrain.envs]\narith = echo_env:EchoEnv\n")
    listed = envs_list(clash)
    assert listed.returncode == 2 and listed.stderr == (
        "error: env kind 'arith' is declared twice: entry point arith = echo_env:EchoEnv and envs.arith.ArithEnv\n")
