"""The package's dependency bounds match what runs: what is installed satisfies them, torch is
bounded rather than pinned (the Makefile pins it), and transformers starts at the release whose
forward takes `cache=`."""

import inspect
import re
import tomllib
from importlib.metadata import version

from conftest import ROOT
from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
RUNTIME = {Requirement(text).name: Requirement(text) for text in PYPROJECT["project"]["dependencies"]}


def test_every_installed_dependency_satisfies_its_bounds():
    for name, requirement in RUNTIME.items():
        installed = Version(version(name))
        assert requirement.specifier.contains(installed, prereleases=True), f"{name} {installed} not in {requirement}"


def test_no_runtime_dependency_is_pinned_and_torch_is_pinned_by_the_makefile():
    assert [str(r) for r in RUNTIME.values() if any(s.operator == "==" for s in r.specifier)] == []
    pinned = re.search(r"^TORCH := (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert RUNTIME["torch"].specifier.contains(pinned) and Version(version("torch")).base_version == pinned


def test_transformers_starts_where_forward_takes_cache_and_stops_below_the_next_major():
    from transformers import LlamaForCausalLM
    from transformers.modeling_outputs import CausalLMOutputWithPast

    bounds = {spec.operator: Version(spec.version) for spec in RUNTIME["transformers"].specifier}
    assert bounds == {">=": Version("5.24"), "<": Version("6")}
    assert "cache" in inspect.signature(LlamaForCausalLM.forward).parameters  # what models/sampling.py passes
    assert "cache" in CausalLMOutputWithPast.__dataclass_fields__  # what it reads back
