"""What the orchestrator hands a stage (its request: config, inputs, cache key, provenance; its
task options and tags) and what it reads of the stage's final state."""

from __future__ import annotations

import secrets
from datetime import datetime, timezone

from artifacts.refs import hash_value
from artifacts.store import Store
from flows.spec import PipelineSpec
from models.loading import base_identity
from tasks.runner import code_version, stage_cache_key, task_folder_digest


def stage_request(spec: PipelineSpec, stage, inputs: dict[str, str], *, store: Store, run_id: str,
                  spec_hash: str, output_name: str | None = None) -> dict:
    """The request `tasks.runner.run_stage` runs; `output_name` renames its primary output
    (default `<pipeline>/<stage id>`)."""
    env_ids = [env_id for _, env_id in stage.env_refs()]
    envs = {env_id: spec.envs[env_id].model_dump() for env_id in env_ids}
    model = spec.model.model_dump()
    context = {"model": model, "base": base_identity(spec.model.base), "envs": envs,
               "env_data": {env_id: task_folder_digest(spec.envs[env_id]) for env_id in env_ids}}
    key = stage_cache_key(stage.kind, stage.params(), inputs, context)
    producer = {"pipeline": spec.name, "run_id": run_id, "stage_id": stage.id, "stage_kind": stage.kind,
                "config_hash": hash_value(stage.params())[:16], "code_version": code_version(),
                "cache_key": key, "spec": spec_hash}
    if stage.reads_base_model():
        producer["base_model"] = context["base"]
    request = {"stage": stage.model_dump(), "pipeline": spec.name, "run_id": run_id, "cache_key": key,
               "model": model, "envs": envs, "inputs": inputs, "store": store.uri,
               "storage_options": spec.storage_options, "producer": producer, "gpus": spec.resolved(stage).gpus,
               "evaluate_new_checkpoints": spec.evaluation.on_new_checkpoint}
    if output_name is not None:
        request["output_name"] = output_name
    return request


def stage_tags(spec: PipelineSpec, stage) -> list[str]:
    gpus = spec.resolved(stage).gpus
    return ["posttrain", f"pipeline:{spec.name}", f"kind:{stage.kind}", "gpu" if gpus else "cpu"]


# The stage's own timeout kills its child process and names the stage; Prefect's task timeout
# is a backstop a little later (it also covers the cache lookup and the commit).
TIMEOUT_GRACE_SECONDS = 60


def stage_task_options(spec: PipelineSpec, stage, task_run_name: str) -> dict:
    """`run_stage.with_options(...)` for this stage: its retries, delay, timeout (+ grace) and tags."""
    resolved = spec.resolved(stage)
    return {"name": stage.kind, "task_run_name": task_run_name, "retries": resolved.retries,
            "retry_delay_seconds": resolved.retry_delay_seconds,
            "timeout_seconds": resolved.timeout_seconds + TIMEOUT_GRACE_SECONDS, "tags": stage_tags(spec, stage)}


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
