"""Prefect events for new checkpoints: `posttrain.checkpoint.created`.

The event's resource is the checkpoint (`posttrain.checkpoint.<name>@<version>`) with labels a
trigger can match on (pipeline, stage, whether the spec asks for evaluation); the payload
holds what an evaluation needs to find it: the ref, the store URI and its options (neither
can hold credentials: the store refuses them) and the spec it came from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tasks.request import StageRequest

CHECKPOINT_CREATED = "posttrain.checkpoint.created"
RESOURCE_PREFIX = "posttrain.checkpoint."


def checkpoint_resource_id(ref: str) -> str:
    return f"{RESOURCE_PREFIX}{ref}"


def checkpoint_event(ref: str, request: StageRequest, step: int | None) -> dict:
    """The keyword arguments of `emit_event` for checkpoint `ref` committed by the stage of `request`."""
    stage_id = request.stage.id
    resource = {"prefect.resource.id": checkpoint_resource_id(ref), "prefect.resource.name": ref,
                "posttrain.pipeline": request.pipeline, "posttrain.stage": stage_id,
                "posttrain.evaluate": "true" if request.evaluate_new_checkpoints else "false"}
    payload = {"ref": ref, "store": request.store.uri, "storage_options": request.store.options,
               "pipeline": request.pipeline, "stage": stage_id, "step": step,
               "run_id": request.run_id, "spec": request.producer.spec}
    return {"event": CHECKPOINT_CREATED, "resource": resource, "payload": payload}


def emit_checkpoint_created(ref: str, request: StageRequest, step: int | None) -> None:
    from prefect.events import emit_event

    emit_event(**checkpoint_event(ref, request, step))
