"""What a spec reads from outside the store: the sources of its dataset stages (read while the spec
is parsed, relative paths against the spec file's folder), the dataset stages its dataset envs
read rows from (an env's inline `source:` becomes such a stage) and where their reward modules are
found. Errors are `FieldError`s whose field is the whole path (`stages[0].source`,
`envs.qa.columns.prompt`); flows/spec.py prints them."""

from __future__ import annotations

from pathlib import Path

from tasks.config import FieldError


def env_inputs(env_id: str, config) -> list[tuple[str, str, str]]:
    """The stages a dataset env reads: the dataset stages of its rows, the reward_model stages of
    its learned rewards."""
    rows = [(f"envs.{env_id}.{field}", getattr(config, field), "prompts dataset")
            for field in ("data", "eval_data") if getattr(config, field, None) is not None]
    from envs.dataset import DatasetEnvConfig, RewardModelReward

    rewards = config.rewards if isinstance(config, DatasetEnvConfig) else []
    models = [(f"envs.{env_id}.rewards[{i}].reward_model", reward.reward_model, "reward model")
              for i, reward in enumerate(rewards) if isinstance(reward, RewardModelReward)]
    return rows + models


def find_reward_modules(spec, spec_dir: Path | None) -> None:
    """A dataset (or mcp) env's reward modules are looked for in the spec file's folder (None: the
    working folder) first, as its sources are."""
    from envs.dataset.config import TaskRows

    for config in spec.envs.values():
        if isinstance(config, TaskRows):
            config.find_rewards_in(spec_dir or Path.cwd())


INLINE_SOURCE = {"source": ("data", "data"), "eval_source": ("eval_data", "eval-data")}


def inline_env_stages(spec, spec_dir: Path | None, read_sources: bool) -> None:
    """A dataset env's inline `source:` (`eval_source:`) becomes the dataset stage `<env id>-data`
    (`<env id>-eval-data`) of prompts it reads, with the env's source options; its errors name the
    env's fields."""
    from tasks.stages.dataset import DatasetStage

    for env_id, config in spec.envs.items():
        for field, (target, suffix) in INLINE_SOURCE.items():
            if getattr(config, field, None) is None:
                continue
            if getattr(config, target) is not None and getattr(config, target) != f"{env_id}-{suffix}":
                raise FieldError(f"envs.{env_id}.{field}", f"give the rows as {field} or as {target}, not both")
            stage = DatasetStage(id=f"{env_id}-{suffix}", kind="dataset", format="prompts",
                                 source=getattr(config, field), split=config.split, columns=config.columns,
                                 limit=config.limit, shuffle_seed=config.shuffle_seed)
            if read_sources:
                try:
                    stage.read_sources(spec_dir, spec.store_location())
                except FieldError as exc:
                    where = field if exc.field == "source" else exc.field
                    raise FieldError(f"envs.{env_id}.{where}", exc.message) from None
            spec.stages.append(stage)
            setattr(config, target, stage.id)


def read_stage_sources(spec, spec_dir: Path | None) -> None:
    """Each stage's outside data can be read (a dataset's source and its columns)."""
    for i, stage in enumerate(spec.stages):
        if stage.sources():  # read already (an env's inline source)
            continue
        try:
            stage.read_sources(spec_dir, spec.store_location())
        except FieldError as exc:
            raise FieldError(f"stages[{i}].{exc.field}", exc.message) from None


def read_evaluation_sources(spec, spec_dir: Path | None) -> None:
    """The task folder of the spec's `evaluation.lm_eval.include_path` can be read (relative to the spec's folder)."""
    try:
        spec.evaluation.read_benchmark_sources(spec_dir, spec.store_location())
    except FieldError as exc:
        raise FieldError(f"evaluation.{exc.field}", exc.message) from None
