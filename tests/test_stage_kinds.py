"""Stage kinds: each declares itself on its config class, and everything the orchestrator needs
about a kind is read from there; packages add kinds through the `posttrain.stages` entry points."""

import os
import subprocess
from typing import Literal

import pytest
import yaml
from conftest import POSTTRAIN, ROOT
from toy_stage import TOY_MODULE, write_package, write_toy_stage

from tasks.config import StageBase, StageKindError
from tasks.kinds import BUILTIN_KINDS, STAGE_KINDS, check_declaration, warm_modules
from tasks.runtime.cache import code_packages, package_code_version


def test_every_builtin_kind_declares_itself_completely():
    assert list(STAGE_KINDS) == ["dataset", "synthesize", "generate", "sft", "preference", "reward_model", "rl",
                                 "distill", "evaluate"]
    for config in BUILTIN_KINDS:
        check_declaration(config, config.kind_name())
        assert config.run_module() == f"tasks.stages.{config.kind_name()}"
        assert config.run_module() in warm_modules()
    produced = {name: (config.primary, config.produces) for name, config in STAGE_KINDS.items()}
    assert produced == {"dataset": ("dataset", "dataset"), "synthesize": ("dataset", "dataset"), "generate": ("rollouts", "rollouts"),
                        "sft": ("checkpoint", "checkpoint"), "preference": ("checkpoint", "checkpoint"),
                        "reward_model": ("checkpoint", "reward model"), "rl": ("checkpoint", "checkpoint"), "distill": ("checkpoint", "checkpoint"),
                        "evaluate": ("results", "evaluation")}


def test_a_wrong_declaration_names_what_is_wrong():
    class NoKind(StageBase):
        outputs, primary, produces = ("dataset",), "dataset", "dataset"

    class Undeclared(StageBase):
        kind: Literal["half"]

    class WrongPrimary(StageBase):
        outputs, primary, produces = ("dataset",), "report", "dataset"
        kind: Literal["wrong"]

    class Incomplete(StageBase):
        outputs, primary, produces = ("dataset",), "dataset", "dataset"
        kind: Literal["incomplete"]
        rows: "RowsNobodyDefined"  # noqa: F821

    cases = [(dict, "x", "stage kind 'x': <class 'dict'> is not a subclass of tasks.config.StageBase"),
             (NoKind, "none", "stage kind 'none': NoKind needs the field `kind: Literal['none']`"),
             (Undeclared, "half", "stage kind 'half': Undeclared does not declare outputs, primary, produces"),
             (WrongPrimary, "wrong", "stage kind 'wrong': primary output 'report' is not among its outputs "
                                     "('dataset',)"),
             (Incomplete, "incomplete", "stage kind 'incomplete': Incomplete is not a complete pydantic model: "
                                        "PydanticUndefinedAnnotation: name 'RowsNobodyDefined' is not defined")]
    for config, name, message in cases:
        with pytest.raises(StageKindError) as error:
            check_declaration(config, name)
        assert str(error.value) == message


def validate(spec_path, plugins) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(plugins)}
    return subprocess.run([POSTTRAIN, "validate", str(spec_path)], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=120)


def sums_spec(tmp_path):
    spec = {"name": "plugin", "envs": {"arith": {"kind": "arith"}},
            "stages": [{"id": "sums", "kind": "sums", "n": 8}, {"id": "sft", "kind": "sft", "data": "sums"}]}
    path = tmp_path / "plugin.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_packages_kind_validates_and_a_broken_one_is_one_line(tmp_path):
    spec = sums_spec(tmp_path)
    shown = validate(spec, write_toy_stage(tmp_path / "good"))
    assert shown.returncode == 0, shown.stderr
    assert "sums           sums" in shown.stdout and "sft            sft         <- sums" in shown.stdout

    without = validate(spec, tmp_path / "nothing")
    assert without.returncode == 2
    assert without.stderr.startswith("error: stages[0].kind: unknown kind 'sums' (expected one of 'dataset', 'synthesize'")

    broken = write_package(tmp_path / "broken", "toy_broken", "import not_installed_anywhere\n",
                           "[posttrain.stages]\nbroken = toy_broken:BrokenStage\n")
    failed = validate(spec, broken)
    assert failed.returncode == 2 and failed.stderr == (
        "error: stage kind 'broken' (entry point broken = toy_broken:BrokenStage) fails to load: "
        "ModuleNotFoundError: No module named 'not_installed_anywhere'\n")

    renamed = write_package(tmp_path / "renamed", "toy_sums", TOY_MODULE, "[posttrain.stages]\nsum = toy_sums:SumsStage\n")
    misnamed = validate(spec, renamed)
    assert misnamed.returncode == 2 and misnamed.stderr == (
        "error: stage kind 'sum': SumsStage needs the field `kind: Literal['sum']`\n")


def test_the_code_version_covers_every_stage_package_and_a_packages_kind(tmp_path, monkeypatch):
    assert code_packages() == ("artifacts", "data_contracts", "envs", "models", "tasks")
    assert package_code_version("tasks.stages.sft") is None  # the project's code version covers it
    plugins = write_toy_stage(tmp_path / "site")
    (plugins / "toy_single.py").write_text(TOY_MODULE)  # a kind in a module of its own, no package
    monkeypatch.syspath_prepend(str(plugins))
    package, single = package_code_version.__wrapped__("toy_sums"), package_code_version.__wrapped__("toy_single")
    assert len(package) == len(single) == 16
    (plugins / "toy_sums" / "__init__.py").write_text(TOY_MODULE + "\n# changed\n")
    (plugins / "toy_single.py").write_text(TOY_MODULE + "\n# changed\n")
    # an edit of the package's code: new cache keys for its stages
    assert package_code_version.__wrapped__("toy_sums") != package
    assert package_code_version.__wrapped__("toy_single") != single
