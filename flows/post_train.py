"""The pipeline flow: the spec's stage DAG as Prefect tasks, cached and resumable from the store."""

from __future__ import annotations

import contextvars
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable

from prefect import flow, get_run_logger
from prefect.exceptions import TerminationSignal
from prefect.states import Failed
from prefect.task_runners import ThreadPoolTaskRunner

from artifacts.store import AlreadyExists, Store, StoreError, StoreLocation, now_iso
from flows.evaluate import evaluate, keep_evaluation_sources
from flows.leaderboard import evaluations
from flows.learning_curves import learning_curves
from flows.report_artifacts import publish_reports
from flows.spec import PipelineSpec, load_spec, parse_spec_text, spec_hash_of, stage_graph
from flows.stage_inputs import NoBestCheckpoint, resolve_inputs
from flows.stage_requests import new_run_id, stage_request, state_error
from flows.temporary_api import ephemeral
from flows.worker_stage import WorkerStage
from tasks.request import StageRequest
from tasks.runtime.cache import code_version
from tasks.runtime.launch import warm_up
from tasks.runtime.live import read_progress
from tasks.runtime.runner import STOPPING, StageFailed, run_stage, stage_task_options

WATCH_SECONDS = 2.0  # how often the flow looks at the running stages' progress
RESOURCE_KEYS = ("device", "peak_rss_gb", "peak_gpu_gb")  # a stage's result's say on where and how big it ran
INLINE_EVALUATION = ("evaluation.on_new_checkpoint: no Prefect server (PREFECT_API_URL unset, ephemeral mode): "
                     "each new checkpoint is evaluated inline, after the stage that made it")


def save_spec(store: Store, text: str) -> str:
    """Keep the spec text in the store (what lineage and triggered evaluations read); returns its hash."""
    spec_hash = spec_hash_of(text)
    try:
        store.create_only(store.path("specs", f"{spec_hash}.yaml"), text.encode())
    except AlreadyExists:
        pass
    return spec_hash


# The flow caps how many stages run at once itself: a task runner capped lower (by
# PREFECT_TASKS_RUNNER_THREAD_POOL_MAX_WORKERS) would queue the stages it started out of its sight.
@flow(name="post-train", task_runner=ThreadPoolTaskRunner(max_workers=sys.maxsize))
def post_train(spec: str | None = None, store: str | None = None, run_id: str | None = None,
               spec_text: str | None = None, spec_hash: str | None = None, spec_dir: str | None = None):
    """Run every stage once its inputs are committed, up to the spec's `max_parallel_stages` at
    once; a failed stage stops only the stages downstream of it.

    The spec comes as a file's path (`spec`, how a deployment runs it) or as its text (`spec_text`,
    from the CLI, which has already saved it under `spec_hash`, with the file's folder as `spec_dir`
    for relative source paths); `store` overrides the spec's store.
    """
    logger = get_run_logger()
    if spec_text is None:
        if spec is None:
            raise ValueError("post_train needs a spec: a file path (spec) or its text (spec_text)")
        pipeline, spec_text = load_spec(spec)
    else:
        pipeline = parse_spec_text(spec_text, spec_dir=spec_dir)
    warm_up(lora=pipeline.model.lora is not None)  # started already when the CLI runs the flow
    artifact_store = pipeline.store_location(store).open()
    spec_hash = spec_hash or save_spec(artifact_store, spec_text)
    keep_evaluation_sources(artifact_store, pipeline, spec_hash)  # lm_eval.include_path, for triggered evaluations
    run_id = run_id or new_run_id(pipeline.name)
    inline_evaluation = pipeline.evaluation.on_new_checkpoint and ephemeral()
    if inline_evaluation:
        logger.info(INLINE_EVALUATION)
    summary = {"run_id": run_id, "pipeline": pipeline.name, "spec": spec_hash, "store": artifact_store.uri,
               "code_version": code_version(), "state": "running", "started": now_iso(), "stages": [],
               "not_run": [], "evaluations": []}
    began = time.monotonic()
    STOPPING.clear()  # a run started again in the same process (a notebook after Ctrl-C) runs
    try:
        PipelineRun(pipeline, artifact_store, summary, spec_hash, inline_evaluation).run()
    except (KeyboardInterrupt, TerminationSignal):  # Ctrl-C, or SIGTERM as Prefect raises it
        STOPPING.set()  # the stages' children are killed now, so the flow's thread pool can end
        raise
    failed = [s["id"] for s in summary["stages"] if s["state"] == "failed"]
    summary.update(state="failed" if failed else "completed", finished=now_iso(),
                   seconds=round(time.monotonic() - began, 3))
    write_summary(artifact_store, summary)
    if failed:
        return Failed(message=f"stages failed: {', '.join(failed)}", data=summary)
    return summary


def stages_to_start(graph: dict[str, list[str]], done: set[str], failed: set[str], running: set[str],
                    limit: int) -> list[str]:
    """The stages to start now: those never started whose inputs are all done (committed), in the
    graph's (topological) order, as many as `limit` stages at once leaves room for."""
    started = done | failed | running
    ready = [stage_id for stage_id, inputs in graph.items()
             if stage_id not in started and all(target in done for target in inputs)]
    return ready[:max(0, limit - len(running))]


def stopped_by_failures(graph: dict[str, list[str]], failed: set[str]) -> list[str]:
    """The stages downstream of a failed one (directly or not), in the graph's (topological) order:
    they will never start."""
    stopped: set[str] = set()
    for stage_id, inputs in graph.items():
        if any(target in failed or target in stopped for target in inputs):
            stopped.add(stage_id)
    return [stage_id for stage_id in graph if stage_id in stopped]


@dataclass
class StageRun:
    """A stage the flow started: `ended` is done once its run is over; `record()` then reads its
    summary record (without the times, which the flow adds)."""

    stage_id: str
    ended: Future
    record: Callable[[], dict]
    started: str = field(default_factory=now_iso)
    began: float = field(default_factory=time.monotonic)


class PipelineRun:
    """The scheduling loop of one pipeline run: it starts every stage whose inputs are committed
    (up to `max_parallel_stages` at once), waits for any to end while folding their progress into
    the summary, and records each as it ends. It runs on the flow's own thread, which is thus the
    only writer of the run summary."""

    def __init__(self, pipeline: PipelineSpec, store: Store, summary: dict, spec_hash: str, inline_evaluation: bool):
        self.pipeline, self.store, self.summary = pipeline, store, summary
        self.spec_hash, self.inline_evaluation = spec_hash, inline_evaluation
        self.graph = stage_graph(pipeline)
        self.output_of: dict[str, str] = {}  # committed stage -> its primary output's ref
        self.failed: set[str] = set()
        self.running: dict[str, StageRun] = {}
        self.watch = Watch(store, summary)

    def run(self) -> None:
        # deployment runs wait in these threads (local stages in the task runner's)
        with ThreadPoolExecutor(self.pipeline.max_parallel_stages, thread_name_prefix="stage-run") as threads:
            while True:
                starting = stages_to_start(self.graph, set(self.output_of), self.failed, set(self.running),
                                           self.pipeline.max_parallel_stages)
                for stage_id in starting:
                    self.running[stage_id] = self.start(stage_id, threads)
                if not self.running:
                    return
                ended = self.watch.until_one_ends(self.running)
                finished, ended_at = now_iso(), time.monotonic()  # before any inline evaluation of the first
                for stage_id in ended:
                    self.end(self.running.pop(stage_id), finished, ended_at)

    def start(self, stage_id: str, threads: ThreadPoolExecutor) -> StageRun:
        stage = self.pipeline.stage(stage_id)
        try:  # a `STAGE@best:` input is chosen now, from the evaluations committed so far
            inputs = resolve_inputs(self.pipeline.written_inputs(stage), self.output_of, self.store,
                                    get_run_logger().info)
        except NoBestCheckpoint as exc:
            return unresolved(stage, str(exc))
        # the store's location is normalised (an absolute local path): the child runs elsewhere
        request = stage_request(self.pipeline, stage, inputs,
                                store=self.store.location, run_id=self.summary["run_id"], spec_hash=self.spec_hash)
        if self.pipeline.workers is None:  # on this machine: its children share the cores (tasks/runtime/core_share.py)
            return start_task(request)
        return start_on_worker(self.pipeline, request, self.store, threads)

    def end(self, stage_run: StageRun, finished: str, ended_at: float) -> None:
        """Record a stage that ended at `finished` (`ended_at` on the monotonic clock), and evaluate
        its new checkpoints inline in ephemeral mode."""
        record = {**stage_run.record(), "started": stage_run.started, "finished": finished,
                  "seconds": round(ended_at - stage_run.began, 3)}
        stage = self.pipeline.stage(stage_run.stage_id)
        logger = get_run_logger()
        if record["state"] != "failed":
            self.output_of[stage.id] = record["outputs"][type(stage).primary]
            logger.info(f"{stage.id}: {record['state']} -> {', '.join(record['outputs'].values())}")
            # cached stages too: the artifact belongs to this flow run, whose UI should show it
            publish_reports(self.store, self.pipeline.name, stage.id, record["outputs"])
        else:
            self.failed.add(stage.id)
            logger.error(f"{stage.id}: failed: {record['error']}")
        self.summary["stages"].append(record)
        if self.inline_evaluation:
            evaluated = self.pipeline.evaluation.evaluates(stage.id) and record["new_checkpoints"]
            if evaluated:
                self.summary["evaluations"] += [evaluate_inline(ref, self.store.location)
                                                for ref in record["new_checkpoints"]]
            if evaluated or type(stage).produces == "evaluation":  # an evaluate stage may add a curve's step 0
                self.draw_learning_curves()
        self.summary["not_run"] = stopped_by_failures(self.graph, self.failed)
        write_summary(self.store, self.summary)

    def draw_learning_curves(self) -> None:
        """The run's learning curves so far, in the summary (the evaluation flow publishes them).
        Like a report, curves that cannot be read from the store are logged: the stages committed."""
        cache_keys = {record["cache_key"] for record in self.summary["stages"]}
        try:
            curves = learning_curves(evaluations(self.store, self.pipeline.name), cache_keys)
        except Exception as exc:  # noqa: BLE001
            get_run_logger().warning(f"learning curves not drawn: {type(exc).__name__}: {exc}")
            return
        self.summary["learning_curves"] = [curve.as_dict() for curve in curves]


class Watch:
    """While stages run, their progress (tasks/runtime/live.py) in the run summary's `running`:
    {stage id: {step, total, eta_seconds}}, written from the flow's thread (the summary's only writer)."""

    def __init__(self, store: Store, summary: dict):
        self.store, self.summary = store, summary

    def until_one_ends(self, running: dict[str, StageRun]) -> list[str]:
        """Poll the running stages' progress until one or more of them end; returns their ids, in start order."""
        while not wait([stage_run.ended for stage_run in running.values()], WATCH_SECONDS,
                       return_when=FIRST_COMPLETED).done:
            self.look(list(running))
        ended = [stage_id for stage_id, stage_run in running.items() if stage_run.ended.done()]
        for stage_id in ended:
            self.summary.get("running", {}).pop(stage_id, None)
        if not self.summary.get("running"):
            self.summary.pop("running", None)
        return ended

    def look(self, stage_ids: list[str]) -> None:
        """Fold each running stage's latest progress into the summary; rewrite it if any changed."""
        shown = self.summary.setdefault("running", {})
        changed = False
        for stage_id in stage_ids:
            progress = read_progress(self.store, self.summary["run_id"], stage_id)
            if progress is not None and progress != shown.get(stage_id):
                shown[stage_id], changed = progress, True
        if not shown:
            self.summary.pop("running")
        if changed:
            self.show()

    def show(self) -> None:
        """Best effort: a store hiccup costs one progress update, never the stages it shows."""
        try:
            write_summary(self.store, self.summary)
        except (OSError, StoreError) as exc:
            get_run_logger().warning(f"progress not written to the run summary: {exc}")


def write_summary(store: Store, summary: dict) -> None:
    store.write_json(store.path("runs", f"{summary['run_id']}.json"), summary)


def start_task(request: StageRequest) -> StageRun:
    """The stage as a task of this flow run (the task runner's thread)."""
    future = run_stage.with_options(**stage_task_options(request)).submit(request)
    return StageRun(request.stage.id, future.wrapped_future, lambda: task_record(request, future))


def task_record(request: StageRequest, future) -> dict:
    future.wait()  # keeps the final state in memory: the API's copy holds no result to read
    state = future.state
    if not state.is_completed():
        return failed_record(request, state_error(state))
    return stage_record(request, state.result(), cached=state.name == "Cached")


def start_on_worker(pipeline: PipelineSpec, request: StageRequest, store: Store, threads: ThreadPoolExecutor) -> StageRun:
    """The stage as flow runs of `workers.deployment`, watched in one of `threads` with this flow run's
    context (the stage's runs are its children): flows/worker_stage.py."""
    watched = threads.submit(contextvars.copy_context().run, WorkerStage(pipeline, request, store).result)
    return StageRun(request.stage.id, watched, lambda: worker_record(request, watched))


def worker_record(request: StageRequest, watched: Future) -> dict:
    """The stage's record from the store's stage cache (a worker's result never crosses Prefect)."""
    try:
        result = watched.result()
    except StageFailed as exc:
        return failed_record(request, str(exc))
    return stage_record(request, result, cached=result["run_id"] != request.run_id)


def failed_record(request: StageRequest, error: str) -> dict:
    return {"id": request.stage.id, "kind": request.stage.kind, "cache_key": request.cache_key, "new_checkpoints": [],
            "state": "failed", "outputs": {}, "metrics": {}, "error": error}


def unresolved(stage, error: str) -> StageRun:
    """A stage whose inputs do not resolve (no evaluated checkpoint to pick): failed before it starts."""
    ended: Future = Future()
    ended.set_result(None)
    record = {"id": stage.id, "kind": stage.kind, "cache_key": None, "new_checkpoints": [], "state": "failed",
              "outputs": {}, "metrics": {}, "error": error}
    return StageRun(stage.id, ended, lambda: record)


def stage_record(request: StageRequest, result: dict, cached: bool) -> dict:
    """A stage's summary record from its result; a cached stage's result, device and peak memory
    included, is the one of the run that made it."""
    return {"id": request.stage.id, "kind": request.stage.kind, "cache_key": request.cache_key,
            "new_checkpoints": [] if cached else result.get("checkpoints", []),
            "state": "cached" if cached else "completed", "outputs": result["outputs"], "metrics": result["metrics"],
            "compute_seconds": result.get("compute_seconds"),
            **({} if cached else {"attempts": result.get("attempts", 1)}),
            **({"adopted": True} if result.get("adopted") else {}),
            **{key: result[key] for key in RESOURCE_KEYS if result.get(key) is not None}}


def evaluate_inline(checkpoint_ref: str, store: StoreLocation) -> dict:
    """Ephemeral mode's stand-in for the checkpoint trigger: the evaluation flow as a subflow."""
    state = evaluate(checkpoint_ref=checkpoint_ref, store=store.uri, storage_options=store.options,
                     return_state=True)
    if not state.is_completed():
        error = state_error(state)
        get_run_logger().error(f"evaluation of {checkpoint_ref} failed: {error}")
        return {"checkpoint": checkpoint_ref, "state": "failed", "error": error}
    return state.result()
