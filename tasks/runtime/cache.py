"""The stage cache: a stage whose key already has committed outputs in the store is not run again.

key = hash(stage kind, canonical params, input refs, code version, model and env configs). The
code version hashes every package a stage can import: each top-level package of the project but
the orchestration-only ones (flows/, which no stage imports, tests/, bench/), so a new package
is covered without anyone listing it, plus the package of a stage kind that lives outside the
project (an entry point's).
"""

from __future__ import annotations

import hashlib
import importlib.util
from functools import lru_cache
from importlib.metadata import distribution
from pathlib import Path

from artifacts.refs import hash_value
from artifacts.store import Store

ROOT = Path(__file__).resolve().parents[2]
NOT_STAGE_CODE = ("flows", "tests", "bench")  # nothing a stage runs imports these (tests/test_layers.py)


@lru_cache(maxsize=1)
def code_packages() -> tuple[str, ...]:
    """The project's top-level packages a stage may import: in a checkout (a pyproject.toml beside
    them: a clone, an editable install, the worker image) every folder with an `__init__.py`, so a
    new package needs no listing; in a wheel installed into site-packages, its top_level.txt."""
    if (ROOT / "pyproject.toml").is_file():
        names = [path.name for path in ROOT.iterdir() if (path / "__init__.py").is_file()]
    else:
        names = distribution("posttrain").read_text("top_level.txt").split()
    return tuple(sorted(name for name in names if name not in NOT_STAGE_CODE))


def files_digest(folder: Path, relative_to: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `folder` (sources and shipped data alike)."""
    return {path.relative_to(relative_to).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file() and "__pycache__" not in path.parts}


@lru_cache(maxsize=1)
def code_version() -> str:
    """Hash of the source of everything a stage runs; a code change invalidates the cache."""
    sources = {}
    for package in code_packages():
        sources.update(files_digest(ROOT / package, ROOT))
    return hash_value(sources)[:16]


@lru_cache(maxsize=None)
def package_code_version(module: str) -> str | None:
    """Hash of the code of a stage or env kind that is not the project's (a package's, declared
    through an entry point): every file of `module`'s top-level package, or its module file. None
    for the project's own modules, which the code version covers. (A package's version alone
    would miss an edit of an editable install.)"""
    top = module.split(".")[0]
    if top in code_packages():
        return None
    spec = importlib.util.find_spec(top)
    if spec is None:
        raise ModuleNotFoundError(f"module {module!r} is not importable")
    if spec.submodule_search_locations:  # a package, regular or namespace (spread over folders)
        sources = {}
        for folder in map(Path, spec.submodule_search_locations):
            sources.update(files_digest(folder, folder.parent))
    else:
        origin = Path(spec.origin)
        sources = {origin.name: hashlib.sha256(origin.read_bytes()).hexdigest()}
    return hash_value(sources)[:16]


def task_folder_digest(env_config) -> str | None:
    """Hash of a user task folder's files (a changed task changes the stages that use it); None for
    envs on shipped or generated tasks, which the code version covers."""
    folder = getattr(env_config, "tasks", None)  # only the folder-based kinds have a `tasks` path
    if not isinstance(folder, str):
        return None
    return hash_value(files_digest(Path(folder), Path(folder)))


def stage_cache_key(stage, inputs: dict[str, str], context: dict) -> str:
    """key = hash(stage kind, canonical params, input refs, code version, model/env configs)."""
    code = {"project": code_version(), "kind": package_code_version(type(stage).run_module())}
    return hash_value({"kind": stage.kind, "params": stage.params(), "inputs": inputs, "code": code,
                       "context": context})[:32]


def cache_path(store: Store, key: str) -> str:
    return store.path("cache", f"{key}.json")


def cached_result(store: Store, key: str) -> dict | None:
    """The committed outputs of an earlier run of this exact stage, if all are still there."""
    path = cache_path(store, key)
    if not store.exists(path):
        return None
    entry = store.read_json(path)
    if not all(store.is_committed(ref) for ref in entry["outputs"].values()):
        return None
    return entry
