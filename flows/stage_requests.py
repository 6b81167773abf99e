"""What the orchestrator hands a stage (its request, resolved once from the spec: config, inputs,
cache key, provenance, orchestration settings) and what it reads of the stage's final state."""

from __future__ import annotations

import secrets
from datetime import datetime, timezone

from artifacts.refs import hash_value
from artifacts.store import StoreLocation
from envs.loader import env_package
from flows.spec import PipelineSpec
from models.loading import base_identity
from tasks.request import Producer, StageRequest
from tasks.runtime.cache import code_version, package_code_version, stage_cache_key, task_folder_digest


def stage_request(spec: PipelineSpec, stage, inputs: dict[str, str], *, store: StoreLocation, run_id: str,
                  spec_hash: str | None, output_name: str | None = None) -> StageRequest:
    """The request `tasks.runtime.runner.run_stage` runs; `output_name` renames its primary output
    (default `<pipeline>/<stage id>`)."""
    env_ids = [env_id for _, env_id in stage.env_refs()]
    envs = {env_id: spec.envs[env_id] for env_id in env_ids}
    base = base_identity(spec.model.base)
    context = {"model": spec.model.model_dump(), "base": base,
               "envs": {env_id: config.model_dump() for env_id, config in envs.items()},
               "env_data": {env_id: task_folder_digest(config) for env_id, config in envs.items()},
               "env_code": {env_id: env_code(config) for env_id, config in envs.items()}}
    key = stage_cache_key(stage, inputs, context)
    producer = Producer(pipeline=spec.name, run_id=run_id, stage_id=stage.id, stage_kind=stage.kind,
                        config_hash=hash_value(stage.params())[:16], code_version=code_version(), cache_key=key,
                        spec=spec_hash, base_model=base if stage.reads_base_model() else None)
    return StageRequest(stage=stage, pipeline=spec.name, run_id=run_id, cache_key=key, model=spec.model, envs=envs,
                        inputs=inputs, store=store, producer=producer, orchestration=spec.resolved(stage),
                        evaluate_new_checkpoints=spec.evaluation.on_new_checkpoint, output_name=output_name)


def env_code(config) -> dict | None:
    """What identifies a package's env kind in cache keys: its distribution and version, and the hash
    of its code; None for a built-in kind (the code version covers it)."""
    package = env_package(config)
    if package is None:
        return None
    return {"package": package, "code": package_code_version(type(config).__module__)}


def new_run_id(prefix: str) -> str:
    """`<prefix>-<UTC time>-<4 hex>`: a pipeline run's id (prefix: the pipeline) or an evaluation's (`eval`)."""
    return f"{prefix}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def state_error(state) -> str:
    """One line for a failed task's or flow's state: its final exception's first line."""
    try:
        state.result()
    except Exception as exc:  # the run's final exception
        return f"{exc}".splitlines()[0] if str(exc) else type(exc).__name__
    return state.message or state.name
