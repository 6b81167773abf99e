"""The evaluation flow: one checkpoint on the envs of the spec it came from.

Run by the `evaluate-on-checkpoint` trigger (the event payload names the ref and the store),
inline by the pipeline flow in ephemeral mode, or by hand (`posttrain eval REF`). It runs the
`evaluate` stage kind over that one checkpoint, so its results dataset passes the evaluation
contract and it is cached like any stage: the same checkpoint with the same settings is
evaluated once. Outputs: `<checkpoint name>.eval` (results) and `<checkpoint name>.eval.report`
(markdown + PNG), both with the checkpoint as their input in lineage; then the pipeline's
leaderboard is published as a Prefect table artifact.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta

from prefect import flow, get_run_logger
from pydantic import ValidationError
from prefect.runtime import deployment, flow_run
from prefect.states import Completed

from artifacts.allow_list import StoreNotAllowed, allowed_entries, check_allowed
from artifacts.refs import BadRef, Ref
from artifacts.store import Store, StoreError, StoreLocation
from envs.loader import ENV_CONFIG, ENV_KINDS
from flows.leaderboard import publish_leaderboard
from flows.learning_curves import publish_stage_curves
from flows.report_artifacts import publish_reports
from flows.spec import PipelineSpec, SpecError, checkpoint_spec
from flows.spec_data import env_inputs
from flows.stage_requests import new_run_id, stage_request
from flows.stage_requests import keep_sources
from tasks.common.benchmarks import is_benchmark
from tasks.config import FieldError
from tasks.request import StageRequest
from tasks.runtime.launch import warm_up
from tasks.runtime.runner import run_stage, stage_task_options
from tasks.stages.evaluate import EvaluateStage


DUPLICATE_DELIVERY = "a second delivery of event"


class EvaluationInputError(Exception):
    """The checkpoint, store or settings of an evaluation are unusable; str() is one line."""


# How far apart two deliveries of one event may start and still be told apart as one.
REDELIVERY_WINDOW = timedelta(hours=1)


def first_run_of_event(flow_run_id, event_id: str):
    """The first-created run of this run's deployment whose `event_id` parameter is `event_id`
    (this run itself, unless the event was delivered twice): ties go to the lower id, so two
    deliveries started at once agree on which one evaluates."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    with get_client(sync_client=True) as client:
        this_run = client.read_flow_run(flow_run_id)
        since = this_run.expected_start_time - REDELIVERY_WINDOW
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            deployment_id={"any_": [this_run.deployment_id]}, expected_start_time={"after_": since}), limit=200)
    same_event = [run for run in runs if run.parameters.get("event_id") == event_id] or [this_run]
    return min(same_event, key=lambda run: (run.created, str(run.id)))


@dataclass
class EvaluationPlan:
    spec: PipelineSpec
    stage: EvaluateStage
    request: StageRequest
    label: str  # the checkpoint's name within its pipeline: `sft`, `rl.step-50`


def checkpoint_label(ref: Ref, pipeline: str) -> str:
    prefix = f"{pipeline}/"
    return ref.name[len(prefix):] if ref.name.startswith(prefix) else ref.name.replace("/", "-")


def load_checkpoint_spec(store: Store, manifest: dict) -> PipelineSpec:
    """The spec the checkpoint was made from, for its envs and evaluation settings."""
    try:
        spec = checkpoint_spec(store, manifest)
    except SpecError as exc:
        raise EvaluationInputError(str(exc)) from None
    if spec is None:
        raise EvaluationInputError(f"ref: {manifest['ref']} records no spec to take its envs from")
    return spec


def with_envs(spec: PipelineSpec, envs: list[str] | None) -> tuple[PipelineSpec, list[str]]:
    """The env ids to evaluate on: the spec's `evaluation.envs` unless given; a name that is no env
    id of the spec but an env kind means that kind with its default settings."""
    if not envs:
        return spec, spec.evaluation_envs()
    extra = {}
    for env in envs:
        if env in spec.envs:
            continue
        if env not in ENV_KINDS:
            raise EvaluationInputError(f"env: {env!r} is neither an env of spec {spec.name!r} "
                                       f"({', '.join(spec.envs)}) nor an env kind ({', '.join(ENV_KINDS)})")
        extra[env] = ENV_CONFIG.validate_python({"kind": env})
    return spec.model_copy(update={"envs": {**spec.envs, **extra}}), list(envs)


def evaluation_stage(spec: PipelineSpec, env_ids: list[str], checkpoint: str, n: int | None,
                     max_new_tokens: int | None, benchmarks: dict | None = None) -> EvaluateStage:
    """An evaluate stage over one checkpoint with the spec's `evaluation:` settings (n and
    max_new_tokens overridable; `benchmarks`, {`lm_eval` | `humaneval`: settings}, replace the spec's)."""
    settings = spec.evaluation
    return EvaluateStage(kind="evaluate", id="evaluate", checkpoints=[checkpoint], envs=env_ids,
                         **{**settings.evaluation_settings(), "n": n or settings.n,
                            "max_new_tokens": max_new_tokens or settings.max_new_tokens, **(benchmarks or {})})


def evaluation_sources_path(store: Store, spec_hash: str) -> str:
    return store.path("specs", f"{spec_hash}.sources.json")


def keep_evaluation_sources(store: Store, spec: PipelineSpec, spec_hash: str) -> None:
    """The files the spec's `evaluation:` reads from outside the store (lm_eval.include_path), kept in the
    store (`sources/<digest>/`) and named beside the spec (`specs/<hash>.sources.json`): an evaluation
    triggered later, on any machine, reads the files the latest run of this spec saw."""
    kept = keep_sources(spec.evaluation, store.location)
    if kept:
        store.write_json(evaluation_sources_path(store, spec_hash), kept)


def with_benchmark_sources(stage: EvaluateStage, store: Store, spec_hash: str, given: bool) -> None:
    """The stage's lm_eval.include_path: read from the working folder when given by hand (`given`),
    else the files a run of the spec kept in the store (EvaluationInputError when none did)."""
    if stage.lm_eval is None or stage.lm_eval.include_path is None:
        return
    if given:
        try:
            stage.read_benchmark_sources(None, store.location)
        except FieldError as exc:
            raise EvaluationInputError(str(exc)) from None
        return
    try:
        stage.use_kept_sources(store.read_json(evaluation_sources_path(store, spec_hash)))
    except (StoreError, KeyError):
        raise EvaluationInputError(f"evaluation.lm_eval.include_path: the task files of spec {spec_hash[:12]} "
                                   "are not in the store (kept by `posttrain run` of the spec)") from None


def env_data_inputs(spec: PipelineSpec, env_ids: list[str], store: Store, manifest: dict) -> dict[str, str]:
    """The dataset stages a dataset env reads its rows from: the version the checkpoint was trained
    with (its manifest's inputs) or else the latest one committed."""
    inputs = {}
    for env_id in env_ids:
        for _, data_id, _ in env_inputs(env_id, spec.envs[env_id]):
            try:
                inputs[data_id] = manifest["inputs"].get(data_id) or str(store.latest(f"{spec.name}/{data_id}"))
            except (BadRef, StoreError) as exc:
                raise EvaluationInputError(f"env: {env_id} reads its rows from stage {data_id!r}, which has no "
                                           f"committed dataset: {exc}") from None
    return inputs


def plan_evaluation(checkpoint_ref: str, store: Store, *, envs: list[str] | None = None, n: int | None = None,
                    max_new_tokens: int | None = None, run_id: str | None = None,
                    benchmarks: dict | None = None) -> EvaluationPlan:
    """Check the inputs and build the evaluate request; EvaluationInputError on bad input. `benchmarks`
    ({`lm_eval` | `humaneval`: settings}, by hand) replace the spec's; given without `envs`, they run alone."""
    try:
        ref = store.resolve(checkpoint_ref)
        manifest = store.manifest(ref)
    except (BadRef, StoreError) as exc:
        raise EvaluationInputError(f"ref: {exc}") from None
    if manifest["kind"] != "checkpoint":
        raise EvaluationInputError(f"ref: {ref} is a {manifest['kind']}, not a checkpoint")
    try:
        spec = load_checkpoint_spec(store, manifest)
    except StoreError as exc:
        raise EvaluationInputError(f"ref: {exc}") from None
    spec, env_ids = with_envs(spec, envs) if envs or not benchmarks else (spec, [])
    label = checkpoint_label(ref, spec.name)
    try:
        stage = evaluation_stage(spec, env_ids, label, n, max_new_tokens, benchmarks)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise EvaluationInputError(f"{'.'.join(map(str, error['loc']))}: {error['msg']}") from None
    with_benchmark_sources(stage, store, manifest["producer"]["spec"], given="lm_eval" in (benchmarks or {}))
    inputs = {label: str(ref), **env_data_inputs(spec, env_ids, store, manifest)}
    request = stage_request(spec, stage, inputs, store=store.location, run_id=run_id or new_run_id("eval"),
                            spec_hash=manifest["producer"]["spec"], output_name=f"{ref.name}.eval")
    return EvaluationPlan(spec, stage, request, label)


@flow(name="evaluate")
def evaluate(checkpoint_ref: str, store: str, storage_options: dict | str | None = None,
             envs: list[str] | None = None, n: int | None = None, max_new_tokens: int | None = None,
             event_id: str | None = None, benchmarks: dict | None = None):
    """Evaluate one checkpoint; returns {checkpoint, state (completed | cached), results, report, metrics,
    compute_seconds (the evaluate stage's own time, in the run that made the results)}.

    `storage_options` may come as JSON text (how a trigger's template renders the event's dict).
    A run of a deployment opens only a store POSTTRAIN_ALLOWED_STORES allows where it runs
    (artifacts.allow_list): an event names the store, and whoever posts events is not trusted.
    `event_id` (from the trigger): a second run for the same event completes at once, evaluating
    nothing, with a message naming the run that evaluates.
    """
    logger = get_run_logger()
    if event_id and deployment.id is not None:
        first = first_run_of_event(flow_run.id, event_id)
        if str(first.id) != str(flow_run.id):
            return Completed(message=f"{DUPLICATE_DELIVERY} {event_id}: flow run {first.name} evaluates it")
    warm_up()
    if isinstance(storage_options, str):
        storage_options = json.loads(storage_options or "{}")
    if deployment.id is not None:  # an event's trigger, or an API caller: the store must be allowed here,
        try:  # checked before it is opened (some filesystems connect as they are made)
            check_allowed(StoreLocation(uri=store, options=storage_options or {}), allowed_entries())
        except StoreNotAllowed as exc:
            raise EvaluationInputError(str(exc)) from None
    artifact_store = Store(store, storage_options)
    plan = plan_evaluation(checkpoint_ref, artifact_store, envs=envs, n=n, max_new_tokens=max_new_tokens,
                           benchmarks=benchmarks)
    options = stage_task_options(plan.request, f"evaluate {plan.label}")
    state = run_stage.with_options(**options)(plan.request, return_state=True)
    result = state.result()  # raises the stage's error: the flow run fails with it
    cached = state.name == "Cached"
    metrics = result["metrics"][plan.label]
    checkpoint_ref = plan.request.inputs[plan.label]  # pinned, if it came as name@latest
    logger.info(f"{checkpoint_ref}: {'cached' if cached else 'evaluated'} on {', '.join(metrics)} "
                f"-> {result['outputs']['results']}")
    for env_id, values in metrics.items():
        if is_benchmark(env_id):
            logger.info(f"  {env_id}: " + ", ".join(f"{name} {value}" for name, value in values.items()))
            continue
        logger.info(f"  {env_id}: accuracy {values['accuracy']:.1%}, format {values['format_rate']:.1%}, "
                    f"doom-loop {values['doom_loop_rate']:.1%} (n={values['n']})")
    publish_reports(artifact_store, plan.spec.name, f"{plan.label}-eval", result["outputs"])
    publish_leaderboard(artifact_store, plan.spec.name)
    publish_stage_curves(artifact_store, plan.spec.name, checkpoint_ref)
    return {"checkpoint": checkpoint_ref, "state": "cached" if cached else "completed",
            "results": result["outputs"]["results"], "report": result["outputs"]["report"], "metrics": metrics,
            "compute_seconds": result["compute_seconds"]}
