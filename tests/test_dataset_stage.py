"""The dataset stage's run on a temporary store: bad rows quarantined with their row numbers, or
dropped within max_bad_fraction; mixing by weight; reward modules that travel with the request."""

import json
import sys
from collections import Counter

import pytest

from artifacts.store import Store
from data_contracts.snapshots import keep
from data_contracts.sources import locate, source_files
from models.config import ModelConfig
from tasks.common import contract_gate
from tasks.common.context import StageContext
from tasks.common.contract_gate import ContractViolation
from tasks.common.datasets import read_frame
from tasks.runtime.child import install_code
from tasks.stages.dataset import DatasetStage, run
from tasks.train.loop import batch_indices, mixed_batch_indices

GOOD = {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]}
BAD = {"messages": [{"role": "user", "content": "What is 2+2?"}]}  # no answer to train on


def imported(tmp_path, rows: list[dict], **options):
    """Run the dataset stage over `rows` as the orchestrator would hand them to it."""
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    stage = DatasetStage(id="chats", kind="dataset", source="chats.jsonl", **options)
    store = Store(f"file://{tmp_path / 'store'}")
    stage.read_sources(tmp_path, store.location)
    kept = keep(store, source_files(locate("chats.jsonl", tmp_path)))
    ctx = StageContext(store=store, pipeline="t", run_id="r", stage_id="chats", cache_key="k", model=ModelConfig(),
                       envs={}, inputs={}, workdir=tmp_path / "work", sources={"source": kept},
                       announce_path=tmp_path / "messages.jsonl")
    return ctx, stage, run(stage, ctx)["dataset"]


def test_bad_rows_stop_the_stage_and_are_quarantined_with_their_row_numbers(tmp_path):
    ctx, stage, output = imported(tmp_path, [GOOD] * 5 + [BAD] + [GOOD] * 3)
    with pytest.raises(ContractViolation) as failure:
        contract_gate.check(ctx, output, stage.contract)
    assert str(failure.value).startswith(
        "data contract 'messages' failed on 9 rows: expect_column_values_to_be_in_set(no_assistant_turn): 1 rows, "
        "e.g. row-5; expect_column_values_to_be_in_set(not_ending_on_assistant): 1 rows, e.g. row-5 (quarantined in ")
    assert (tmp_path / "store" / "quarantine" / "r" / "chats" / "contract.json").exists()


def test_an_imported_dataset_loads_with_datasets(tmp_path):
    from datasets import load_dataset

    _, _, output = imported(tmp_path, [GOOD] * 3)
    loaded = load_dataset("parquet", data_files=str(output.local_dir / "data.parquet"), split="train",
                          cache_dir=str(tmp_path / "hf"))
    assert len(loaded) == 3 and json.loads(loaded[0]["messages"]) == GOOD["messages"]


def test_counting_tokens_reports_progress_to_the_orchestrator(tmp_path):
    from tasks.stages.dataset import TOKENIZE_CHUNK

    imported(tmp_path, [GOOD] * (TOKENIZE_CHUNK + 3))
    told = [json.loads(line) for line in (tmp_path / "messages.jsonl").read_text().splitlines()]
    progress = [m["progress"] for m in told if "progress" in m]
    assert progress[0]["step"] == TOKENIZE_CHUNK and progress[-1]["step"] == progress[-1]["total"] == TOKENIZE_CHUNK + 3
    assert any(m.get("log", "").startswith(f"[chats] step {TOKENIZE_CHUNK + 3}/{TOKENIZE_CHUNK + 3}") for m in told)


def test_drop_removes_bad_rows_within_the_cap_and_counts_them(tmp_path):
    ctx, _, output = imported(tmp_path, [GOOD] * 9 + [BAD], on_bad_rows="drop", max_bad_fraction=0.1)
    assert output.metrics["dropped_rows"] == 1 and output.metrics["dropped"] == ["row-9"]
    assert output.contract_summary["success"] and len(read_frame(output.local_dir)) == 9


def test_drop_beyond_max_bad_fraction_fails(tmp_path):
    with pytest.raises(ContractViolation):
        imported(tmp_path, [GOOD] * 4 + [BAD] * 2, on_bad_rows="drop", max_bad_fraction=0.1)


def test_limit_and_shuffle_keep_source_row_numbers(tmp_path):
    rows = [{"text": f"row number {i}"} for i in range(10)]
    _, _, output = imported(tmp_path, rows, limit=3, shuffle_seed=1)
    frame = read_frame(output.local_dir)
    assert len(frame) == 3 and all(text == f"row number {n}" for text, n in zip(frame["text"], frame["row"]))
    assert output.metrics == {"format": "text", "source_rows": 10, "rows": 3}


def test_datasets_mix_by_weight():
    assert mixed_batch_indices([50], [1.0], 8, 0, 3) == batch_indices(50, 8, 0, 3)  # one dataset: as before
    drawn = Counter(index >= 100 for step in range(40) for index in mixed_batch_indices([100, 10], [1, 3], 10, 0, step))
    assert 0.7 < drawn[True] / sum(drawn.values()) < 0.8  # the 10-row dataset gives 3/4 of the rows


def test_reward_code_travels_and_lands_on_the_import_path(tmp_path, monkeypatch):
    from envs.dataset import DatasetEnv, DatasetEnvConfig
    from flows.stage_requests import reward_code

    one = "def one(prompts, completions, completion_ids, **kw):\n    return [1.0] * len(completions)\n"
    (tmp_path / "spec" / "team" / "checks").mkdir(parents=True)
    (tmp_path / "spec" / "team" / "__init__.py").write_text("")
    (tmp_path / "spec" / "team" / "checks" / "sums.py").write_text(one)  # in a namespace package
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "lib_rewards.py").write_text(one.replace("one", "two"))
    config = DatasetEnvConfig(kind="dataset", data="qa", rewards=[{"function": "team.checks.sums:one"},
                                                                  {"function": "../lib/lib_rewards.py:two"},
                                                                  {"function": "posttrain.rewards:exact_match"}])
    config.find_rewards_in(tmp_path / "spec")
    carried = reward_code(config)
    assert carried == {"team/__init__.py": "", "team/checks/sums.py": one,  # by the path they are imported under
                       "lib_rewards.py": one.replace("one", "two")}  # not the project's own
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("team", "team.checks", "team.checks.sums", "lib_rewards"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    worker = tmp_path / "worker"
    install_code(carried, worker)  # a stage's process: the config crossed as JSON, no spec folder
    env = DatasetEnv(DatasetEnvConfig.model_validate_json(config.model_dump_json()), "qa")
    assert [func.name for func in env.rubric.funcs] == ["one", "two", "exact_match"]
    assert sys.modules["lib_rewards"].__file__ == str(worker / "code" / "lib_rewards.py")
    install_code({"pkg/travelled.py": "VALUE = 7\n"}, worker)
    import pkg.travelled

    assert pkg.travelled.VALUE == 7
    with pytest.raises(ValueError, match="leaves its folder"):
        install_code({"../escape.py": "x = 1\n"}, worker)
