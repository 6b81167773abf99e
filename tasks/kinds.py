"""The stage kinds: the built-in ones and those packages declare in the entry-point group
`posttrain.stages` (`NAME = "package.module:ConfigClass"`, NAME being the class's `kind`).

Everything else about a kind is read off its config class (tasks/config.StageBase): the spec's
`stages:` union, what its child process runs and preloads, its outputs and which is primary,
what the spec's graph sees it produce, its cross-stage rules. Adding a kind = a module with its
config class and its `run(stage, ctx)`, plus one line here or one entry point.
"""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import Field, TypeAdapter

from envs.plugins import declared
from tasks.config import StageBase, StageKindError
from tasks.stages.dataset import DatasetStage
from tasks.stages.distill import DistillStage
from tasks.stages.evaluate import EvaluateStage
from tasks.stages.generate import GenerateStage
from tasks.stages.preference import PreferenceStage
from tasks.stages.reward_model import RewardModelStage
from tasks.stages.rl import RlStage
from tasks.stages.sft import SftStage
from tasks.stages.synthesize import SynthesizeStage

ENTRY_POINT_GROUP = "posttrain.stages"
BUILTIN_KINDS = (DatasetStage, SynthesizeStage, GenerateStage, SftStage, PreferenceStage, RewardModelStage, RlStage,
                 DistillStage, EvaluateStage)
# what every stage process imports, whatever its kind (~6 s on this 2-core machine: the warm fork
# server imports it once per orchestrator, tasks/runtime/launch.py)
BASE_PRELOAD = ("torch", "transformers", "great_expectations", "tasks.runtime.child")
LORA_PRELOAD = ("peft",)  # needed only where a model has adapters


def check_declaration(config: type, name: str) -> None:
    """A kind's config class must be a StageBase with a `kind` literal equal to its name and a
    complete declaration (outputs, primary among them, produces)."""
    if not (isinstance(config, type) and issubclass(config, StageBase)):
        raise StageKindError(f"stage kind {name!r}: {config!r} is not a subclass of tasks.config.StageBase")
    kind = config.model_fields.get("kind")
    if kind is None or getattr(kind.annotation, "__args__", (None,)) != (name,):
        raise StageKindError(f"stage kind {name!r}: {config.__name__} needs the field `kind: Literal[{name!r}]`")
    missing = [attr for attr in ("outputs", "primary", "produces") if not hasattr(config, attr)]
    if missing:
        raise StageKindError(f"stage kind {name!r}: {config.__name__} does not declare {', '.join(missing)}")
    if config.primary not in config.outputs:
        raise StageKindError(f"stage kind {name!r}: primary output {config.primary!r} is not among its "
                             f"outputs {config.outputs}")
    try:
        config.model_rebuild(force=True)  # a class pydantic cannot complete fails here, not in a spec
    except Exception as exc:
        raise StageKindError(f"stage kind {name!r}: {config.__name__} is not a complete pydantic model: "
                             f"{type(exc).__name__}: {exc}".splitlines()[0]) from None


def _all_kinds() -> dict[str, type]:
    kinds = {config.kind_name(): config for config in BUILTIN_KINDS}
    for package_kind in declared(ENTRY_POINT_GROUP, "stage kind", StageKindError, kinds, check_declaration):
        kinds[package_kind.name] = package_kind.obj
    return kinds


STAGE_KINDS: dict[str, type] = _all_kinds()
StageConfig = Annotated[Union[tuple(STAGE_KINDS.values())], Field(discriminator="kind")]
STAGE_CONFIG = TypeAdapter(StageConfig)


def produces(kind: str) -> str | None:
    """What a kind's primary output is to the spec's graph; None for a kind not installed here (a
    manifest or run summary written where a package's kind was)."""
    config = STAGE_KINDS.get(kind)
    return config.produces if config is not None else None


def warm_modules(lora: bool = True) -> list[str]:
    """What the warm fork server imports: the base set, then each kind's module and preloads;
    without `lora` (a run whose model has no adapters), not peft, ~2 s of the ~9 (a stage that
    loads an adapter after all imports it itself)."""
    modules = list(BASE_PRELOAD)
    for config in STAGE_KINDS.values():
        modules += [module for module in (*config.preload, config.run_module())
                    if module not in modules and (lora or module not in LORA_PRELOAD)]
    return modules
