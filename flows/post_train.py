"""The pipeline flow: the spec's stage DAG as Prefect tasks, cached and resumable from the store."""

from __future__ import annotations

import contextvars
import time
from concurrent.futures import ThreadPoolExecutor, wait

from prefect import flow, get_run_logger
from prefect.settings import PREFECT_API_URL
from prefect.states import Failed

from artifacts.refs import hash_value
from artifacts.store import AlreadyExists, Store, StoreError, StoreLocation, now_iso
from flows.deploy import stage_job_variables
from flows.evaluate import evaluate
from flows.report_artifacts import publish_reports
from flows.spec import PipelineSpec, load_spec, parse_spec_text, topological_order
from flows.stage_flow import submit_stage
from flows.stage_requests import new_run_id, stage_parameters, stage_request, state_error
from tasks.request import StageRequest
from tasks.runtime.cache import cached_result, code_version
from tasks.runtime.launch import warm_up
from tasks.runtime.live import read_progress
from tasks.runtime.runner import run_stage, stage_task_options

WATCH_SECONDS = 2.0  # how often the flow looks at a running stage's progress
INLINE_EVALUATION = ("evaluation.on_new_checkpoint: no Prefect server (PREFECT_API_URL unset, ephemeral mode): "
                     "each new checkpoint is evaluated inline, after the stage that made it")


def ephemeral() -> bool:
    """No Prefect server named: flows run against a temporary in-process API, nobody serves triggers."""
    return PREFECT_API_URL.value() is None


def save_spec(store: Store, text: str) -> str:
    """Keep the spec text in the store (what lineage and triggered evaluations read); returns its hash."""
    spec_hash = hash_value(text)[:16]
    try:
        store.create_only(store.path("specs", f"{spec_hash}.yaml"), text.encode())
    except AlreadyExists:
        pass
    return spec_hash


@flow(name="post-train")
def post_train(spec: str | None = None, store: str | None = None, run_id: str | None = None,
               spec_text: str | None = None, spec_hash: str | None = None, spec_dir: str | None = None):
    """Run every stage in dependency order; a failed stage stops everything downstream of it.

    The spec comes as a file's path (`spec`, how a deployment runs it) or as its text (`spec_text`,
    from the CLI, which has already saved it under `spec_hash`, with the file's folder as `spec_dir`
    for relative source paths); `store` overrides the spec's store.
    """
    logger = get_run_logger()
    warm_up()
    if spec_text is None:
        if spec is None:
            raise ValueError("post_train needs a spec: a file path (spec) or its text (spec_text)")
        pipeline, spec_text = load_spec(spec)
    else:
        pipeline = parse_spec_text(spec_text, spec_dir=spec_dir)
    artifact_store = pipeline.store_location(store).open()
    location = artifact_store.location  # normalised (an absolute local path): the child runs elsewhere
    spec_hash = spec_hash or save_spec(artifact_store, spec_text)
    run_id = run_id or new_run_id(pipeline.name)
    inline_evaluation = pipeline.evaluation.on_new_checkpoint and ephemeral()
    if inline_evaluation:
        logger.info(INLINE_EVALUATION)
    summary = {"run_id": run_id, "pipeline": pipeline.name, "spec": spec_hash, "store": artifact_store.uri,
               "code_version": code_version(), "state": "running", "started": now_iso(), "stages": [],
               "not_run": [], "evaluations": []}
    began = time.monotonic()
    output_of: dict[str, str] = {}
    for stage in topological_order(pipeline):
        deps = [target for _, target, _ in pipeline.inputs_of(stage)]
        if any(dep not in output_of for dep in deps):
            summary["not_run"].append(stage.id)
            continue
        request = stage_request(pipeline, stage, {dep: output_of[dep] for dep in deps}, store=location,
                                run_id=run_id, spec_hash=spec_hash)
        stage_began = time.monotonic()
        record = run_one_stage(pipeline, request, artifact_store, Watch(artifact_store, summary, stage.id))
        if record["state"] != "failed":
            output_of[stage.id] = record["outputs"][type(stage).primary]
            logger.info(f"{stage.id}: {record['state']} -> {', '.join(record['outputs'].values())}")
            # cached stages too: the artifact belongs to this flow run, whose UI should show it
            publish_reports(artifact_store, pipeline.name, stage.id, record["outputs"])
        else:
            logger.error(f"{stage.id}: failed: {record['error']}")
        if inline_evaluation:
            summary["evaluations"] += [evaluate_inline(ref, location) for ref in record["new_checkpoints"]]
        record["seconds"] = round(time.monotonic() - stage_began, 3)
        summary["stages"].append(record)
        write_summary(artifact_store, summary)
    failed = [s["id"] for s in summary["stages"] if s["state"] == "failed"]
    summary.update(state="failed" if failed else "completed", finished=now_iso(),
                   seconds=round(time.monotonic() - began, 3))
    write_summary(artifact_store, summary)
    if failed:
        return Failed(message=f"stages failed: {', '.join(failed)}", data=summary)
    return summary


class Watch:
    """While a stage runs, its progress (tasks/runtime/live.py) in the run summary's `running`; the
    flow is the summary's only writer."""

    def __init__(self, store: Store, summary: dict, stage_id: str):
        self.store, self.summary, self.stage_id, self.shown = store, summary, stage_id, None

    def until(self, done) -> None:
        """Poll until `done(timeout)` says the stage ended (it waits up to `timeout` seconds itself)."""
        try:
            while not done(WATCH_SECONDS):
                progress = read_progress(self.store, self.summary["run_id"], self.stage_id)
                if progress is not None and progress != self.shown:
                    self.shown = progress
                    self.summary.setdefault("running", {})[self.stage_id] = progress
                    self.show()
        finally:
            self.summary.get("running", {}).pop(self.stage_id, None)
            if not self.summary.get("running"):
                self.summary.pop("running", None)


    def show(self) -> None:
        """Best effort: a store hiccup costs one progress update, never the stage it shows."""
        try:
            write_summary(self.store, self.summary)
        except (OSError, StoreError) as exc:
            get_run_logger().warning(f"{self.stage_id}: progress not written to the run summary: {exc}")


def write_summary(store: Store, summary: dict) -> None:
    store.write_json(store.path("runs", f"{summary['run_id']}.json"), summary)


def run_one_stage(pipeline: PipelineSpec, request: StageRequest, artifact_store: Store, watch: Watch) -> dict:
    """Run a stage here or on a worker (`workers.deployment`), showing its progress through `watch`;
    returns its summary record, with the checkpoints it committed in this run under `new_checkpoints`."""
    stage = request.stage
    record = {"id": stage.id, "kind": stage.kind, "cache_key": request.cache_key, "new_checkpoints": []}
    if pipeline.workers is None:
        future = run_stage.with_options(**stage_task_options(request)).submit(request)
        watch.until(lambda timeout: wait([future.wrapped_future], timeout).done)
        future.wait()  # keeps the final state in memory: the API's copy holds no result to read
        state = future.state
        if not state.is_completed():
            return {**record, "state": "failed", "outputs": {}, "metrics": {}, "error": state_error(state)}
        result, cached = state.result(), state.name == "Cached"
    else:
        job_variables = {**pipeline.workers.job_variables, **stage_job_variables(request.orchestration)}
        with ThreadPoolExecutor(1) as pool:  # the flow run's context goes along: the stage's run is its child
            submitted = pool.submit(contextvars.copy_context().run, submit_stage, pipeline.workers.deployment,
                                    stage_parameters(pipeline, request), job_variables, f"{request.run_id}-{stage.id}")
            watch.until(lambda timeout: wait([submitted], timeout).done)
            flow_run = submitted.result()
        result = cached_result(artifact_store, request.cache_key)
        if not flow_run.state.is_completed() or result is None:
            error = flow_run.state.message or flow_run.state.name
            return {**record, "state": "failed", "outputs": {}, "metrics": {}, "error": f"flow run {flow_run.name}: {error}"}
        cached = result["run_id"] != request.run_id
    return {**record, "state": "cached" if cached else "completed", "outputs": result["outputs"],
            "metrics": result["metrics"], "compute_seconds": result.get("compute_seconds"),
            "new_checkpoints": [] if cached else result.get("checkpoints", [])}


def evaluate_inline(checkpoint_ref: str, store: StoreLocation) -> dict:
    """Ephemeral mode's stand-in for the checkpoint trigger: the evaluation flow as a subflow."""
    state = evaluate(checkpoint_ref=checkpoint_ref, store=store.uri, storage_options=store.options,
                     return_state=True)
    if not state.is_completed():
        error = state_error(state)
        get_run_logger().error(f"evaluation of {checkpoint_ref} failed: {error}")
        return {"checkpoint": checkpoint_ref, "state": "failed", "error": error}
    return state.result()
