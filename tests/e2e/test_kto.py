"""End-to-end: a local JSONL of unpaired preferences (TRL's KTO format) -> dataset stage -> sft ->
preference `method: kto`, through the real CLI, a few steps."""

import json
import math

import pandas as pd

from artifacts.store import Store
from tests.e2e.helpers import by_id, posttrain, summary, tiny_spec, write


def unpaired_jsonl(path) -> None:
    rows = []
    for i in range(8):
        rows.append({"prompt": f"What is {i} + 3?", "completion": f"The final answer is {i + 3}.", "label": True})
        rows.append({"prompt": f"What is {i} + 3?", "completion": "It is correct. " * 4, "label": False})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_kto_pipeline_trains_from_an_unpaired_dataset(tmp_path):
    unpaired_jsonl(tmp_path / "feedback.jsonl")
    spec = tiny_spec(f"file://{tmp_path / 'store'}", sft={"max_steps": 2, "batch_size": 8, "checkpoint_every": 100})
    spec["stages"][0]["n"] = 32
    spec["stages"][2:] = [
        {"id": "feedback", "kind": "dataset", "source": "feedback.jsonl"},
        {"id": "kto", "kind": "preference", "policy": "sft", "data": "feedback", "method": "kto", "beta": 0.1,
         "desirable_weight": 1.0, "undesirable_weight": 1.0, "max_steps": 3, "batch_size": 4,
         "checkpoint_every": 100},
    ]
    done = posttrain("run", write(tmp_path, spec), "--summary-json", tmp_path / "run.json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stages = by_id(summary(tmp_path / "run.json"))
    assert stages["feedback"]["metrics"]["format"] == "unpaired"
    kto = stages["kto"]
    assert kto["state"] == "completed"
    metrics = kto["metrics"]
    assert (metrics["method"], metrics["rows"], metrics["desirable"], metrics["steps"]) == ("kto", 16, 8, 3)
    assert math.isfinite(metrics["final_loss"]) and metrics["final_kl"] >= 0

    store = Store(f"file://{tmp_path / 'store'}")
    checkpoint_ref, rows_ref = kto["outputs"]["checkpoint"], kto["outputs"]["pairs"]
    assert checkpoint_ref.startswith("tiny/kto@") and (store.fetch(checkpoint_ref) / "config.json").exists()
    assert store.manifest(rows_ref)["metrics"]["contract"]["success"] is True
    rows = pd.read_parquet(store.fetch(rows_ref) / "data.parquet")
    assert len(rows) == 16 and rows["ref_logp"].lt(0).all()
    assert store.manifest(checkpoint_ref)["siblings"]["kto.pairs"] == rows_ref
