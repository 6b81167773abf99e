"""Pipeline spec: typed models mirrored one-to-one by the YAML file, plus loading and checks.

Every mistake a user can make in a spec becomes a SpecError whose one-line message names
the field path (`stages[3].policy: unknown stage 'sftt'`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from artifacts.refs import hash_value
from artifacts.store import FROM_THE_ENVIRONMENT, StoreLocation, credential_keys
from artifacts.urls import CREDENTIALS, credential_url_fields
from envs.dataset import reward_source
from envs.loader import EnvConfig, make_env
from flows.placeholders import ENV_VAR, UnsetVariable, interpolate
from flows.spec_data import (env_inputs, find_reward_modules, inline_env_stages, read_evaluation_sources,
                             read_stage_sources)
from flows.stage_inputs import BadStageInput, input_stage, parse_input
from flows.worker_allows import NotAllowed, WorkerAllows
from models.config import ModelConfig
from tasks.config import Defaults, EvaluationSettings, FieldError, SampledEval, SpecRuleError, SpecView
from tasks.kinds import StageConfig
from tasks.train.trackers import missing_package


class SpecError(Exception):
    """A user mistake in a spec; str() is the one-line message."""


class EvaluationConfig(EvaluationSettings):
    """How every new checkpoint of this pipeline is evaluated (the `evaluate` flow's settings): an
    evaluate stage's settings over the envs listed, sampled accuracy off unless asked.

    `on_new_checkpoint`: with a Prefect server, the served `evaluate-on-checkpoint` deployment
    evaluates on the checkpoint event; without one (ephemeral mode) the pipeline flow
    evaluates each new checkpoint inline, after the stage that made it.
    """

    on_new_checkpoint: bool = False
    envs: list[str] | None = Field(None, min_length=1)  # env ids of the spec; None: all of them
    # the stages whose new checkpoints are evaluated (their in-stage checkpoints too: a learning
    # curve); None: every stage that makes checkpoints
    stages: list[str] | None = Field(None, min_length=1)
    sampled: SampledEval | None = None  # a second pass over the tasks doubles the cost of every checkpoint's

    def evaluates(self, stage_id: str) -> bool:
        """Whether the new checkpoints of stage `stage_id` are evaluated."""
        return self.on_new_checkpoint and (self.stages is None or stage_id in self.stages)


class WorkersConfig(BaseModel):
    """Run every stage as a flow run of a deployment, pulled by the workers of its work pool
    (e.g. GPU pods), instead of in the pipeline flow's own process."""

    model_config = ConfigDict(extra="forbid")

    deployment: str = Field(pattern=r"^[^/]+/[^/]+$")  # "<flow name>/<deployment name>": post-train-stage/gpu-box
    job_variables: dict[str, str | int | float | bool | list | dict] = {}  # merged under each stage's {"gpus": N}
    # a stage whose claim has not beaten this long since its worker picked it up is lost: submitted again
    lost_after_seconds: float = Field(90, gt=0)
    pickup_timeout_seconds: float = Field(600, gt=0)  # no worker took the flow run: the stage fails naming the pool
    api_outage_seconds: float = Field(300, gt=0)  # the Prefect API silent this long: the stage fails (a rerun resumes)


class PipelineSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")
    store: str = "file://.posttrain/store"
    storage_options: dict[str, str | int | float | bool | dict] = {}
    model: ModelConfig = ModelConfig()
    envs: dict[str, EnvConfig]
    defaults: Defaults = Defaults()
    stages: list[StageConfig] = Field(min_length=1)
    evaluation: EvaluationConfig = EvaluationConfig()
    workers: WorkersConfig | None = None
    # how many stages whose inputs are all committed run at once (local tasks or workers' flow runs)
    max_parallel_stages: int = Field(1, ge=1)
    # {name: value} of the environment variables the spec took values from (flows/placeholders.py)
    _filled: dict[str, str] = PrivateAttr(default_factory=dict)

    def inputs_of(self, stage) -> list[tuple[str, str, str | tuple[str, ...]]]:
        """(field path, stage id, what it must produce) of every stage `stage` reads: its own
        references, and the dataset stages of the envs it names (a dataset env's rows)."""
        return [(field, input_stage(written), wanted) for field, written, wanted in self._written_inputs(stage)]

    def written_inputs(self, stage) -> dict[str, str]:
        """{input as the spec writes it (`rl`, `rl@best:arith.accuracy`): the field naming it
        (`stages[2].policy`)}: the keys of the stage's `inputs` (flows/stage_inputs.py)."""
        index = self.stages.index(stage)
        fields = {written: f"stages[{index}].{field}" for field, written, _ in stage.stage_refs()}
        return {written: fields.get(written, field) for field, written, _ in self._written_inputs(stage)}

    def _written_inputs(self, stage) -> list[tuple[str, str, str | tuple[str, ...]]]:
        """(field path, input as written, what it must produce): the stage's own references (their
        paths within the stage), then its envs' (full paths, `envs.chats.data`)."""
        refs = list(stage.stage_refs())
        for _, env_id in stage.env_refs():
            refs += env_inputs(env_id, self.envs[env_id]) if env_id in self.envs else []
        return refs

    def evaluation_envs(self) -> list[str]:
        return self.evaluation.envs or list(self.envs)

    @property
    def filled(self) -> dict[str, str]:
        return self._filled

    def stage(self, stage_id: str):
        return next(s for s in self.stages if s.id == stage_id)

    def store_location(self, uri: str | None = None) -> StoreLocation:
        """The spec's store, or the store at `uri` (a `--store` override) with the spec's options."""
        return StoreLocation(uri=uri or self.store, options=self.storage_options)

    def resolved(self, stage) -> Defaults:
        """The stage's retries/timeouts/gpus/trackers: its own where set, the spec defaults otherwise."""
        return self.defaults.applied_to(stage)


# the tags discriminated unions put in an error's location: a stage's or env's `kind`, a rollout's
# `backend` (local when the mapping names none)
UNION_TAGS = (("kind", None), ("backend", "local"))


def _loc_to_path(loc: tuple, raw: dict) -> str:
    """Pydantic error location -> `stages[3].policy`, dropping union tags."""
    parts: list[str] = []
    node = raw
    for item in loc:
        if _is_tag(node, item):
            continue
        parts.append(f"[{item}]" if isinstance(item, int) else f".{item}" if parts else str(item))
        try:
            node = node[item]
        except (KeyError, IndexError, TypeError):
            node = None
    return "".join(parts)


def _is_tag(node, item) -> bool:
    """Whether `item` is the union tag of the mapping `node` rather than one of its keys (a dataset
    env's rewards are told apart by the key that names their source)."""
    return isinstance(node, dict) and isinstance(item, str) and item not in node and \
        (any(node.get(key, default) == item for key, default in UNION_TAGS) or item == reward_source(node))


def _format_validation_error(error: ValidationError, raw: dict) -> str:
    first = error.errors()[0]
    path = _loc_to_path(tuple(first["loc"]), raw) or "spec"
    kind = first["type"]
    if kind == "extra_forbidden":
        return f"{path}: unknown key"
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        context = first.get("ctx", {})
        tag = context.get("discriminator", "'kind'").strip("'").removesuffix("_of()")  # `kind`, or `backend_of()`
        if not isinstance(first["input"], dict):
            return f"{path}: expected a mapping with a {tag}, got {first['input']!r}"
        if kind == "union_tag_not_found":
            return f"{path}.{tag}: missing"
        expected = context.get("expected_tags", "")
        return f"{path}.{tag}: unknown {tag} {context.get('tag')!r} (expected one of {expected})"
    if kind == "missing":
        return f"{path}: missing"
    return f"{path}: {first['msg']} (got {first['input']!r})" if "input" in first else f"{path}: {first['msg']}"


def parse_spec(raw, spec_dir: str | None = None, read_sources: bool = True,
               allows: WorkerAllows | None = None) -> PipelineSpec:
    """Validate an already-parsed YAML document; raises SpecError. Relative paths of what stages
    read from outside the store resolve against `spec_dir` (the spec file's folder; None: the
    working folder); `read_sources=False` leaves them unread (a spec read back from the store to
    evaluate a checkpoint: the stages that imported data have run). `allows` (a spec read back from
    the store and not given by this process's author): only the variables and endpoints it allows."""
    if not isinstance(raw, dict):
        raise SpecError(f"spec: expected a mapping at the top level, got {type(raw).__name__}")
    filled: dict[str, str] = {}
    try:
        raw = interpolate(raw, filled, check_name=allows.check_variable if allows else None)
        if allows is not None:
            allows.check_endpoints(raw)
        _check_url_credentials(raw)
        spec = PipelineSpec.model_validate(raw)
    except (UnsetVariable, NotAllowed) as exc:
        raise SpecError(str(exc)) from None
    except ValidationError as error:
        raise SpecError(_format_validation_error(error, raw)) from None
    spec._filled = filled
    find_reward_modules(spec, Path(spec_dir) if spec_dir else None)
    _check_envs(spec)
    try:
        inline_env_stages(spec, Path(spec_dir) if spec_dir else None, read_sources)
        if read_sources:
            read_stage_sources(spec, Path(spec_dir) if spec_dir else None)
            read_evaluation_sources(spec, Path(spec_dir) if spec_dir else None)
    except FieldError as exc:
        raise SpecError(str(exc)) from None
    _check_graph(spec)
    if credential_keys(spec.storage_options):
        raise SpecError(f"storage_options.{credential_keys(spec.storage_options)[0]}: credentials must come "
                        "from the environment or the AWS credential chain, not the spec (only known non-secret "
                        "options are accepted here)")
    if read_sources:  # a spec read back from the store only evaluates: its trainings have run
        _check_trackers(spec)
    return spec


def load_spec(path: str | Path) -> tuple[PipelineSpec, str]:
    """Read and validate a spec file; returns the spec and its text."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read spec file ({exc.strerror or type(exc).__name__})") from None
    return parse_spec_text(text, str(path), spec_folder(path)), text


def spec_folder(path: str | Path) -> str:
    """The folder a spec file's relative source paths resolve against."""
    return str(Path(path).resolve().parent)


def parse_spec_text(text: str, source: str = "spec", spec_dir: str | None = None,
                    read_sources: bool = True, allows: WorkerAllows | None = None) -> PipelineSpec:
    """Parse and validate a spec's YAML text (`source` names it in YAML errors). A process parses a
    given text once: the CLI, the flow it starts and an inline evaluation reading the same text
    back from the store share the result (keyed by the text, the values of the environment
    variables it names and `spec_dir`, which relative source paths resolve against). The spec is shared, so nobody may modify it (model_copy(update=...)
    makes a new one). Without `allows` the text is its author's (trusted: filled from the whole
    environment), and a spec read back from the store with the same text is too (`checkpoint_spec`)."""
    names = sorted({match.group(1) for match in ENV_VAR.finditer(text)})
    if allows is None:
        _AUTHORED.add(_full_hash(text))
    try:
        return _parse_text(text, tuple((name, os.environ.get(name)) for name in names), spec_dir, read_sources,
                           allows)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise SpecError(f"{source}:{where}: bad YAML: {problem}") from None


_PARSED: dict[tuple, dict] = {}  # (text, environment, allows) -> {(spec_dir, read_sources): spec}
_PARSED_TEXTS = 16
_AUTHORED: set[str] = set()  # the sha256 of every spec text this process was given by its author


def _full_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _parse_text(text: str, environment: tuple, spec_dir: str | None, read_sources: bool,
                allows: WorkerAllows | None) -> PipelineSpec:
    """One parse per (text, environment, allows, spec_dir, read_sources); a parse that leaves sources
    unread (a spec read back from the store) takes any parse of the same text under the same
    allowances, which only adds to it."""
    parses = _PARSED.setdefault((text, environment, allows), {})
    if (spec_dir, read_sources) in parses:
        return parses[(spec_dir, read_sources)]
    if not read_sources and parses:
        return next(iter(parses.values()))
    spec = parse_spec(yaml.safe_load(text), spec_dir, read_sources, allows)
    parses[(spec_dir, read_sources)] = spec
    while len(_PARSED) > _PARSED_TEXTS:
        del _PARSED[next(iter(_PARSED))]
    return spec


def spec_hash_of(text: str) -> str:
    """The name a spec's text is kept under in the store (`specs/<hash>.yaml`)."""
    return hash_value(text)[:16]


def checkpoint_spec(store, manifest: dict) -> PipelineSpec | None:
    """The spec a checkpoint was made from (every run keeps it in the store, `specs/<hash>.yaml`);
    None when its producer records none. StoreError if the file is gone, SpecError if it no
    longer parses, does not hash to its name, or asks for what this worker does not allow.

    Whoever writes to the store may have written it: unless this process's author gave the very
    same text, it is filled and checked under the worker's allow-lists (flows/worker_allows.py)."""
    spec_hash = manifest["producer"].get("spec")
    if not spec_hash:
        return None
    source = f"specs/{spec_hash}.yaml"
    data = store.read_bytes(store.path("specs", f"{spec_hash}.yaml"))
    try:
        text = _stored_text(data, spec_hash)
        allows = None if _full_hash(text) in _AUTHORED else WorkerAllows.from_environ()
        return parse_spec_text(text, source, read_sources=False, allows=allows)
    except (SpecError, NotAllowed) as exc:
        raise SpecError(f"{source} (the spec of {manifest['ref']}): {exc}") from None


def _stored_text(data: bytes, spec_hash: str) -> str:
    """A kept spec's text, once it hashes to its name; SpecError otherwise."""
    try:
        text = data.decode()
    except UnicodeDecodeError:
        text = None
    if text is None or spec_hash_of(text) != spec_hash:
        raise SpecError("its text does not hash to its name (changed in the store after a run kept it): refused")
    return text


def _check_envs(spec: PipelineSpec) -> None:
    """Each env builds: its task folder exists and every task in it loads (the message names the file)."""
    for env_id, config in spec.envs.items():
        try:
            make_env(env_id, config)
        except ValueError as exc:
            raise SpecError(f"envs.{env_id}.{getattr(exc, 'field', 'tasks')}: {exc}") from None


def _check_trackers(spec: PipelineSpec) -> None:
    """Every tracker a `report_to` names has its package installed (the extra of the same name)."""
    named = [("defaults.report_to", spec.defaults.report_to)]
    named += [(f"stages[{i}].report_to", getattr(stage, "report_to", None) or [])
              for i, stage in enumerate(spec.stages)]
    for path, trackers in named:
        for tracker in trackers:
            install = missing_package(tracker)
            if install:
                raise SpecError(f"{path}: {tracker} is not installed; {install}")


def _check_url_credentials(raw: dict) -> None:
    """No credentials in any URL of the spec (every endpoint, the store and its `endpoint_url`,
    `mlflow_uri`, a dataset's source: artifacts/urls.py says what counts): the spec travels to
    workers and Prefect parameters, and an error naming the URL to states, logs and summaries.
    Checked on the filled document before the fields are validated, whose errors repeat the value."""
    fields = credential_url_fields(raw)
    if fields:
        raise SpecError(f"{fields[0]}: {CREDENTIALS}; {_where_credentials_go(fields[0])}")


def _where_credentials_go(field: str) -> str:
    """Where the credentials of the URL at `field` come from instead."""
    name = field.rsplit(".", 1)[-1]
    if name == "mlflow_uri":
        return "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN, in the environment"
    if name == "endpoint":  # a rollout server, a teacher, a judge
        return "give the key through api_key_env"
    return FROM_THE_ENVIRONMENT  # the store, its options, a dataset's source


def _check_held_out_as(spec: PipelineSpec) -> None:
    """An env's `held_out_as` names another env that reads task rows."""
    from envs.dataset.config import TaskRows

    row_envs = [env_id for env_id, config in spec.envs.items() if isinstance(config, TaskRows)]
    for env_id in row_envs:
        other = spec.envs[env_id].held_out_as
        if other is not None and (other == env_id or other not in row_envs):
            raise SpecError(f"envs.{env_id}.held_out_as: {other!r} is not another env of task rows "
                            f"(those: {', '.join(e for e in row_envs if e != env_id) or 'none'})")


def _check_graph(spec: PipelineSpec) -> None:
    """Ids unique, references resolve to the right artifact kind, no cycles."""
    index = {}
    for i, stage in enumerate(spec.stages):
        if stage.id in index:
            raise SpecError(f"stages[{i}].id: duplicate stage id {stage.id!r}")
        index[stage.id] = i
    for i, stage in enumerate(spec.stages):
        for field, env_id in stage.env_refs():
            if env_id not in spec.envs:
                raise SpecError(f"stages[{i}].{field}: unknown env {env_id!r} (known: {', '.join(spec.envs)})")
        for field, written, wanted in stage.stage_refs():
            target = _checked_input(spec, f"stages[{i}].{field}", written, wanted)
            if target not in index:
                raise SpecError(f"stages[{i}].{field}: unknown stage {target!r}")
            produced = spec.stages[index[target]].output_kind()
            wanted = (wanted,) if isinstance(wanted, str) else wanted
            if produced is not None and produced not in wanted:
                raise SpecError(f"stages[{i}].{field}: stage {target!r} produces a {produced}, "
                                f"a {' or a '.join(wanted)} is expected here")
    for env_id, config in spec.envs.items():
        for field, target, wanted in env_inputs(env_id, config):
            if target not in index:
                raise SpecError(f"{field}: unknown stage {target!r}")
            produced = spec.stages[index[target]].output_kind()
            if produced is not None and produced != wanted:
                raise SpecError(f"{field}: stage {target!r} produces a {produced}, a {wanted} is expected here")
    _check_held_out_as(spec)
    for i, env_id in enumerate(spec.evaluation.envs or []):
        if env_id not in spec.envs:
            raise SpecError(f"evaluation.envs[{i}]: unknown env {env_id!r} (known: {', '.join(spec.envs)})")
    for i, stage_id in enumerate(spec.evaluation.stages or []):
        if stage_id not in index:
            raise SpecError(f"evaluation.stages[{i}]: unknown stage {stage_id!r}")
        if spec.stages[index[stage_id]].output_kind() != "checkpoint":
            raise SpecError(f"evaluation.stages[{i}]: stage {stage_id!r} makes no checkpoints")
    _check_acyclic(spec, index)
    view = SpecView(stages=spec.stages, envs=spec.envs, model=spec.model, defaults=spec.defaults)
    for stage in spec.stages:
        try:
            stage.check_spec(view)
        except SpecRuleError as exc:
            raise SpecError(str(exc)) from None


def _checked_input(spec: PipelineSpec, field: str, written: str, wanted: str | tuple[str, ...]) -> str:
    """The stage id an input reads; SpecError for a malformed `@best:` selector, one on an input
    that is not a checkpoint, or one naming an unknown env."""
    try:
        parsed = parse_input(written)
    except BadStageInput as exc:
        raise SpecError(f"{field}: {exc}") from None
    if isinstance(parsed, str):
        return parsed
    if "checkpoint" not in ((wanted,) if isinstance(wanted, str) else wanted):
        raise SpecError(f"{field}: {written!r}: only a checkpoint input can name the best evaluated checkpoint")
    if parsed.env not in spec.envs:
        raise SpecError(f"{field}: {written!r}: unknown env {parsed.env!r} (known: {', '.join(spec.envs)})")
    return parsed.stage


def _check_acyclic(spec: PipelineSpec, index: dict[str, int]) -> None:
    state: dict[str, str] = {}

    def visit(stage_id: str, trail: list[str]) -> None:
        if state.get(stage_id) == "done":
            return
        if state.get(stage_id) == "active":
            cycle = trail[trail.index(stage_id):] + [stage_id]
            raise SpecError(f"stages[{index[cycle[0]]}]: cycle {' -> '.join(cycle)}")
        state[stage_id] = "active"
        for _, target, _ in spec.inputs_of(spec.stages[index[stage_id]]):
            visit(target, trail + [stage_id])
        state[stage_id] = "done"

    for stage in spec.stages:
        visit(stage.id, [])


def stage_graph(spec: PipelineSpec) -> dict[str, list[str]]:
    """{stage id: the ids of the stages it reads}, in topological order."""
    return {stage.id: list(dict.fromkeys(target for _, target, _ in spec.inputs_of(stage)))
            for stage in topological_order(spec)}


def topological_order(spec: PipelineSpec) -> list:
    """Stages in an order where every stage comes after the stages it reads."""
    done: list[str] = []

    def visit(stage_id: str) -> None:
        if stage_id in done:
            return
        for _, target, _ in spec.inputs_of(spec.stage(stage_id)):
            visit(target)
        done.append(stage_id)

    for stage in spec.stages:
        visit(stage.id)
    return [spec.stage(stage_id) for stage_id in done]
