"""Checkpoint events as the runner builds them, and the messages a stage's child writes."""

from pathlib import Path

from artifacts.store import StoreLocation
from models.config import ModelConfig
from tasks.config import Defaults
from tasks.request import Producer, StageRequest
from tasks.runtime.events import checkpoint_event
from tasks.runtime.runner import ChildMessages
from tasks.stages.rl import RlStage

REQUEST = StageRequest(
    stage=RlStage(kind="rl", id="rl", policy="align", envs={"arith": 1.0}, steps=1), pipeline="agentic",
    run_id="agentic-1", cache_key="0" * 32, model=ModelConfig(), envs={}, inputs={"align": "agentic/align@" + "a" * 16},
    store=StoreLocation(uri="s3://bucket/runs", options={"endpoint_url": "http://127.0.0.1:9000"}),
    producer=Producer(pipeline="agentic", run_id="agentic-1", stage_id="rl", stage_kind="rl", config_hash="c" * 16,
                      code_version="d" * 16, cache_key="0" * 32, spec="0123abcd0123abcd"),
    orchestration=Defaults(), evaluate_new_checkpoints=True)


def test_checkpoint_event_names_the_checkpoint_and_carries_what_an_evaluation_needs():
    event = checkpoint_event("agentic/rl.step-50@00112233aabbccdd", REQUEST, 50)
    assert event["event"] == "posttrain.checkpoint.created"
    assert event["resource"] == {
        "prefect.resource.id": "posttrain.checkpoint.agentic/rl.step-50@00112233aabbccdd",
        "prefect.resource.name": "agentic/rl.step-50@00112233aabbccdd", "posttrain.pipeline": "agentic",
        "posttrain.stage": "rl", "posttrain.evaluate": "true"}
    assert event["payload"] == {"ref": "agentic/rl.step-50@00112233aabbccdd", "store": "s3://bucket/runs",
                                "storage_options": {"endpoint_url": "http://127.0.0.1:9000"},
                                "pipeline": "agentic", "stage": "rl", "step": 50, "run_id": "agentic-1",
                                "spec": "0123abcd0123abcd"}
    quiet = checkpoint_event("agentic/rl@00112233aabbccdd", REQUEST.model_copy(update={"evaluate_new_checkpoints": False}), None)
    assert quiet["resource"]["posttrain.evaluate"] == "false"  # the trigger does not match it


def test_announcements_are_read_as_they_come_and_a_half_written_line_waits(tmp_path: Path):
    seen = []
    progress = []
    announcements = ChildMessages(tmp_path / "messages.jsonl", lambda ref, step: seen.append((ref, step)),
                                  progress.append)
    announcements.drain()  # no file yet
    with open(announcements.path, "a") as handle:
        handle.write('{"ref": "p/s.step-2@aa", "stage": "s", "step": 2}\n{"ref": "p/s@b')
    announcements.drain()
    assert seen == [("p/s.step-2@aa", 2)]
    with open(announcements.path, "a") as handle:
        handle.write('b", "stage": "s", "step": null}\n')
    announcements.drain()
    announcements.drain()
    assert seen == [("p/s.step-2@aa", 2), ("p/s@bb", None)] and announcements.refs == ["p/s.step-2@aa", "p/s@bb"]
    with open(announcements.path, "a") as handle:
        handle.write('{"progress": {"step": 3, "total": 9, "eta_seconds": 6.0, "metrics": {}}}\n'
                     '{"log": "[s] outside a task run: not relayed", "level": "INFO"}\n')
    announcements.drain()
    assert progress == [{"step": 3, "total": 9, "eta_seconds": 6.0, "metrics": {}}] and len(seen) == 2
