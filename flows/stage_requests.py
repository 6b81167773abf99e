"""What the orchestrator hands a stage (its request, resolved once from the spec: config, inputs,
cache key, provenance, orchestration settings) and what it reads of the stage's final state."""

from __future__ import annotations

import secrets
from datetime import datetime, timezone

from artifacts.refs import hash_value
from artifacts.store import StoreLocation, first_line
from envs.loader import env_package
from flows.placeholders import digest, with_placeholders
from flows.request_signing import request_key, sign
from flows.spec import PipelineSpec
from models.loading import base_identity
from tasks.request import Producer, StageRequest
from tasks.runtime.cache import code_packages, code_version, package_code_version, stage_cache_key, task_folder_digest


def stage_request(spec: PipelineSpec, stage, inputs: dict[str, str], *, store: StoreLocation, run_id: str,
                  spec_hash: str | None, output_name: str | None = None) -> StageRequest:
    """The request `tasks.runtime.runner.run_stage` runs; `output_name` renames its primary output
    (default `<pipeline>/<stage id>`)."""
    env_ids = [env_id for _, env_id in stage.env_refs()]
    envs = {env_id: spec.envs[env_id] for env_id in env_ids}
    base = base_identity(spec.model.base)
    carried = {env_id: reward_code(config) for env_id, config in envs.items()}  # read once: key and request
    context = {"model": spec.model.model_dump(), "base": base,
               "envs": {env_id: config.model_dump() for env_id, config in envs.items()},
               "env_data": {env_id: task_folder_digest(config) for env_id, config in envs.items()},
               "env_code": {env_id: env_code(config, carried[env_id]) for env_id, config in envs.items()}}
    kept = keep_sources(stage, store)
    if kept:
        context["sources"] = kept
    backend = rollout_package(stage)
    if backend is not None:
        context["rollout_code"] = backend
    key = stage_cache_key(stage, inputs, context)
    producer = Producer(pipeline=spec.name, run_id=run_id, stage_id=stage.id, stage_kind=stage.kind,
                        config_hash=hash_value(stage.params())[:16], code_version=code_version(), cache_key=key,
                        spec=spec_hash, base_model=base if stage.reads_base_model() else None)
    return StageRequest(stage=stage, pipeline=spec.name, run_id=run_id, cache_key=key, model=spec.model, envs=envs,
                        inputs=inputs, store=store, producer=producer, orchestration=spec.resolved(stage),
                        evaluate_new_checkpoints=spec.evaluation.evaluates(stage.id), output_name=output_name,
                        sources=kept, code={path: source for code in carried.values() for path, source in code.items()},
                        filled=sorted(spec.filled), accelerate_config=launch_config(stage))


def rollout_package(stage) -> dict | None:
    """What identifies a stage's rollout backend in its cache key when a package declared it (its
    distribution's code hash, as a package's env kind); None for the project's own backends."""
    rollout = getattr(stage, "rollout", None)
    if rollout is None:
        return None
    code = package_code_version(type(rollout).__module__)
    return None if code is None else {"backend": rollout.backend, "code": code}


def launch_config(stage) -> str | None:
    """A training stage's accelerate config file, as text (tasks.config.TrainStage.launch_config)."""
    return stage.launch_config() if hasattr(stage, "launch_config") else None


def stage_parameters(spec: PipelineSpec, request: StageRequest) -> dict:
    """The parameters of the stage's flow run on a worker: the request as JSON with every value the
    spec took from this process's environment put back as its `${VAR}` (the worker fills it), and
    with POSTTRAIN_REQUEST_KEY set, their signature (flows/request_signing.py)."""
    payload = request.model_dump(mode="json")
    check = digest(payload)
    payload, placed = with_placeholders(payload, spec.filled)
    parameters = {"request": payload, "placeholders": placed, "request_digest": check}
    key = request_key()
    if key is not None:  # only then: a deployment of code older than the signature takes the others
        parameters["request_signature"] = sign(key, payload, placed, check)
    return parameters


def keep_sources(stage, store: StoreLocation) -> dict[str, dict]:
    """Read each of the stage's outside sources once and keep it in the store under its content hash
    (data_contracts/snapshots.py); a hub dataset is named with its cached revision."""
    from data_contracts.snapshots import keep
    from data_contracts.sources import hub_revision, options_for, source_files

    kept = {}
    for name, source in stage.sources().items():
        if isinstance(source, dict):  # kept already: a triggered evaluation's include_path (flows/evaluate.py)
            kept[name] = source
            continue
        if source.kind == "hub":
            kept[name] = {"hub": source.where, "revision": hub_revision(source.where)}
            continue
        kept[name] = keep(store.open(), source_files(source, options_for(source, store.uri, store.options)))
    return kept


def env_code(config, carried: dict[str, str]) -> dict | None:
    """What identifies an env's code outside the project in cache keys: a package kind's
    distribution, version and code hash, and the code of the reward modules it names that travel
    with the request (`carried`, from `reward_code`); None when all of it is the project's (the code
    version covers it)."""
    code = {}
    package = env_package(config)
    if package is not None:
        code.update(package=package, code=package_code_version(type(config).__module__))
    if carried:
        code["rewards"] = hash_value(carried)
    return code or None


def reward_code(config) -> dict[str, str]:
    """{path in its module's folder: source} of the reward modules a dataset env finds in the spec's
    folder (or a named file's; envs/dataset/reward_modules.py), not the project's: they travel with the request, so
    the stage's process, here or on a worker, imports the very code the orchestrator saw."""
    from envs.dataset import module_files
    from envs.dataset.config import TaskRows

    if not isinstance(config, TaskRows) or config.reward_folder is None:
        return {}
    carried = {}
    for reward in config.reward_functions():
        folder = reward.module_folder(config.reward_folder)
        if folder is None or reward.module.split(".")[0] in code_packages():
            continue
        for file in module_files(reward.module, folder) or []:
            if file.suffix == ".py":
                carried[file.relative_to(folder).as_posix()] = file.read_text()
    return carried


def new_run_id(prefix: str) -> str:
    """`<prefix>-<UTC time>-<4 hex>`: a pipeline run's id (prefix: the pipeline) or an evaluation's (`eval`)."""
    return f"{prefix}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def state_error(state) -> str:
    """One line for a failed task's or flow's state: its final exception's first line."""
    try:
        state.result()
    except Exception as exc:  # the run's final exception
        return first_line(exc) or type(exc).__name__
    return first_line(state.message or "") or state.name
