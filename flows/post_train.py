"""The pipeline flow: the spec's stage DAG as Prefect tasks, cached and resumable from the store."""

from __future__ import annotations

import secrets
import time
from datetime import datetime, timezone

from prefect import flow, get_run_logger
from prefect.states import Failed

from artifacts.refs import hash_value
from artifacts.store import Store, now_iso
from flows.report_artifacts import publish_reports
from flows.spec import PipelineSpec, parse_spec, topological_order
from models.loading import base_identity
from tasks.runner import code_version, run_stage, stage_cache_key, task_folder_digest


# The stage's own timeout kills its child process and names the stage; Prefect's task timeout
# is a backstop a little later (it also covers the cache lookup and the commit).
TIMEOUT_GRACE_SECONDS = 60


def new_run_id(pipeline: str) -> str:
    return f"{pipeline}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def stage_request(spec: PipelineSpec, stage, inputs: dict[str, str], *, store: Store, run_id: str,
                  spec_hash: str) -> dict:
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
    return {"stage": stage.model_dump(), "pipeline": spec.name, "run_id": run_id, "cache_key": key,
            "model": model, "envs": envs, "inputs": inputs, "store": store.uri,
            "storage_options": spec.storage_options, "producer": producer}


def stage_tags(spec: PipelineSpec, stage) -> list[str]:
    gpus = spec.resolved(stage).gpus
    return ["posttrain", f"pipeline:{spec.name}", f"kind:{stage.kind}", "gpu" if gpus else "cpu"]


@flow(name="post-train")
def post_train(spec: dict, run_id: str, spec_hash: str, store_uri: str):
    """Run every stage in dependency order; a failed stage stops everything downstream of it."""
    logger = get_run_logger()
    pipeline = parse_spec(spec)
    store = Store(store_uri, pipeline.storage_options)
    summary = {"run_id": run_id, "pipeline": pipeline.name, "spec": spec_hash, "store": store.uri,
               "code_version": code_version(), "state": "running", "started": now_iso(), "stages": [],
               "not_run": []}
    began = time.monotonic()
    output_of: dict[str, str] = {}
    for stage in topological_order(pipeline):
        deps = [target for _, target, _ in stage.stage_refs()]
        if any(dep not in output_of for dep in deps):
            summary["not_run"].append(stage.id)
            continue
        request = stage_request(pipeline, stage, {dep: output_of[dep] for dep in deps}, store=store,
                                run_id=run_id, spec_hash=spec_hash)
        resolved = pipeline.resolved(stage)
        task = run_stage.with_options(name=f"{stage.kind}", task_run_name=stage.id, retries=resolved.retries,
                                      retry_delay_seconds=resolved.retry_delay_seconds,
                                      timeout_seconds=resolved.timeout_seconds + TIMEOUT_GRACE_SECONDS,
                                      tags=stage_tags(pipeline, stage))
        stage_began = time.monotonic()
        state = task(request, resolved.timeout_seconds, return_state=True)
        record = {"id": stage.id, "kind": stage.kind, "cache_key": request["cache_key"]}
        if state.is_completed():
            result = state.result()
            record.update(state="cached" if state.name == "Cached" else "completed", outputs=result["outputs"],
                          metrics=result["metrics"], compute_seconds=result.get("compute_seconds"))
            output_of[stage.id] = next(iter(result["outputs"].values()))
            logger.info(f"{stage.id}: {record['state']} -> {', '.join(result['outputs'].values())}")
            # cached stages too: the artifact belongs to this flow run, whose UI should show it
            publish_reports(store, pipeline.name, stage.id, result["outputs"])
        else:
            record.update(state="failed", outputs={}, metrics={}, error=_state_error(state))
            logger.error(f"{stage.id}: failed: {record['error']}")
        record["seconds"] = round(time.monotonic() - stage_began, 3)
        summary["stages"].append(record)
        store.write_json(store.path("runs", f"{run_id}.json"), summary)
    failed = [s["id"] for s in summary["stages"] if s["state"] == "failed"]
    summary.update(state="failed" if failed else "completed", finished=now_iso(),
                   seconds=round(time.monotonic() - began, 3))
    store.write_json(store.path("runs", f"{run_id}.json"), summary)
    if failed:
        return Failed(message=f"stages failed: {', '.join(failed)}", data=summary)
    return summary


def _state_error(state) -> str:
    try:
        state.result()
    except Exception as exc:  # the task's final exception
        return f"{exc}".splitlines()[0] if str(exc) else type(exc).__name__
    return state.message or state.name
