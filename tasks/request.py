"""The stage request: everything a stage run needs, resolved once by the orchestrator from the spec
and handed whole to the Prefect task, a worker's flow run and the stage's child process."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from artifacts.refs import RUN_ID

from artifacts.store import StoreLocation
from envs.loader import EnvConfig
from models.config import ModelConfig
from tasks.config import Defaults
from tasks.kinds import StageConfig


class Producer(BaseModel):
    """The provenance written into the manifest of every artifact the stage commits."""

    model_config = ConfigDict(extra="forbid")

    pipeline: str
    run_id: str
    stage_id: str
    stage_kind: str
    config_hash: str  # of the stage's params
    code_version: str
    cache_key: str
    spec: str | None = None  # hash of the spec text kept in the store (specs/<hash>.yaml)
    base_model: str | None = None  # identity of the base model, for stages that start from it

    def manifest_entry(self) -> dict:
        return self.model_dump(exclude_none=True)


class StageRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stage: StageConfig
    pipeline: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")
    run_id: str = Field(pattern=RUN_ID)  # a path component of the store (runs/, quarantine/)
    cache_key: str = Field(pattern=r"^[0-9a-f]{32}$")  # a path component too (cache/, scratch/)
    model: ModelConfig
    envs: dict[str, EnvConfig]  # only the envs the stage names
    inputs: dict[str, str]  # input stage id -> ref
    store: StoreLocation
    producer: Producer
    orchestration: Defaults  # the stage's retries, retry delay, timeout and gpus, defaults applied
    evaluate_new_checkpoints: bool = False  # the spec's evaluation.on_new_checkpoint (an event label)
    output_name: str | None = None  # the primary output's name; `<pipeline>/<stage id>` unless set
    announce_path: str | None = None  # set by the runner: where the child announces new checkpoints
    core_share_path: str | None = None  # set by the runner: the child's share of the box's cores (a file)
    # what the orchestrator kept of the stage's outside data, by name (stage.sources()):
    # {"digest": ..., "files": n} for a copy under the store's sources/, {"hub": id, "revision": ...}
    sources: dict[str, dict] = {}
    # user code the stage imports that lives in the orchestrator's working folder (reward modules):
    # {relative path: source}, put on the child's import path
    code: dict[str, str] = {}
    filled: list[str] = []  # the environment variables the spec took values from (never logged to trackers)
    # set by the runner: the working folder of the process running the stage's task (`posttrain run`, or
    # a worker's flow run), where trackers keep ./mlruns and ./wandb (the child runs in the project's)
    orchestrator_cwd: str | None = None
    # the text of the stage's accelerate config file (FSDP, DeepSpeed), read where the spec was parsed:
    # `accelerate launch --config_file` of a stage with gpus > 1 (tasks/runtime/launch.py)
    accelerate_config: str | None = None

    @property
    def primary_name(self) -> str:
        return self.output_name or f"{self.pipeline}/{self.stage.id}"
