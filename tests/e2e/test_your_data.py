"""pipelines/your-data.yaml (a user's data in TRL's formats: dataset -> sft -> preference -> rl ->
evaluate) runs, reruns all cached, and after one row of one source changes re-imports only that
dataset and recomputes only what depends on it. Step counts are cut to keep the test short; the
README's figures come from the spec as shipped."""

import json

import pandas as pd
from e2e.helpers import by_id, posttrain, shortened_copy, summary

from artifacts.store import Store

SHORT = {"sft": {"max_steps": 8, "batch_size": 8}, "align": {"max_steps": 2, "batch_size": 4},
         "rl": {"steps": 1, "prompts_per_step": 2, "group_size": 2, "max_tokens": 16},
         "final-eval": {"n": 4, "max_new_tokens": 16}}


def run(spec, tmp_path, name: str) -> dict:
    done = posttrain("run", spec, "--summary-json", tmp_path / f"{name}.json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return by_id(summary(tmp_path / f"{name}.json"))


def test_your_data_runs_is_cached_and_reimports_only_a_changed_source(tmp_path):
    spec = shortened_copy(tmp_path, "your-data", SHORT)
    first = run(spec, tmp_path, "first")
    assert {stage["state"] for stage in first.values()} == {"completed"}
    assert first["chats"]["metrics"]["format"] == "messages" and first["prefs"]["metrics"]["format"] == "preference"
    assert first["sums-data"]["metrics"]["format"] == "prompts"  # the env's inline source, imported as a stage
    store = Store(f"file://{tmp_path / 'store'}")
    chats = pd.read_parquet(store.fetch(first["chats"]["outputs"]["dataset"]) / "data.parquet")
    assert len(chats) == 600 and chats["total_tokens"].min() > 0
    assert store.manifest(first["chats"]["outputs"]["dataset"])["metrics"]["contract"]["success"] is True
    assert set(first["final-eval"]["metrics"]) == {"sft", "align", "rl"}
    assert set(first["final-eval"]["metrics"]["rl"]["sums"]) >= {"accuracy", "format_rate", "mean_reward"}

    second = run(spec, tmp_path, "second")
    assert {stage["state"] for stage in second.values()} == {"cached"}

    prompts = spec.parent.parent / "examples" / "prompts.jsonl"
    rows = prompts.read_text().splitlines()
    changed = json.loads(rows[0])
    changed["answer"] = "-1"
    prompts.write_text("\n".join([json.dumps(changed), *rows[1:]]) + "\n")
    third = run(spec, tmp_path, "third")
    states = {stage_id: stage["state"] for stage_id, stage in third.items()}
    assert states == {"chats": "cached", "prefs": "cached", "sft": "cached", "align": "cached",
                      "sums-data": "completed", "rl": "completed", "final-eval": "completed"}
    assert third["sums-data"]["outputs"] != first["sums-data"]["outputs"]  # a new version of the changed dataset
