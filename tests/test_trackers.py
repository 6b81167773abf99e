"""`report_to`: a tiny rl stage reports to MLflow (its local sqlite store), TensorBoard and W&B
(offline), and a resume continues the same runs; each is read back with the tracker's own reader.
MLflow server URIs and W&B's online mode need a server: not tested here."""

import glob
import json
import struct
from pathlib import Path

import pytest
from test_rl import ENV, committed_policy, rl_stage

from tasks.config import Defaults

TRACKERS = ["mlflow", "tensorboard", "wandb"]


def tracked_context(root, workdir, store, policy_ref, **settings):
    from models.config import ModelConfig
    from tasks.common.context import StageContext

    return StageContext(store=store, pipeline="t", run_id="r", stage_id="rl", cache_key="k", model=ModelConfig(),
                        envs={"arith": ENV.config}, inputs={"sft": str(policy_ref)}, workdir=root / workdir,
                        producer={"stage_id": "rl"}, announce_path=root / f"{workdir}.jsonl",
                        orchestration=Defaults(**settings), orchestrator_cwd=root)


def logged(root, workdir) -> list[dict]:
    """The log lines a stage told the orchestrator (ctx.log)."""
    return [json.loads(line) for line in (root / f"{workdir}.jsonl").read_text().splitlines() if '"log"' in line]


def history(outputs) -> list[dict]:
    return [json.loads(line) for line in (outputs["report"].local_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """A 4-step rl stage reporting to every tracker (samples every 2 steps), run to its end, then
    run again, which resumes from its in-stage checkpoint at step 2 (as if killed after it).
    mlruns/ and wandb/ land in the orchestrator's working folder, here the temporary one."""
    from tasks.stages.rl.stage import run

    root = tmp_path_factory.mktemp("trackers")
    with pytest.MonkeyPatch.context() as patch:
        for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR", "WANDB_PROJECT", "MLFLOW_TRACKING_URI"):
            patch.delenv(name, raising=False)
        store, policy_ref = committed_policy(root)
        stage = rl_stage(steps=4, prompts_per_step=2, group_size=2, max_tokens=8, checkpoint_every=2, samples_every=2)
        first = run(stage, tracked_context(root, "w1", store, policy_ref, report_to=TRACKERS))
        second = run(stage, tracked_context(root, "w2", store, policy_ref, report_to=TRACKERS))
    assert second["checkpoint"].metrics["resumed_from_step"] == 2
    return root, first, second


def test_mlflow_holds_params_every_step_and_the_samples_and_a_resume_continues_its_run(tracked):
    from mlflow import MlflowClient

    root, first, second = tracked
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlruns' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("t").experiment_id
    [run] = client.search_runs([experiment])  # the resumed stage added no run
    assert run.info.run_name == "t/rl/r" and run.info.status == "FINISHED"
    assert run.data.params["kind"] == "rl" and run.data.params["samples_every"] == "2"
    assert run.data.params["envs.arith"] == "1.0" and run.data.params["report_to"] == json.dumps(TRACKERS)
    assert run.data.params["model.base"] and "mlflow_uri" not in run.data.params
    rewards = client.get_metric_history(run.info.run_id, "reward")
    # steps 3 and 4 twice: the first attempt's, then the resumed one's
    assert [m.step for m in rewards] == [1, 2, 3, 4, 3, 4]
    assert [m.value for m in rewards] == pytest.approx([h["reward"] for h in history(first) + history(second)[2:]])
    assert {"loss", "accuracy", "tokens", "lr"} <= set(run.data.metrics)
    tables = [f.path for f in client.list_artifacts(run.info.run_id, "samples")]
    assert tables == ["samples/step-000002.json", "samples/step-000004.json"]
    # (client.load_table would search the fluent API's default store, not this client's)
    table = json.loads(Path(client.download_artifacts(run.info.run_id, tables[0], str(root))).read_text())
    assert table["columns"] == [
        "env", "prompt", "completion", "reward", "reward_correct", "reward_format", "reward_words"]
    assert len(table["data"]) == 4 and all(row[1] and row[0] == "arith" for row in table["data"])
    started = [line["log"] for line in logged(root, "w1") if "reporting to mlflow" in line["log"]]
    continued = [line["log"] for line in logged(root, "w2") if "reporting to mlflow" in line["log"]]
    assert run.info.run_id in started[0] and f"continuing run {run.info.run_id}" in continued[0]


def test_a_resume_into_another_mlflow_store_starts_a_run_there_and_replays_the_history(tracked, tmp_path):
    """The in-stage state (its run id) is keyed by the cache key, which leaves mlflow_uri out."""
    from mlflow import MlflowClient

    from tasks.train.trackers import Trackers

    root, _, _ = tracked
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlruns' / 'mlflow.db'}")
    [first] = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    other = f"sqlite:///{tmp_path / 'other.db'}"
    ctx = tracked_context(tmp_path, "w", None, "t/sft@1", report_to=["mlflow"], mlflow_uri=other)
    history = [{"step": 1, "reward": 0.25}, {"step": 2, "reward": 0.5}]
    trackers = Trackers.start(ctx, rl_stage(), {"mlflow": first.info.run_id}, history)
    trackers.finish()
    [run_id] = trackers.ids.values()
    assert run_id != first.info.run_id
    assert [(m.step, m.value) for m in MlflowClient(tracking_uri=other).get_metric_history(run_id, "reward")] == [
        (1, 0.25), (2, 0.5)]
    [line] = [line["log"] for line in logged(tmp_path, "w")]
    assert line.startswith(f"[rl] reporting to mlflow: run {run_id}, ")


def scalars_and_texts(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    texts = {tag: [(e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode()) for e in events.Tensors(tag)]
             for tag in events.Tags()["tensors"]}
    return scalars, texts


def test_tensorboard_events_are_in_the_report_and_a_resume_replays_the_history(tracked):
    _, first, second = tracked
    for outputs, table_steps in ((first, [2, 4]), (second, [4])):
        scalars, texts = scalars_and_texts(outputs["report"].local_dir / "tensorboard")
        assert [step for step, _ in scalars["reward"]] == [1, 2, 3, 4]
        assert [value for _, value in scalars["reward"]] == pytest.approx([h["reward"] for h in history(outputs)])
        assert {"loss", "accuracy", "tokens_per_second"} <= set(scalars)
        assert "t/rl/r" in texts["config/text_summary"][0][1] and '"kind": "rl"' in texts["config/text_summary"][0][1]
        assert [step for step, _ in texts["samples/text_summary"]] == table_steps
        header = texts["samples/text_summary"][0][1].splitlines()[0]
        assert header.startswith("| env | prompt | completion | reward | reward_correct | reward_format")


def wandb_records(path):
    """The records of a W&B offline run's transaction log (`run-<id>.wandb`): LevelDB's log format
    (32 KiB blocks of chunks with a 7-byte header) after W&B's own 7-byte header; each record a
    `wandb_internal_pb2.Record`. The installed wandb (0.31) reads these files in its Go core only."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    position, chunks = 7, b""
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunks += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def wandb_history(path) -> tuple[object, list[dict]]:
    """(the run record, each history row as {key: value})."""
    run, rows = None, []
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json.replace("NaN", "null"))
                         for item in record.history.item})
    return run, rows


def test_wandb_runs_offline_with_every_step_and_a_resume_keeps_the_run_id(tracked):
    root, first, second = tracked
    attempts = sorted(glob.glob(str(root / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(attempts) == 2  # offline, each attempt writes its own folder under the same run id
    (run, rows), (resumed, resumed_rows) = wandb_history(attempts[0]), wandb_history(attempts[1])
    assert resumed.run_id == run.run_id and run.display_name == "t/rl/r" and run.project == "t"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["kind"] == "rl" and config["envs"] == {"arith": 1.0} and config["report_to"] == TRACKERS
    assert [row["_step"] for row in rows] == [1, 2, 3, 4] and [row["_step"] for row in resumed_rows] == [3, 4]
    assert [row["reward"] for row in rows] == pytest.approx([h["reward"] for h in history(first)])
    assert [row["reward"] for row in resumed_rows] == pytest.approx([h["reward"] for h in history(second)[2:]])
    assert [row["_step"] for row in rows if "samples/_type" in row] == [2, 4]
    table = json.loads(next((root / "wandb").glob(f"offline-run-*-{run.run_id}/files/media/table/samples_2_*.json"))
                       .read_text())
    assert table["columns"][:6] == ["env", "prompt", "completion", "reward", "reward_correct", "reward_format"]
    assert len(table["data"]) == 4


def test_a_tracker_that_fails_warns_once_and_the_stage_finishes(tmp_path):
    from tasks.stages.rl.stage import run

    store, policy_ref = committed_policy(tmp_path)
    stage = rl_stage(steps=2, prompts_per_step=1, group_size=2, max_tokens=4, samples_every=1)
    outputs = run(stage, tracked_context(tmp_path, "w", store, policy_ref, report_to=["mlflow", "tensorboard"],
                                         mlflow_uri="nosuch://tracker"))
    assert outputs["checkpoint"].metrics["steps"] == 2
    warnings = [line for line in logged(tmp_path, "w") if line["level"] == "WARNING"]
    assert len(warnings) == 1 and "mlflow tracker failed, no more reporting to it" in warnings[0]["log"]
    assert "nosuch" not in warnings[0]["log"] and "<mlflow_uri>" in warnings[0]["log"]  # a URI may hold credentials
    scalars, _ = scalars_and_texts(outputs["report"].local_dir / "tensorboard")  # the other tracker went on
    assert [step for step, _ in scalars["reward"]] == [1, 2]


class Toy:
    """A tracker whose logging breaks after its first step."""

    id = "toy-1"
    where = "nowhere"

    def __init__(self):
        self.steps = []

    def log_step(self, step, metrics):
        if self.steps:
            raise OSError("disk full\nsecond line")
        self.steps.append(step)


def test_a_tracker_failing_mid_stage_is_dropped_after_one_warning(tmp_path):
    from tasks.train.trackers import Trackers

    ctx = tracked_context(tmp_path, "w", None, "t/sft@1")
    toy = Toy()
    trackers = Trackers(ctx, {"toy": toy})
    for step in (1, 2, 3):
        trackers.log_step({"step": step, "loss": 1.0, "name": "not a number"})
    trackers.finish()
    assert toy.steps == [1] and not trackers.active and trackers.ids == {}
    assert [line["log"] for line in logged(tmp_path, "w")] == [
        "[rl] toy tracker failed, no more reporting to it: OSError: disk full"]


class Broken:
    """A tracker whose every call fails."""

    id = None
    where = "nowhere"
    calls = 0

    def __init__(self, *args):
        pass

    def log_step(self, step, metrics):
        Broken.calls += 1
        raise OSError("disk full")


def test_a_tracker_failing_on_replay_is_called_once_and_warns_once(tmp_path, monkeypatch):
    from tasks.train import trackers

    monkeypatch.setitem(trackers.TRACKERS, "tensorboard", Broken)
    monkeypatch.setattr(Broken, "calls", 0)
    ctx = tracked_context(tmp_path, "w", None, "t/sft@1", report_to=["tensorboard"])
    started = trackers.Trackers.start(ctx, rl_stage(), {}, [{"step": step, "loss": 1.0} for step in (1, 2, 3)])
    assert Broken.calls == 1 and not started.active
    assert [line["log"] for line in logged(tmp_path, "w") if line["level"] == "WARNING"] == [
        "[rl] tensorboard tracker failed, no more reporting to it: OSError: disk full"]


def test_only_rank_0_reports(tmp_path, monkeypatch):
    from tasks.train.trackers import Trackers

    monkeypatch.setenv("RANK", "1")
    trackers = Trackers.start(tracked_context(tmp_path, "w", None, "t/sft@1", report_to=["tensorboard"]),
                              rl_stage(), {}, [])
    assert not trackers.active and not (tmp_path / "w").exists()


def test_params_show_values_from_the_environment_as_their_variable(tmp_path):
    from tasks.stages.evaluate import EvaluateStage
    from tasks.train.trackers import run_params

    stage = EvaluateStage(kind="evaluate", id="eval", checkpoints=["sft"], envs=["arith"],
                          judge={"endpoint": "http://judge.example/v1?key=s3cr3t-t0ken", "model": "j"})
    ctx = tracked_context(tmp_path, "w", None, "t/sft@1", mlflow_uri="https://user:pw@mlflow.example")
    ctx.filled = {"JUDGE_KEY": "s3cr3t-t0ken", "SHORT": "j"}
    params = run_params(ctx, stage)
    assert params["judge"]["endpoint"] == "http://judge.example/v1?key=${JUDGE_KEY}"
    assert params["judge"]["model"] == "j" and "mlflow_uri" not in params and "s3cr3t" not in json.dumps(params)
