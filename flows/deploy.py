"""Job variables for a stage's flow run, and the job a work pool's base job template makes of them.

A stage submitted as a flow run of `post-train-stage/<name>` carries job variables; the worker of
the GPU work pool renders its base job template with them (deployments/k8s-gpu-job-template.json
on Kubernetes: `gpus` -> the container's `nvidia.com/gpu` limit). `render_job_template` runs
that same Prefect code path here, so what a pod will request can be checked without a cluster.

Light on purpose: no torch, no Great Expectations; Prefect's worker classes load on first use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tasks.config import Defaults

K8S_GPU_JOB_TEMPLATE = Path(__file__).resolve().parent.parent / "deployments" / "k8s-gpu-job-template.json"

# Used only when no PREFECT_API_URL is set: rendering a template needs the API only for
# `{{ prefect.variables.* }}` placeholders and block document references (`.invalid` never resolves).
_NO_API = "http://prefect-api.invalid/api"


def stage_job_variables(settings: Defaults) -> dict[str, Any]:
    """Flow-run job variables for one stage from its resolved settings (its request's
    `orchestration`): its GPU count (the stage's, else the spec default).

    Only `gpus`: placement (node_selector, tolerations), image and resources stay with the work
    pool and the deployment, since flow-run job variables replace theirs key by key.
    """
    return {"gpus": settings.gpus}


def load_job_template(path: str | Path = K8S_GPU_JOB_TEMPLATE) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def render_job_template(template: dict[str, Any], job_variables: dict[str, Any] | None = None, *,
                        worker_type: str = "kubernetes", flow_run_name: str | None = None) -> dict[str, Any]:
    """The job configuration a `worker_type` worker builds from `template` and `job_variables`.

    `job_variables` are the deployment's and the flow run's merged as the worker merges them (the
    flow run's replace the deployment's key by key; `env` is merged).

    Same code as the worker: its job configuration class's `from_template_and_values` (the
    variables' defaults overlaid by the job variables, placeholders applied; a placeholder whose
    value is unset or null-by-default drops its key). With `flow_run_name`, also the worker's
    `prepare_for_flow_run` for a flow run of that name, so `job_manifest` is the body the worker
    submits (env as a list of name/value, labels, image and command filled in; the env includes
    the Prefect settings of this process, as a worker's would).
    """
    from prefect.utilities.asyncutils import run_coro_as_sync  # also works from inside an event loop

    configuration_class = _job_configuration_class(worker_type)
    configuration = run_coro_as_sync(_from_template_and_values(configuration_class, template,
                                                                dict(job_variables or {})))
    if flow_run_name is not None:
        from uuid import uuid4

        from prefect.client.schemas.objects import FlowRun

        configuration.prepare_for_flow_run(FlowRun(flow_id=uuid4(), name=flow_run_name))
    return configuration.model_dump(mode="json")


def _job_configuration_class(worker_type: str):
    from prefect.workers.base import BaseWorker

    worker = BaseWorker.get_worker_class_from_type(worker_type)
    if worker is None:
        hint = " (pip install prefect-kubernetes)" if worker_type == "kubernetes" else ""
        raise ValueError(f"no Prefect worker of type {worker_type!r} is installed{hint}")
    return worker.job_configuration


async def _from_template_and_values(configuration_class, template: dict, values: dict):
    import httpx
    from prefect.client.orchestration import PrefectClient, get_client
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():  # resolve Prefect variables / blocks from the server, as a worker does
        async with get_client() as client:
            return await configuration_class.from_template_and_values(template, values, client=client)
    client = PrefectClient(_NO_API)  # never contacted unless the template references the API
    try:
        return await configuration_class.from_template_and_values(template, values, client=client)
    except httpx.TransportError:
        raise RuntimeError("the job template references Prefect variables or blocks; "
                           "set PREFECT_API_URL to render it") from None
