"""Experiment trackers a training stage reports to (`report_to: [mlflow, tensorboard, wandb]`).

Each tracker gets the resolved stage config as params, every step's metrics and (rl) a table of
sample completions every `samples_every` steps. Only the committing process (rank 0) reports.
A tracker that fails warns once in the stage's log and is dropped: it never fails the stage.
A resumed stage continues the same MLflow and W&B runs (their ids travel in the in-stage
checkpoint's state); a tracker without a run to continue (TensorBoard, whose event files live in
the report folder of this attempt, one added on resume, or MLflow when the run is not in this
store) first replays the restored history.

The packages are optional extras (`pip install 'posttrain[mlflow]'`, ...), imported only when a
stage reports to them: they are slow to import.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time

MLFLOW_PARAM_CHARS = 6000  # MLflow refuses longer param values


def missing_package(tracker: str) -> str | None:
    """How to install a tracker whose package is missing (None: it is installed). Looks the
    package up without importing it, so `posttrain validate` stays fast."""
    return None if importlib.util.find_spec(tracker) else f"pip install 'posttrain[{tracker}]'"


class MlflowTracker:
    """A run in the pipeline's experiment at `mlflow_uri`, else $MLFLOW_TRACKING_URI, else a local
    store in mlruns/ (mlflow.db, artifacts/) of the orchestrator's working folder."""

    def __init__(self, ctx, name: str, params: dict, resumed: str | None):
        from mlflow import MlflowClient
        from mlflow.entities import Param

        # MLflow's defaults (7 retries with backoff, 120 s a request) would stall the stage for
        # minutes on a slow or down server before the tracker is dropped; the user's settings win
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        uri = ctx.orchestration.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None
        if uri is None:  # MLflow 3's file store refuses to start: its local store is sqlite
            root = ctx.orchestrator_cwd / "mlruns"
            root.mkdir(parents=True, exist_ok=True)
            uri, artifacts = f"sqlite:///{root / 'mlflow.db'}", (root / "artifacts").as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        self.where = f"experiment {ctx.pipeline!r}" + (f" in {ctx.orchestrator_cwd / 'mlruns'}" if artifacts else "")
        if resumed and self._exists(resumed):
            self.id = resumed
            return
        found = self.client.get_experiment_by_name(ctx.pipeline)
        experiment = found.experiment_id if found else self.client.create_experiment(ctx.pipeline, artifacts)
        tags = {"posttrain.pipeline": ctx.pipeline, "posttrain.stage": ctx.stage_id, "posttrain.run_id": ctx.run_id}
        self.id = self.client.create_run(experiment, run_name=name, tags=tags).info.run_id
        flat = [Param(key, value[:MLFLOW_PARAM_CHARS]) for key, value in _flat(params)]
        for start in range(0, len(flat), 100):  # MLflow takes at most 100 params a call
            self.client.log_batch(self.id, params=flat[start:start + 100])

    def _exists(self, run_id: str) -> bool:
        """Whether this store holds the run: a resume may reach another store than its first attempt
        (the in-stage state is keyed by the cache key, which leaves `mlflow_uri` and the folder out);
        then a new run, which `Trackers.start` replays the history into."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException:
            return False
        return True

    def log_step(self, step: int, metrics: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.id, metrics=[Metric(key, value, now, step) for key, value in metrics.items()])

    def log_table(self, step: int, rows: list[dict]) -> None:
        columns = _columns(rows)
        self.client.log_table(self.id, {column: [row.get(column) for row in rows] for column in columns},
                              f"samples/step-{step:06d}.json")

    def finish(self) -> None:
        self.client.set_terminated(self.id)


class TensorBoardTracker:
    """Event files in the stage's report folder (report/tensorboard/), committed with the report."""

    id = None  # the files of an earlier attempt went with its working folder: nothing to continue

    def __init__(self, ctx, name: str, params: dict, resumed: str | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(ctx.workdir / "report" / "tensorboard"))
        self.writer.add_text("config", f"{name}\n\n```\n{json.dumps(params, indent=2)}\n```")
        self.where = "report/tensorboard in the stage's report"

    def log_step(self, step: int, metrics: dict) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def log_table(self, step: int, rows: list[dict]) -> None:
        columns = _columns(rows)
        cell = lambda value: str(value).replace("|", "\\|").replace("\n", " ")  # noqa: E731
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(row.get(column, "")) for column in columns) + " |" for row in rows]
        self.writer.add_text("samples", "\n".join(lines), step)

    def finish(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run, offline (in wandb/ of $WANDB_DIR or the orchestrator's working folder; `wandb sync`
    uploads it) unless the user set WANDB_MODE or WANDB_API_KEY."""

    def __init__(self, ctx, name: str, params: dict, resumed: str | None):
        import wandb

        configured = os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or ctx.pipeline, name=name, config=params,
                              id=resumed, resume="allow" if resumed else None, mode=None if configured else "offline",
                              dir=os.environ.get("WANDB_DIR") or ctx.orchestrator_cwd, reinit="create_new",
                              settings=wandb.Settings(console="off", silent=True))
        self.id = self.run.id
        self.where = f"offline in {self.run.sync_dir}; `wandb sync` uploads it" if self.run.offline else self.run.url

    def log_step(self, step: int, metrics: dict) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, step: int, rows: list[dict]) -> None:
        import wandb

        columns = _columns(rows)
        table = wandb.Table(columns=columns, data=[[row.get(column) for column in columns] for row in rows])
        self.run.log({"samples": table}, step=step)

    def finish(self) -> None:
        self.run.finish()


TRACKERS = {"mlflow": MlflowTracker, "tensorboard": TensorBoardTracker, "wandb": WandbTracker}


class Trackers:
    """The trackers a stage reports to: what `Training` calls (start, log_step, log_table, finish)."""

    def __init__(self, ctx=None, live: dict | None = None):
        self.ctx, self.live = ctx, dict(live or {})

    @classmethod
    def start(cls, ctx, stage, resumed: dict, history: list[dict]) -> Trackers:
        """Start (or continue: `resumed` {tracker: run id} from the in-stage state) each tracker of
        the stage's resolved `report_to`; one without a run to continue replays `history`."""
        trackers = cls(ctx)
        if not ctx.is_main:
            return trackers
        name, params = f"{ctx.pipeline}/{ctx.stage_id}/{ctx.run_id}", run_params(ctx, stage)
        for tracker in dict.fromkeys(ctx.orchestration.report_to):  # each once
            live = trackers._call(tracker, lambda: TRACKERS[tracker](ctx, name, params, resumed.get(tracker)))
            if live is None:
                continue
            trackers.live[tracker] = live
            continued = live.id is not None and live.id == resumed.get(tracker)
            ctx.log(f"reporting to {tracker}: " + ("continuing " if continued else "") + f"run {live.id or name}, "
                    f"{live.where}")
            for entry in [] if continued else history:
                if tracker not in trackers.live:  # it failed: dropped, warned once
                    break
                trackers._call(tracker, lambda: live.log_step(entry["step"], _numbers(entry)))
        return trackers

    @property
    def active(self) -> bool:
        return bool(self.live)

    @property
    def ids(self) -> dict:
        """{tracker: run id} for the in-stage state, so that a resume continues the same runs."""
        return {tracker: live.id for tracker, live in self.live.items() if live.id is not None}

    def log_step(self, entry: dict) -> None:
        """One entry of `Training.history` (its `step` is the x axis)."""
        for tracker in list(self.live):
            self._call(tracker, lambda: self.live[tracker].log_step(entry["step"], _numbers(entry)))

    def log_table(self, step: int, rows: list[dict]) -> None:
        """Sample completions: one dict per row (prompt, completion, reward, a column per reward function)."""
        for tracker in list(self.live):
            self._call(tracker, lambda: self.live[tracker].log_table(step, rows))

    def finish(self) -> None:
        for tracker in list(self.live):
            self._call(tracker, self.live[tracker].finish)

    def _call(self, tracker: str, action):
        """`action()`'s result; on an exception, a warning and the tracker dropped (None)."""
        try:
            return action()
        except Exception as exc:  # noqa: BLE001 -- a tracker never fails the stage
            self.live.pop(tracker, None)  # so this warning is its only one
            message = _hide(self.ctx, f"{type(exc).__name__}: {exc}".splitlines()[0])[:300]
            self.ctx.log(f"{tracker} tracker failed, no more reporting to it: {message}", "WARNING")
            return None


def run_params(ctx, stage) -> dict:
    """The resolved stage config (the spec's defaults applied), its model and run, with every value
    the spec took from the environment shown as its `${NAME}` (a token in an endpoint URL)."""
    hidden = {"mlflow_uri"}  # a server URI may carry credentials
    params = {**stage.model_dump(mode="json", exclude=hidden),
              **ctx.orchestration.model_dump(mode="json", exclude=hidden),
              "model": ctx.model.model_dump(mode="json"), "pipeline": ctx.pipeline, "run_id": ctx.run_id}
    return json.loads(_hide(ctx, json.dumps(params), lambda value: json.dumps(value)[1:-1]))


def _hide(ctx, text: str, escape=lambda value: value) -> str:
    """`text` with each value the spec took from the environment as its `${NAME}` (as Prefect
    parameters show them) and the MLflow URI (it may carry credentials) as `<mlflow_uri>`."""
    secrets = [(f"${{{name}}}", value) for name, value in ctx.filled.items()
               if len(value) >= 8]  # as flows/placeholders.py: shorter values are no secret
    secrets += [("<mlflow_uri>", uri) for uri in (ctx.orchestration.mlflow_uri, os.environ.get("MLFLOW_TRACKING_URI"))
                if uri]
    for mark, value in sorted(secrets, key=lambda item: -len(item[1])):
        text = text.replace(escape(value), mark)
    return text


def _numbers(entry: dict) -> dict:
    return {key: float(value) for key, value in entry.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


def _columns(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(column for row in rows for column in row))


def _flat(params: dict, prefix: str = ""):
    """(dotted key, text) of nested params, as MLflow takes them."""
    for key, value in params.items():
        if isinstance(value, dict) and value:
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value if isinstance(value, str) else json.dumps(value)
