"""What a stage function receives besides its own config: the run context and its inputs."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from artifacts.refs import Ref
from artifacts.store import Store
from data_contracts.config import ContractParams
from models.config import ModelConfig
from tasks.config import Defaults

PROGRESS_SECONDS = 2.0  # how often a running stage tells the orchestrator its progress
SHARE_SECONDS = 2.0  # how often a running stage rereads its share of the cores


@dataclass
class StageOutput:
    """One artifact a stage produced in a local folder, to be committed by the runner."""

    kind: str  # dataset | checkpoint | report
    local_dir: Path
    metrics: dict = field(default_factory=dict)
    contract: ContractParams | None = None  # datasets: the contract checked before the commit
    contract_summary: dict | None = None  # set when the stage checked the contract itself, early


@dataclass
class StageContext:
    store: Store
    pipeline: str
    run_id: str
    stage_id: str
    cache_key: str
    model: ModelConfig
    envs: dict  # env id -> env config (only the envs the stage names)
    inputs: dict[str, str]  # input stage id -> ref
    workdir: Path  # local scratch folder, removed after the stage
    producer: dict = field(default_factory=dict)  # provenance written into the manifests of what it commits
    output_name: str = ""  # name of the primary output (`<pipeline>/<stage id>` unless the request says otherwise)
    announce_path: Path | None = None  # where new checkpoints are announced to the orchestrator, one JSON line each
    sources: dict = field(default_factory=dict)  # what the orchestrator kept of the stage's outside data (request.sources)
    orchestration: Defaults = field(default_factory=Defaults)  # the resolved settings (request.orchestration)
    # {name: value} of the environment variables the spec took values from: trackers show `${NAME}` instead
    filled: dict[str, str] = field(default_factory=dict)
    # the working folder of the process running the stage's task (the child runs in the project's):
    # where trackers keep local files
    orchestrator_cwd: Path = field(default_factory=Path.cwd)
    # set by the runner: the file holding this child's share of the box's cores (tasks/runtime/core_share.py)
    core_share_path: Path | None = None
    started: float = field(default_factory=time.monotonic)
    _told_progress: float = field(default=float("-inf"), repr=False)
    _read_share: float = field(default=float("-inf"), repr=False)

    def __post_init__(self):
        self.output_name = self.output_name or f"{self.pipeline}/{self.stage_id}"

    def log(self, message: str, level: str = "INFO") -> None:
        """A line on this process's stdout and, through the orchestrator, in the stage's task run
        logs in Prefect (`level`: a logging level name)."""
        if self.is_main:  # a multi-GPU stage's other processes do the same work: one log is enough
            line = f"[{self.stage_id}] {message}"
            print(line, file=sys.stdout, flush=True)
            self._tell({"log": line, "level": level})

    def report_progress(self, progress: dict) -> None:
        """A Progress update (tasks/common/progress.py) for the orchestrator: its line, when it is one
        a log keeps, to the task run's logs; {step, total, eta_seconds, metrics} for the run summary's
        `running` and a Prefect progress artifact, at most once every PROGRESS_SECONDS (and the last)."""
        self.follow_core_share()
        if not self.is_main:
            return
        progress = dict(progress)
        line = progress.pop("line", None)
        if line:
            self._tell({"log": line, "level": "INFO"})
        now = time.monotonic()
        if now - self._told_progress >= PROGRESS_SECONDS or progress["step"] >= progress["total"]:
            self._told_progress = now
            self._tell({"progress": progress})

    @property
    def device(self) -> str:
        """Where this stage's models run (models/loading.py, stage_device)."""
        from models.loading import stage_device

        return stage_device(self.model, self.orchestration.gpus)

    @property
    def is_main(self) -> bool:
        """Whether this is the process that commits: always, unless a multi-GPU stage runs one
        process per GPU (`accelerate launch`), where rank 0 commits and the others only train."""
        return os.environ.get("RANK", "0") == "0"

    def announce_checkpoint(self, ref: str, step: int | None = None) -> None:
        """Tell the orchestrator a checkpoint was committed (it emits the checkpoint event at once)."""
        self._tell({"ref": ref, "stage": self.stage_id, "step": step})

    def show_report(self, markdown: str, step: int) -> None:
        """The stage's report so far (markdown, its images inline: tasks/common/report_images.py),
        which the orchestrator publishes as the stage's report artifact in Prefect (the newest
        version of the key is what the UI shows; the committed report follows at the end)."""
        if self.is_main:
            self._tell({"report": markdown, "step": step})

    def follow_core_share(self) -> None:
        """Torch's threads to this child's current share of the cores, read at most every
        SHARE_SECONDS; not when the spec sets `model.threads`, nor before the stage imported torch."""
        torch = sys.modules.get("torch")
        now = time.monotonic()
        if self.core_share_path is None or self.model.threads is not None or torch is None \
                or now - self._read_share < SHARE_SECONDS:
            return
        self._read_share = now
        try:
            threads = max(1, int(self.core_share_path.read_text()))
        except (OSError, ValueError):  # the runner is gone or cleaning up: keep what we have
            return
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def _tell(self, message: dict) -> None:
        """One JSON line to the orchestrator (tasks/runtime/runner.py reads them as they come)."""
        if self.announce_path is not None:
            with open(self.announce_path, "a") as handle:
                handle.write(json.dumps(message) + "\n")

    def input_ref(self, stage_id: str) -> Ref:
        return Ref.parse(self.inputs[stage_id])

    def fetch(self, stage_id: str) -> Path:
        """Local folder with the files of an input artifact."""
        return self.store.fetch(self.input_ref(stage_id), None if self.store.local else self.workdir / "in" / stage_id)

    @property
    def scratch(self) -> str:
        """Store folder for this stage's in-stage checkpoints (keyed by its cache key)."""
        return self.store.path("scratch", self.cache_key)
