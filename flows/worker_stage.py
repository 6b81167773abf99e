"""A stage on a work pool's workers (spec `workers:`), watched until its outputs are in the store.

The flow submits the stage to `workers.deployment` as a flow run and, every POLL_SECONDS, looks at
three things: the store's stage cache (the stage's result: the only thing read back), the stage's
claim in the store (tasks/runtime/claims.py: its heartbeat, beaten every 15 s by the worker's
`run_stage` while it holds the stage), and the flow run's state in the Prefect API.

- **A lost worker.** The flow run was picked up but no claim of the stage's cache key has beaten for
  `workers.lost_after_seconds` (a process tree killed, a node gone, a pod evicted), or the worker
  reported the flow run Crashed: the flow run is marked Crashed and the stage is submitted again,
  one of its `retries` spent. The new worker takes the stage over once the old claim is stale and
  resumes from its last in-stage checkpoint (scratch is keyed by the cache key).
- **No worker.** A flow run still waiting for a worker after `workers.pickup_timeout_seconds` is
  cancelled and the stage fails, naming the pool.
- **The Prefect API down.** The watch goes on reading the store; a result there ends the stage
  whatever the API says. After `workers.api_outage_seconds` without an answer the stage fails in one
  line; what the workers commit stays in the store, and a rerun takes it up.
- **Adoption.** A stage whose claim beats for another run (a `posttrain run` that died while its
  stages ran on workers) is not submitted: its claim is watched until its result is in the store, or
  until it is lost (then the stage is submitted). So one stage never runs twice at once.

Why the claim's heartbeat rather than Prefect's flow-run heartbeats: docs/RUNTIME.md ("A lost worker").
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from artifacts.store import Store
from flows.deploy import stage_job_variables
from flows.stage_requests import stage_parameters
from tasks.request import StageRequest
from tasks.runtime.cache import cached_result
from tasks.runtime.claims import current_claim, stale
from tasks.runtime.runner import STOPPING, StageFailed

POLL_SECONDS = 2.0
WAITING = ("SCHEDULED", "PENDING")  # not picked up by a worker yet (PENDING: submitted to its infrastructure)
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


class WorkerLost(Exception):
    """The stage's worker is gone: its flow run is marked Crashed and the stage may be submitted again."""


@dataclass
class Heartbeat:
    """When the stage's claim was last seen beating, on this process's clock (the workers' clocks may
    differ from it): a claim that appears or whose heartbeat changes is a beat."""

    seen: tuple | None = None  # (claim generation, heartbeat) last read
    at: float = 0.0

    def look(self, store: Store, key: str, now: float) -> bool:
        """Read the claim; whether it beat since the last look."""
        generation, holder = current_claim(store, key)
        beat = (generation, holder["heartbeat"]) if holder is not None else None
        if beat is not None and beat != self.seen:
            self.seen, self.at = beat, now
            return True
        return False


class PrefectApi:
    """The flow-run calls the watch makes, each one's failure to reach the API counted as an outage
    (which ends, on the next answer) rather than raised."""

    def __init__(self, outage_seconds: float):
        from prefect.client.orchestration import get_client

        self.client = get_client(sync_client=True)
        self.outage_seconds = outage_seconds
        self.down_since: float | None = None

    def call(self, what, *args, **kwargs):
        """`what(*args)` against the API; None while it does not answer, StageFailed once that has
        lasted `outage_seconds`. The client retries once only: this watch counts the outage itself
        (the client's own back-off would hold every call for a minute)."""
        from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

        try:
            with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 1}):
                answer = what(*args, **kwargs)
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code < 500:
                raise
            return self._down(exc)
        except (httpx.HTTPError, OSError) as exc:
            return self._down(exc)
        self.down_since = None
        return answer

    def _down(self, exc: Exception) -> None:
        now = time.monotonic()
        self.down_since = self.down_since or now
        if now - self.down_since > self.outage_seconds:
            raise StageFailed(f"the Prefect API has not answered for {now - self.down_since:.0f} s "
                              f"({type(exc).__name__}); workers keep what they commit: run again once it is back")
        return None

    def set_state(self, flow_run_id, state) -> None:
        self.call(self.client.set_flow_run_state, flow_run_id, state, force=True)


class WorkerStage:
    """One stage's runs on the workers of `pipeline.workers` until its result is in `store`: `result()`
    returns it (the stage cache's entry) with `attempts` (how many times the stage was started here)
    and `adopted` (another run's, waited for)."""

    def __init__(self, pipeline, request: StageRequest, store: Store):
        self.pipeline, self.workers, self.request, self.store = pipeline, pipeline.workers, request, store
        self.key, self.stage_id = request.cache_key, request.stage.id
        self.api = PrefectApi(self.workers.api_outage_seconds)
        self.heartbeat = Heartbeat()
        self.flow_runs: list = []  # every flow run this stage was submitted as

    def result(self) -> dict:
        found = self.adopt()
        if found is not None:
            return found
        retries, lost = self.request.orchestration.retries, 0
        while True:
            try:
                result = self.watch(self.submit(retries - lost))
                return {**result, "attempts": lost + result.get("attempts", 1), "adopted": False}
            except WorkerLost as exc:
                lost += 1
                if lost > retries:
                    raise StageFailed(f"stage {self.stage_id!r}: {exc} (lost {lost} times; retries: {retries})") \
                        from None
                time.sleep(self.request.orchestration.retry_delay_seconds)

    def adopt(self) -> dict | None:
        """The stage's result if it is in the store, or once the run that holds its claim (another
        `posttrain run`'s, still beating) commits it, `adopted` when it was waited for; None when nobody
        holds it, or once its holder's heartbeat stops."""
        waited = False
        while True:
            cached = cached_result(self.store, self.key)
            if cached is not None:
                return {**cached, "adopted": waited}
            waited = True
            _, holder = current_claim(self.store, self.key)
            now = time.monotonic()
            self.heartbeat.look(self.store, self.key, now)
            if holder is None or stale(holder) or now - self.heartbeat.at > self.workers.lost_after_seconds:
                return None
            self._check_stopping()
            time.sleep(POLL_SECONDS)

    def submit(self, retries: int):
        """A new flow run of the stage on the pool, its task allowed `retries` (what losses left)."""
        from prefect.deployments import run_deployment

        request = self.request.model_copy(update={"orchestration": self.request.orchestration.model_copy(
            update={"retries": retries})})
        job_variables = {**self.workers.job_variables, **stage_job_variables(request.orchestration)}
        name = f"{request.run_id}-{self.stage_id}" + (f"-{len(self.flow_runs) + 1}" if self.flow_runs else "")
        while True:  # PrefectApi.call raises once an outage lasts too long
            flow_run = self.api.call(run_deployment, self.workers.deployment,
                                     parameters=stage_parameters(self.pipeline, request), job_variables=job_variables,
                                     flow_run_name=name, timeout=0)
            if flow_run is not None:
                self.flow_runs.append(flow_run)
                return flow_run
            self._check_stopping()
            time.sleep(POLL_SECONDS)

    def watch(self, flow_run) -> dict:
        """The stage's result once it is in the store; WorkerLost or StageFailed otherwise."""
        submitted, picked_up = time.monotonic(), None
        while True:
            cached = cached_result(self.store, self.key)
            if cached is not None:
                return cached
            now = time.monotonic()
            self.heartbeat.look(self.store, self.key, now)
            state = self.api.call(self._state_of, flow_run.id)
            if state is not None and state.type.value not in WAITING:
                picked_up = picked_up or now
                self._check_final(flow_run, state)
            if picked_up is None and state is not None and now - submitted > self.workers.pickup_timeout_seconds:
                self._no_pickup(flow_run, now - submitted)
            if picked_up is not None:
                self._check_alive(flow_run, now - max(self.heartbeat.at, picked_up))
            self._check_stopping(flow_run)
            time.sleep(POLL_SECONDS)

    def _state_of(self, flow_run_id):
        return self.api.client.read_flow_run(flow_run_id).state

    def _check_final(self, flow_run, state) -> None:
        kind = state.type.value
        if kind not in FINAL or cached_result(self.store, self.key) is not None:
            return  # running, or done: the loop reads the result next
        if kind == "CRASHED":  # the worker reported its infrastructure gone
            raise WorkerLost(f"flow run {flow_run.name} crashed: {state.message or state.name}")
        raise StageFailed(f"flow run {flow_run.name}: {state.message or state.name}")

    def _check_alive(self, flow_run, silent: float) -> None:
        """WorkerLost once the stage's claim has not beaten for lost_after_seconds since the worker
        picked the flow run up, or since its last beat."""
        if silent <= self.workers.lost_after_seconds:
            return
        from prefect.states import Crashed

        message = (f"worker lost: the stage's claim has not beaten for {silent:.0f} s "
                   f"(workers.lost_after_seconds: {self.workers.lost_after_seconds:g})")
        self.api.set_state(flow_run.id, Crashed(message=message))
        raise WorkerLost(message)

    def _no_pickup(self, flow_run, waited: float) -> None:
        from prefect.states import Cancelled

        deployment = self.api.call(self.api.client.read_deployment_by_name, self.workers.deployment)
        pool = deployment.work_pool_name if deployment is not None else f"of {self.workers.deployment}"
        self.api.set_state(flow_run.id, Cancelled(message=f"no worker picked it up within {waited:.0f} s"))
        raise StageFailed(f"stage {self.stage_id!r}: no worker of pool {pool!r} picked it up within {waited:.0f} s "
                          f"(workers.pickup_timeout_seconds; is one running? prefect worker start --pool {pool})")

    def _check_stopping(self, flow_run=None) -> None:
        """The run is stopping (Ctrl-C, SIGTERM): its stage on a worker is cancelled too."""
        if not STOPPING.is_set():
            return
        if flow_run is not None:
            from prefect.states import Cancelling

            self.api.set_state(flow_run.id, Cancelling(message="the pipeline run is stopping"))
        raise StageFailed(f"stage {self.stage_id!r}: the run is stopping")
