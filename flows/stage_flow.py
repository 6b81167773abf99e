"""One stage as its own flow run, for a work pool's workers to pull (spec `workers.deployment`).

The pipeline flow submits each stage to the `post-train-stage` deployment with the stage's
`gpus` as a job variable (a Kubernetes pod then requests that many `nvidia.com/gpu`); the
worker's flow run runs the same `run_stage` task, with the stage's retries and timeout, and
commits to the same store. The pipeline reads the stage's result back from the store's stage
cache index, never from Prefect's result storage.
"""

from __future__ import annotations

import os

from prefect import flow

from flows.placeholders import digest, fill_placeholders
from flows.request_signing import check_signature

from tasks.request import StageRequest
from tasks.runtime.runner import run_stage, stage_task_options


@flow(name="post-train-stage")
def stage_flow(request: dict, placeholders: list[dict] | None = None, request_digest: str | None = None,
               request_signature: str | None = None) -> dict[str, str]:
    """The stage's outputs {key: ref}, for the UI: the pipeline reads the stage's result from the store.

    `request` is a StageRequest as JSON, validated here by the worker's own code and the stage
    kinds installed on it: a typed flow parameter would make the deployment's schema pin the
    fields and kinds of whatever code ran `prefect deploy`, and the server would refuse every
    stage once they drift. `placeholders` name the strings of `request` that hold a `${VAR}` of
    the spec, filled here from the worker's environment; `request_digest` is the orchestrator's request,
    which the filled one must match (flows.placeholders). `request_signature`: the orchestrator's
    HMAC of the other three, which a worker holding POSTTRAIN_REQUEST_KEY checks first
    (flows.request_signing)."""
    check_signature(request, placeholders, request_digest, request_signature)
    request = filled_request(request, placeholders or [], request_digest)
    state = run_stage.with_options(**stage_task_options(request))(request, return_state=True)
    return state.result()["outputs"]  # a cached stage's task returns its Completed("Cached") state itself


def filled_request(payload: dict, placeholders: list[dict], expected: str | None) -> StageRequest:
    payload = fill_placeholders(payload, placeholders, os.environ)
    if expected is not None and digest(payload) != expected:
        names = sorted({name for entry in placeholders for name in entry["names"]})
        raise ValueError(f"placeholders: this worker's environment gives {', '.join(names)} other values than the "
                         "orchestrator's, so the stage would not run the config its cache key names")
    return StageRequest.model_validate(payload)
