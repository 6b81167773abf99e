"""A dataset env's reward functions: a user's module imported from the spec's folder (or installed),
and a TRL-style batch function as one of the rubric's per-completion functions."""

from __future__ import annotations

import importlib
import sys
from importlib.machinery import PathFinder
from pathlib import Path, PurePath

from envs.base import Outcome, RewardFunc, RewardShapeError, Task
from envs.dataset.config import RewardConfig


def load_function(reward: RewardConfig, spec_folder: Path | None = None):
    """The reward function a spec names; ValueError (one line) when it does not import or is not
    callable."""
    module = import_reward_module(reward, spec_folder)
    fn = getattr(module, reward.name, None)
    if not callable(fn):
        raise ValueError(f"{reward.function}: {reward.module} has no function {reward.name}")
    return fn


# the top-level names this process imported from a spec's folder (another spec's module of that name replaces one)
FROM_SPEC_FOLDERS: set[str] = set()


def import_reward_module(reward: RewardConfig, spec_folder: Path | None):
    """A function reward's module: from its folder (`RewardConfig.module_folder`) when it is there,
    else (a module name) from the import path: installed packages, the built-ins, and in a stage's
    process (`spec_folder` None) the modules its request carried."""
    folder = reward.module_folder(spec_folder) if spec_folder is not None else None
    importlib.invalidate_caches()
    local = folder is not None and module_files(reward.module, folder) is not None
    if local:
        make_room(reward.module, folder)
    try:
        if local:
            return import_from(reward.module, folder)
        if folder is None or not reward.names_file:  # a named file is only ever its folder's
            return importlib.import_module(reward.module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (reward.module + ".").startswith(exc.name + "."):
            raise ValueError(cannot_import(reward, exc)) from None  # a module it imports is missing
    except Exception as exc:  # the user's module: any error of its import is its own
        raise ValueError(cannot_import(reward, exc)) from None
    if folder is None:
        raise ValueError(f"module {reward.module!r} not found on the import path")
    if reward.names_file:
        raise ValueError(f"no file {folder / PurePath(reward.written_module).name}")
    raise ValueError(f"module {reward.module!r} not found in {folder}, nor installed")


def cannot_import(reward: RewardConfig, exc: Exception) -> str:
    return f"{reward.function}: cannot import {reward.module} ({type(exc).__name__}: {exc})".splitlines()[0]


def module_files(module: str, folder: Path) -> list[Path] | None:
    """The source files of `module` in `folder` (its packages' __init__.py, then its own file); None
    when it is not there."""
    *packages, name = module.split(".")
    files, here = [], folder
    for package in packages:
        here = here / package
        if not here.is_dir():
            return None
        files += [here / "__init__.py"] if (here / "__init__.py").is_file() else []  # else a namespace package
    own = here / name / "__init__.py" if (here / name).is_dir() else here / f"{name}.py"
    return [*files, own] if own.is_file() else None


def make_room(module: str, folder: Path) -> None:
    """Forget a module of `module`'s top-level name that another spec's folder gave this process; refuse
    one imported from anywhere else (a package, the project)."""
    top = module.split(".")[0]
    loaded = sys.modules.get(top)
    if loaded is None or loaded_from(loaded, PathFinder.find_spec(top, [str(folder)])):
        return
    if top not in FROM_SPEC_FOLDERS:
        raise ValueError(f"module {top!r} in {folder} has the name of a module imported from "
                         f"{getattr(loaded, '__file__', None) or 'elsewhere'}: rename it")
    for name in [name for name in sys.modules if name == top or name.startswith(top + ".")]:
        del sys.modules[name]


def import_from(module: str, folder: Path):
    """`module` imported from `folder` (first on the import path meanwhile); the folder stays at the
    end of the import path, for the module's own later imports."""
    sys.path.insert(0, str(folder))
    try:
        imported = importlib.import_module(module)
    finally:
        sys.path.remove(str(folder))
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
    FROM_SPEC_FOLDERS.add(module.split(".")[0])
    return imported


def loaded_from(module, found) -> bool:
    """Whether an imported module is the one `found` (a module spec) describes."""
    return (getattr(module, "__file__", None), list(getattr(module, "__path__", []))) == \
        (found.origin if found.has_location else None, list(found.submodule_search_locations or []))


def trl_reward(reward: RewardConfig, fn) -> RewardFunc:
    """A TRL-style batch function as one of the rubric's per-completion functions: called with one
    completion, its prompt and ids, and the row's extra columns; None (does not apply) passes on."""
    def score(completion: str, task: Task, outcome: Outcome, completion_ids=None):
        conversational = isinstance(task.info.get("prompt_turns"), list)
        prompt = task.info["prompt_turns"] if conversational else task.prompt
        answer = [{"role": "assistant", "content": completion}] if conversational else completion
        values = fn(prompts=[prompt], completions=[answer], completion_ids=[completion_ids],
                    **{column: [value] for column, value in task.info["columns"].items()})
        if not isinstance(values, (list, tuple)) or len(values) != 1:
            raise RewardShapeError(f"reward function {reward.function} returned "
                             f"{len(values) if isinstance(values, (list, tuple)) else type(values).__name__} "
                             "values for 1 completion")
        return None if values[0] is None else float(values[0])

    return RewardFunc(reward.name, score, reward.weight, with_ids=True)
