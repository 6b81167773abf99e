"""Run one stage: look it up in the store's stage cache, else run it in a child process.

`run_stage` is the Prefect task every stage runs as (`stage_task_options` gives it the stage's
name, retries, retry delay and tags); the per-kind logic lives in the stage modules.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed

from tasks.request import StageRequest
from tasks.runtime.cache import cache_path, cached_result
from tasks.runtime.claims import Claim, ClaimTimeout, claim_stage
from tasks.runtime.core_share import CORE_SHARE
from tasks.runtime.devices import GpuLease, GpusUnavailable, lease_gpus
from tasks.runtime.events import emit_checkpoint_created
from tasks.runtime.launch import ACCELERATE_CONFIG, start_child
from tasks.runtime.live import LiveProgress, LiveReport

ANNOUNCE_POLL_SECONDS = 0.5
# Set when the run is stopping (its flow got SIGTERM or Ctrl-C, flows/post_train.py): every running
# stage's child is killed at its next poll, and no stage starts or retries. Without it, the flow's
# thread pool would wait for the stages to end on their own before the process could exit.
STOPPING = threading.Event()
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _stage_logs() -> logging.Logger:
    """The logger relayed stage lines go through: only to the Prefect API, never the console."""
    from prefect.logging.handlers import APILogHandler

    logger = logging.getLogger("posttrain.stage")
    if not logger.handlers:
        logger.addHandler(APILogHandler())
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
    return logger


STAGE_LOGS = _stage_logs()
GPU_LIMIT = "gpu"  # the global concurrency limit capping GPU slots (`prefect gcl create gpu --limit N`)


class StageFailed(Exception):
    pass


class NotRetryableFailure(StageFailed):
    """The stage raised a NotRetryable (tasks/common/errors.py: a broken data contract, no training
    data, inputs that cannot work together): the same inputs would fail the same way."""


def retry_unless_not_retryable(task, task_run, state) -> bool:
    return not isinstance(state.data, NotRetryableFailure) and not STOPPING.is_set()


class ChildMessages:
    """What a running child tells the orchestrator, one JSON line each (StageContext._tell), read
    as it comes: committed checkpoints (`on_checkpoint(ref, step)`), log lines (relayed to the task
    run's logs in Prefect), progress (`on_progress(progress)`) and its report so far
    (`on_report(markdown, step)`)."""

    def __init__(self, path: Path, on_checkpoint: Callable[[str, int | None], None],
                 on_progress: Callable[[dict], None] = lambda progress: None,
                 on_report: Callable[[str, int | None], None] = lambda markdown, step: None):
        self.path, self.on_checkpoint, self.on_progress, self.offset, self.refs = path, on_checkpoint, on_progress, 0, []
        self.on_report = on_report

    def drain(self) -> None:
        if not self.path.exists():
            return
        with open(self.path) as handle:
            handle.seek(self.offset)
            for line in iter(handle.readline, ""):
                if not line.endswith("\n"):
                    break  # half-written: read it next time
                self.offset += len(line)
                self.handle(json.loads(line))

    def handle(self, message: dict) -> None:
        if "ref" in message:
            self.refs.append(message["ref"])
            self.on_checkpoint(message["ref"], message["step"])
        elif "log" in message:
            relay_log(message["log"], message["level"])
        elif "progress" in message:
            self.on_progress(message["progress"])
        elif "report" in message:
            self.on_report(message["report"], message.get("step"))


def relay_log(line: str, level: str) -> None:
    """A stage's log line into its task run's logs in the Prefect API (not the console: the child
    printed it there itself). Outside a task run there is nowhere to send it."""
    from prefect.context import TaskRunContext

    if TaskRunContext.get() is not None:
        STAGE_LOGS.log(logging.getLevelName(level) if level in LEVELS else logging.INFO, line)


def run_in_child(request: StageRequest, on_checkpoint=lambda ref, step: None,
                 on_progress=lambda progress: None, on_report=lambda markdown, step: None,
                 child_env: dict[str, str] | None = None) -> dict:
    """Run the stage in a child process (tasks/runtime/child.py); kill it at the stage's timeout.
    `on_checkpoint(ref, step)` is called for every checkpoint the stage commits, while it runs; the
    result lists them; `on_progress(progress)` and `on_report(markdown, step)` are called as the
    child reports them. `child_env` joins the child's environment (its GPUs: stage_gpus)."""
    timeout, stage_id = request.orchestration.timeout_seconds, request.stage.id
    with tempfile.TemporaryDirectory(prefix="posttrain-req-") as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        messages = ChildMessages(Path(tmp) / "messages.jsonl", on_checkpoint, on_progress, on_report)
        share_file = Path(tmp) / "core-share"
        request = request.model_copy(update={"announce_path": str(messages.path), "core_share_path": str(share_file),
                                             "orchestrator_cwd": str(Path.cwd())})
        request_path.write_text(request.model_dump_json())
        if request.accelerate_config is not None:
            (Path(tmp) / ACCELERATE_CONFIG).write_text(request.accelerate_config)
        if STOPPING.is_set():
            raise StageFailed(f"stage {stage_id!r} not started: the run is stopping")
        with CORE_SHARE.child(share_file):
            process = start_child(request.orchestration.gpus, request_path, result_path, child_env)
            wait_for_child(process, messages, stage_id, timeout)
        if not result_path.exists():
            raise StageFailed(f"stage {stage_id!r} died (exit code {process.poll()})")
        result = json.loads(result_path.read_text())
    if "error" in result:
        raise (StageFailed if result.get("retryable", True) else NotRetryableFailure)(result["error"])
    return {**result, "checkpoints": messages.refs}


def wait_for_child(process, messages: ChildMessages, stage_id: str, timeout: float) -> None:
    """Relay the child's messages until it exits; kill it at the stage's timeout or when the run stops."""
    deadline = time.monotonic() + timeout
    try:
        while process.poll() is None:
            if time.monotonic() > deadline:
                raise StageFailed(f"stage {stage_id!r} timed out after {timeout:g}s")
            if STOPPING.is_set():
                raise StageFailed(f"stage {stage_id!r} stopped: the run is stopping")
            messages.drain()
            time.sleep(ANNOUNCE_POLL_SECONDS)
    finally:
        if process.poll() is None:  # a launcher's processes exit when it does (tasks/runtime/child.py)
            process.kill()
        messages.drain()


def gpu_slots(gpus: int):
    """Hold `gpus` slots of the global concurrency limit `gpu` while the stage runs, so stages wait
    for free GPUs instead of oversubscribing them. Without such a limit (a CPU machine, a server
    nobody set up) this holds nothing: the limit is the operator's choice (docs/GPU.md, Running on a GPU cluster)."""
    if gpus == 0:
        return contextlib.nullcontext()
    from prefect.concurrency.sync import concurrency

    return concurrency(GPU_LIMIT, occupy=gpus, strict=False)


def stage_gpus(request: StageRequest) -> GpuLease:
    """The GPUs of this box the stage's child may use, locked against the box's other stages
    (tasks/runtime/devices.py); waiting for them counts against the stage's timeout."""
    try:
        return lease_gpus(request.orchestration.gpus, request.orchestration.timeout_seconds)
    except GpusUnavailable as exc:
        raise StageFailed(f"stage {request.stage.id!r}: {exc}") from None


def attempt() -> int:
    """Which attempt of its task this run is (1, then 2 on the first retry): the task run's count,
    which the Prefect UI shows too."""
    from prefect.context import TaskRunContext

    context = TaskRunContext.get()
    return context.task_run.run_count if context is not None else 1


def stage_tags(request: StageRequest) -> list[str]:
    return ["posttrain", f"pipeline:{request.pipeline}", f"kind:{request.stage.kind}",
            "gpu" if request.orchestration.gpus else "cpu"]


def stage_task_options(request: StageRequest, task_run_name: str | None = None) -> dict:
    """`run_stage.with_options(...)` for this request: its retries, delay and tags. No Prefect task
    timeout: the runner kills the stage's child at the stage's timeout, and Prefect's could not
    interrupt a task in a worker thread anyway (it warned so at every stage)."""
    settings = request.orchestration
    return {"name": request.stage.kind, "task_run_name": task_run_name or request.stage.id,
            "retries": settings.retries, "retry_delay_seconds": settings.retry_delay_seconds,
            "tags": stage_tags(request)}


@task(cache_policy=NO_CACHE, persist_result=False, retry_condition_fn=retry_unless_not_retryable)
def run_stage(request: StageRequest):
    """The stage's result: from the store's stage cache, from another run that held the stage's
    claim meanwhile (tasks/runtime/claims.py; waiting counts against the stage's timeout), or
    from running it here."""
    store = request.store.open()
    try:
        claim = claim_stage(store, request.cache_key, request.run_id, request.orchestration.timeout_seconds,
                            lambda: cached_result(store, request.cache_key))
    except ClaimTimeout as exc:
        raise StageFailed(f"stage {request.stage.id!r}: {exc}") from None
    if not isinstance(claim, Claim):
        return Completed(name="Cached", data=claim, message=f"outputs already committed: {claim['outputs']}")
    live = LiveProgress(store, request.run_id, request.stage.id)
    try:
        with gpu_slots(request.orchestration.gpus), stage_gpus(request) as gpus:
            result = run_in_child(request, on_checkpoint=lambda ref, step: emit_checkpoint_created(ref, request, step),
                                  on_progress=live, on_report=LiveReport(request.pipeline, request.stage.id),
                                  child_env=gpus.child_env())
        result = {**result, "attempts": attempt()}
        store.write_json(cache_path(store, request.cache_key), {"stage": request.stage.id, "run_id": request.run_id,
                                                                **result})
    finally:
        live.close()
        claim.release()
    return result
