"""A running stage's progress where users look, as its child reports it (StageContext.report_progress):
a file in the store, which the pipeline flow folds into the run summary's `running` (so `posttrain
status` shows the step and ETA, on a worker too), and a Prefect progress artifact on the task run.
And its report so far (StageContext.show_report, at each in-stage checkpoint of a training stage)
as a markdown artifact of the task run. Best effort: what cannot be shown never fails a stage."""

from __future__ import annotations

import warnings

from artifacts.store import Store, StoreError
from tasks.common.progress import step_and_eta
from tasks.common.report_images import report_key


def progress_path(store: Store, run_id: str, stage_id: str) -> str:
    return store.path("progress", run_id, f"{stage_id}.json")


def read_progress(store: Store, run_id: str, stage_id: str) -> dict | None:
    """{step, total, eta_seconds} of the stage while it runs; None before its first report or after it ended."""
    path = progress_path(store, run_id, stage_id)
    try:
        progress = store.read_json(path) if store.exists(path) else None
    except (OSError, ValueError, StoreError):
        return None  # half-written or just removed: the next look finds it
    if not isinstance(progress, dict):
        return None
    return {key: progress.get(key) for key in ("step", "total", "eta_seconds")}


class _Display:
    """Warns once, the first time showing something fails; later failures stay quiet."""

    stage_id: str
    failed = False

    def _warn_once(self, what: str, exc: Exception) -> None:
        if not self.failed:
            warnings.warn(f"{self.stage_id}: {what} not shown: {exc}", stacklevel=2)
        self.failed = True


class LiveProgress(_Display):
    """`live(progress)` for each report of the child; `close()` when the stage ends."""

    def __init__(self, store: Store, run_id: str, stage_id: str):
        self.store, self.stage_id, self.path = store, stage_id, progress_path(store, run_id, stage_id)
        self.artifact = None

    def __call__(self, progress: dict) -> None:
        try:
            self.store.write_json(self.path, progress)
            self._show(progress)
        except Exception as exc:  # noqa: BLE001 - a progress display must not fail the stage
            self._warn_once("progress", exc)

    def _show(self, progress: dict) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        percent = 100.0 * progress["step"] / max(1, progress["total"])
        description = f"{self.stage_id}: {step_and_eta(progress)}"
        if self.artifact is None:
            self.artifact = create_progress_artifact(percent, description=description)
        else:
            update_progress_artifact(self.artifact, percent, description=description)

    def close(self) -> None:
        try:
            self.store.remove(self.path)
        except (OSError, StoreError):
            pass


class LiveReport(_Display):
    """`live(markdown, step)` for each report so far the child sends: a markdown artifact under the
    stage's report key (the key the flow publishes the committed report under, so the UI's latest
    version of it is the newest), attached to the task run."""

    def __init__(self, pipeline: str, stage_id: str):
        self.stage_id, self.key = stage_id, report_key(pipeline, stage_id)

    def __call__(self, markdown: str, step: int | None) -> None:
        try:
            from prefect.artifacts import create_markdown_artifact

            create_markdown_artifact(markdown=markdown, key=self.key,
                                     description=f"report of stage {self.stage_id} so far (step {step})")
        except Exception as exc:  # noqa: BLE001 - a report display must not fail the stage
            self._warn_once(f"report at step {step}", exc)
