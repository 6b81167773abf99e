"""What every stage kind's config shares: orchestration defaults, the kind's declaration, the
spec-rule hook, and the field groups several kinds use (endpoints, optimizer, anti-doom).

Each stage kind's own config class lives in its module (tasks/stages/<kind>.py, or a package's
module declared through the `posttrain.stages` entry points; tasks/kinds.py collects them). The
YAML `stages:` entries mirror those classes one-to-one. Kept free of heavy imports so that
`posttrain validate` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from artifacts.urls import scrub_urls
from data_contracts.config import ContractConfig
from envs.judge_requests import JudgeRequests
from models.config import ModelConfig
from tasks.common.benchmarks import HumanEvalSettings, LmEvalSettings

StageId = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")


# the experiment trackers a training stage can report to (tasks/train/trackers.py)
Tracker = Literal["mlflow", "tensorboard", "wandb"]


class Defaults(BaseModel):
    """A stage's orchestration settings: the spec's `defaults:`, and each stage's resolved ones.
    None of them enters the stage's cache key."""

    model_config = ConfigDict(extra="forbid")

    retries: int = Field(2, ge=0)
    retry_delay_seconds: float = Field(5, ge=0)
    timeout_seconds: float = Field(3600, gt=0)
    gpus: int = Field(0, ge=0)
    report_to: list[Tracker] = []  # training stages only
    mlflow_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else mlruns/ where `posttrain run` runs

    def applied_to(self, stage) -> Defaults:
        """The stage's settings: its own where set, these otherwise; a kind that wants no accelerator
        (StageBase.uses_accelerator) takes no GPU from these, only from its own `gpus:`."""
        own = {key: getattr(stage, key, None) for key in Defaults.model_fields}  # report_to: training stages only
        own = {key: value for key, value in own.items() if value is not None}
        if not type(stage).uses_accelerator:
            own.setdefault("gpus", 0)
        return self.model_copy(update=own)


# why a generate or grpo stage refuses an env whose episodes restart their context (cod's packs): such
# an episode is not one token sequence, only steppo's rows per step can train on it
ONE_SEQUENCE_ONLY = ("restarts its context for every task of a pack; only an rl stage with algorithm: steppo "
                     "can train on it")


class StageKindError(Exception):
    """A package's stage kind cannot be used: it fails to import or declares itself wrongly
    (tasks/kinds.py). Defined here so the CLI can catch it without loading the kinds."""


class FieldError(ValueError):
    """A stage field that cannot be used (`read_sources`); the spec check prints
    `stages[i].{field}: {message}`."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


class SpecRuleError(Exception):
    """A stage's cross-stage rule refused the spec; the spec check prints `{path}: {message}`."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path, self.message = path, message


@dataclass(frozen=True)
class SpecView:
    """What a stage's `check_spec` sees of the whole spec: the stages (their references already
    resolve, the graph has no cycle) and the env configs."""

    stages: list
    envs: dict  # env id -> env config
    model: ModelConfig = field(default_factory=ModelConfig)
    defaults: Defaults = field(default_factory=Defaults)

    def gpus(self, stage) -> int:
        """The GPUs a stage holds: its own `gpus`, else the defaults' (Defaults.applied_to)."""
        return self.defaults.applied_to(stage).gpus

    def index(self, stage_id: str) -> int:
        return next(i for i, stage in enumerate(self.stages) if stage.id == stage_id)

    def stage(self, stage_id: str):
        return self.stages[self.index(stage_id)]

    def env_class(self, env_id: str) -> type:
        from envs.loader import ENV_CLASSES

        return ENV_CLASSES[type(self.envs[env_id])]

    def error(self, stage_id: str, field: str | None, message: str) -> SpecRuleError:
        """The error to raise for `field` of stage `stage_id` (None: the stage as a whole)."""
        path = f"stages[{self.index(stage_id)}]" + (f".{field}" if field else "")
        return SpecRuleError(path, message)


class StageBase(BaseModel):
    """Fields every stage has (the orchestration ones fall back to the spec's `defaults`), and the
    declaration every stage kind makes as class attributes (not spec fields):

    - `outputs`: the keys of the outputs its `run` returns; `primary`: the one downstream stages
      read, committed as `<pipeline>/<stage id>` (the others as `<pipeline>/<stage id>.<key>`);
    - `produces`: what the spec's graph sees its primary output as (`dataset` of SFT examples,
      `rollouts`, `checkpoint`, `evaluation`), so a `policy:` cannot name a dataset;
    - `preload`: heavy modules its process needs, imported once by the warm fork server;
    - `runs`: the module holding `run(stage, ctx)`; None means the config class's own module;
    - `publishes_weights`: whether it sends the weights it trains to its `rollout:` backend (rl);
    - `uses_accelerator`: whether its work wants an accelerator; a kind that does not (dataset;
      synthesize, whose teacher is an oracle or an endpoint) takes no GPU from `defaults.gpus`, only
      from its own `gpus:`.
    """

    model_config = ConfigDict(extra="forbid")

    outputs: ClassVar[tuple[str, ...]]
    primary: ClassVar[str]
    produces: ClassVar[str]
    preload: ClassVar[tuple[str, ...]] = ()
    runs: ClassVar[str | None] = None
    publishes_weights: ClassVar[bool] = False
    uses_accelerator: ClassVar[bool] = True

    id: str = StageId
    retries: int | None = Field(None, ge=0)
    retry_delay_seconds: float | None = Field(None, ge=0)
    timeout_seconds: float | None = Field(None, gt=0)
    gpus: int | None = Field(None, ge=0)
    contract: ContractConfig | None = None  # overrides for the data contract of the stage's dataset

    @field_validator("rollout", check_fields=False)
    @classmethod
    def _rollout_fits(cls, rollout):
        """A kind with a `rollout:` field: its backend's fields fit what the kind does with it."""
        rollout.check_use(publishes=cls.publishes_weights)
        return rollout

    @classmethod
    def kind_name(cls) -> str:
        return cls.model_fields["kind"].annotation.__args__[0]

    @classmethod
    def run_module(cls) -> str:
        return cls.runs or cls.__module__

    def env_refs(self) -> list[tuple[str, str]]:
        """(field path, env id) pairs this stage names."""
        return []

    def stage_refs(self) -> list[tuple[str, str, str | tuple[str, ...]]]:
        """(field path, stage id, what that stage must produce: one kind or a tuple of kinds) for
        every input stage."""
        return []

    def reads_base_model(self) -> bool:
        """Whether the stage starts from the spec's base model (not from an input checkpoint)."""
        return False

    def read_sources(self, spec_dir, store) -> None:
        """Check what the stage reads from outside the store (a dataset's source, its columns), with
        relative paths resolved against `spec_dir` (the spec file's folder; None: the working
        folder) and URLs on the store's filesystem read with its options (`store`: the spec's
        StoreLocation); raise `FieldError`. Run while the spec is parsed, before the graph checks."""

    def sources(self) -> dict:
        """{name: data_contracts.sources.Source} the orchestrator keeps in the store for the stage
        (tasks/runtime and flows/stage_requests.py); their content hashes enter its cache key."""
        return {}

    def output_kind(self) -> str | None:
        """What the graph sees the primary output as: the class's `produces`, unless the instance
        decides (a dataset's format); None when only the stage's run can tell (a hub dataset's
        format), so the graph accepts it and the reading stage checks its rows."""
        return type(self).produces

    def check_spec(self, spec: SpecView) -> None:
        """The kind's rules across stages and envs, run once the references resolve; raise
        `spec.error(stage id, field, message)`."""

    def check_pairable(self, spec: SpecView, preference_id: str) -> None:
        """Called when preference stage `preference_id` pairs this stage's rollouts: raise unless
        every prompt group holds two completions, sampled ones among them."""

    def endpoints(self) -> list[tuple[str, object]]:
        """(field, config) of the servers the stage talks to: a `rollout` server (ServerRollout), a teacher
        or a judge (Endpoint); what `posttrain validate --check-endpoints` checks."""
        return []

    def params(self) -> dict:
        """What decides the stage's output (its cache key), without orchestration settings."""
        return self.model_dump(exclude={"id", *Defaults.model_fields})


class Endpoint(BaseModel):
    """A model behind an OpenAI-compatible endpoint (`posttrain serve-model`, vLLM, an API)."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str = Field(pattern=r"^https?://\S+$")  # base URL, ending in /v1
    model: str  # the name the endpoint serves it under
    api_key_env: str | None = None  # the environment variable holding the API key (never the key itself)

    def describe(self) -> str:
        return f"{self.model} at {scrub_urls(self.endpoint)}"


class EndpointTeacher(Endpoint):
    """A teacher model at an endpoint: it plays the env's train tasks for SFT data."""

    max_tokens: int = Field(256, gt=0)  # per action (per turn of a multi-turn env)
    temperature: float = Field(0, ge=0)  # 0: greedy


class Judge(Endpoint, JudgeRequests):
    """A judge model at an endpoint: it grades each evaluated answer yes or no (tasks/rollout/judge.py),
    asked through the judge client with its request settings (JudgeRequests: deadline, retries,
    workers, reply size)."""

    max_tokens: int = Field(16, gt=0)  # room for its final line, `VERDICT: yes`


# what drawing a report's curves imports (~0.5 s, then ~1 s for the first figure): loaded once by
# the warm fork server, not by every stage that draws one
PLOT_MODULES = ("matplotlib.figure", "matplotlib.backends.backend_agg")


class TrainStage(StageBase):
    """Optimizer, schedule and checkpointing fields of the stages that train a model."""

    learning_rate: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(20, ge=0)
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    checkpoint_every: int = Field(100, gt=0)
    seed: int = 0
    report_to: list[Tracker] | None = None  # None: the spec's defaults
    mlflow_uri: str | None = None
    # memory: rows per forward/backward (the step's batch in micro-batches, gradients accumulated;
    # None: the whole batch at once), activation checkpointing, autocast over fp32 weights
    micro_batch_size: int | None = Field(None, gt=0)
    gradient_checkpointing: bool = False
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    # an `accelerate config` file (FSDP, DeepSpeed) for a stage with gpus > 1, relative to the spec's folder
    accelerate_config: str | None = None
    _accelerate_config_text: str | None = PrivateAttr(None)

    def params(self) -> dict:
        """How a step is split up and where its weights live change memory, not what it computes: a
        stage rerun with a smaller micro_batch_size after running out of memory resumes from its
        in-stage checkpoint (same cache key)."""
        return {key: value for key, value in super().params().items() if key not in LAYOUT_FIELDS}

    def read_sources(self, spec_dir, store) -> None:
        super().read_sources(spec_dir, store)
        if self.accelerate_config is not None:
            self._accelerate_config_text = read_accelerate_config(self.accelerate_config, spec_dir)

    def check_spec(self, spec: SpecView) -> None:
        """Autocast to one half precision over weights stored in the other is a contradiction (bf16
        autocast over bfloat16 weights, with LoRA adapters kept in fp32, is TRL's usual setting), and
        an accelerate config file describes how several processes share a stage."""
        clash = {"fp16": "bfloat16", "bf16": "float16"}.get(self.mixed_precision)
        if spec.model.dtype == clash:
            raise spec.error(self.id, "mixed_precision", f"{self.mixed_precision} autocast over {clash} weights "
                                                         f"(model.dtype): use the weights' own precision, or float32 "
                                                         "weights")
        if self.accelerate_config is not None and spec.gpus(self) < 2:
            raise spec.error(self.id, "accelerate_config", f"an accelerate config (FSDP, DeepSpeed) shares a stage "
                                                           f"among processes: it needs gpus of 2 or more, this "
                                                           f"stage has {spec.gpus(self)}")

    def launch_config(self) -> str | None:
        """The accelerate config file's text, read when the spec was parsed (it travels in the request)."""
        return self._accelerate_config_text


LAYOUT_FIELDS = ("micro_batch_size", "gradient_checkpointing", "accelerate_config")
MAX_ACCELERATE_CONFIG_BYTES = 64 * 1024


def read_accelerate_config(path: str, spec_dir) -> str:
    """The text of an accelerate config file: a YAML mapping of at most 64 KiB; raise FieldError."""
    import yaml

    file = Path(path) if Path(path).is_absolute() or spec_dir is None else Path(spec_dir) / path
    if not file.is_file():
        raise FieldError("accelerate_config", f"no file {path!r} (relative paths start at the spec's folder)")
    if file.stat().st_size > MAX_ACCELERATE_CONFIG_BYTES:
        raise FieldError("accelerate_config", f"{path!r} is over {MAX_ACCELERATE_CONFIG_BYTES // 1024} KiB")
    text = file.read_text(errors="replace")
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise FieldError("accelerate_config", f"{path!r} is not YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(parsed, dict):
        raise FieldError("accelerate_config", f"{path!r} is not an accelerate config (a YAML mapping)")
    return text


class DatasetTrainStage(TrainStage):
    """Training over a dataset in batches (sft, preference): epochs or a fixed number of steps."""

    epochs: float = Field(1.0, gt=0)
    max_steps: int | None = Field(None, gt=0)
    batch_size: int = Field(32, gt=0)
    max_seq_len: int = Field(128, gt=8)
    # one dataset stage, several trained on together with equal weights, or {stage id: weight}
    data: str | list[str] | dict[str, Annotated[float, Field(gt=0)]] = Field(min_length=1)

    def datasets(self) -> list[str]:
        return [self.data] if isinstance(self.data, str) else list(self.data)

    def weights(self) -> list[float]:
        """Each dataset's share of the examples drawn (normalised by the trainer)."""
        return list(self.data.values()) if isinstance(self.data, dict) else [1.0] * len(self.datasets())

    def data_refs(self, kind: str | tuple[str, ...]) -> list[tuple[str, str, str | tuple[str, ...]]]:
        if isinstance(self.data, str):
            return [("data", self.data, kind)]
        if isinstance(self.data, dict):
            return [(f"data.{data}", data, kind) for data in self.data]
        return [(f"data[{i}]", data, kind) for i, data in enumerate(self.data)]


class HeldOutLoss(BaseModel):
    """A held-out slice of a dataset-trained stage's data (sft, preference), never trained on, its
    loss measured every `eval_every` steps and after the last (tasks/train/held_out.py)."""

    eval_fraction: float = Field(0.0, ge=0, lt=1)  # of each input dataset's rows; 0: nothing held out
    eval_every: int = Field(50, gt=0)  # steps between measurements


class AntiDoom(BaseModel):
    """Anti-doom-loop shaping of the RL reward: a penalty for repeated word n-grams."""

    model_config = ConfigDict(extra="forbid")

    ngram: int = Field(4, ge=1)
    threshold: float = Field(0.2, ge=0, lt=1)  # share of repeated n-grams tolerated before any penalty
    penalty: float = Field(0.5, ge=0)  # weight of the penalty in the reward (0: only the `repetition` metric)
    # a trajectory that never reaches its end, or leaves a <think> block open, earns none of
    # the rubric's positive terms (its penalties still apply)
    validate_trace: bool = True


class DynamicSampling(BaseModel):
    """DAPO's dynamic sampling: groups whose rewards are all equal carry no signal; drop them and
    draw more prompts, at most `max_rounds` draws per step."""

    model_config = ConfigDict(extra="forbid")

    max_rounds: int = Field(3, ge=1)


class Overlong(BaseModel):
    """DAPO's soft overlong shaping: a penalty ramping from 0 to `penalty` over the last `buffer`
    tokens of the `max_tokens` budget (the full penalty for a cut-off action)."""

    model_config = ConfigDict(extra="forbid")

    buffer: int = Field(16, gt=0)
    penalty: float = Field(1.0, ge=0)


class SampledEval(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(0.7, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)


def python_files(names) -> list[str]:
    """The Python modules among a task folder's file names (lm-eval imports `!function` targets from them)."""
    return sorted(name for name in names if name.endswith((".py", ".pyc")))


class EvaluationSettings(BaseModel):
    """What an evaluation plays: `n` eval tasks per env, greedy episodes (and sampled ones, with
    `sampled`) of at most `max_new_tokens` an action, decoded `batch_size` at a time, each greedy
    answer judged too with `judge`. The fields an evaluate stage and the spec's `evaluation:` (the
    evaluation of every new checkpoint) share."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(200, gt=0)
    max_new_tokens: int = Field(64, gt=0)
    batch_size: int = Field(64, gt=0)
    sampled: SampledEval | None = SampledEval()  # also sampled accuracy (a second pass over the tasks)
    judge: Judge | None = None  # also a judge model's verdict on every greedy answer
    seed: int = 0
    lm_eval: LmEvalSettings | None = None  # also lm-evaluation-harness tasks (tasks/common/benchmarks.py)
    humaneval: HumanEvalSettings | None = None  # also HumanEval's pass@k, completions run in the sandbox

    # lm_eval.include_path once read: a data_contracts Source, or what the store kept of it ({digest, files})
    _task_folder: object = PrivateAttr(None)

    def evaluation_settings(self) -> dict:
        """These fields' values, to build another evaluation with the same settings."""
        return {name: getattr(self, name) for name in EvaluationSettings.model_fields}

    def read_benchmark_sources(self, spec_dir, store) -> None:
        """lm_eval.include_path, a folder of task YAMLs and their data, relative to `spec_dir` (None: the
        working folder): readable now, with no link in it (FieldError)."""
        if self.lm_eval is None or self.lm_eval.include_path is None:
            return
        from data_contracts.sources import SourceError, locate, options_for, source_files

        source = locate(self.lm_eval.include_path, spec_dir)
        try:
            if source.kind == "hub":
                raise SourceError(f"{self.lm_eval.include_path}: not found")
            files = source_files(source, options_for(source, store.uri, store.options))
        except SourceError as exc:
            raise FieldError("lm_eval.include_path", str(exc)) from None
        code = python_files(files)
        if code:
            raise FieldError("lm_eval.include_path", f"{code[0]}: task folders hold YAML and data, no Python "
                                                     "(lm-eval would import it through `!function`)")
        self._task_folder = source

    def use_kept_sources(self, kept: dict) -> None:
        """The include_path's files as a run of the spec kept them in the store ({`lm_eval`: {digest, files}})."""
        self._task_folder = kept["lm_eval"]

    def sources(self) -> dict:
        """{`lm_eval`: the include_path's Source, or its kept entry}: what the orchestrator keeps in the store."""
        return {"lm_eval": self._task_folder} if self._task_folder is not None else {}
