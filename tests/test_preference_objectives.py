"""The preference stage's kto, orpo, simpo and cpo methods on a tiny store: the unpaired format
imported and contract-checked, kto trained on it (and on rollouts' pairs split into rows),
orpo/simpo/cpo trained without computing any reference log-prob."""

import math

import pytest
from test_dataset_stage import imported
from test_preference import align_stage, stage_context

from models.config import ModelConfig
from tasks.common import contract_gate
from tasks.common.context import StageContext
from tasks.common.contract_gate import ContractViolation
from tasks.common.datasets import read_rows


def unpaired_rows(n: int = 4) -> list[dict]:
    """n prompts, each with a desirable (right) and an undesirable (wrong, repetitive) completion."""
    rows = []
    for i in range(n):
        rows.append({"prompt": f"what is {i}+4?", "completion": f"The final answer is {i + 4}.", "label": True})
        rows.append({"prompt": f"what is {i}+4?", "completion": "The answer is correct." * 3, "label": False})
    return rows


def test_unpaired_format_is_detected_and_checked_by_its_contract(tmp_path):
    ctx, stage, output = imported(tmp_path, unpaired_rows())
    assert output.metrics["format"] == "unpaired" and stage.output_kind() == "unpaired preference dataset"
    assert contract_gate.check(ctx, output, stage.contract)["success"] is True
    rows = read_rows(output.local_dir)
    assert [row["label"] for row in rows] == [True, False] * 4 and min(row["total_tokens"] for row in rows) > 0


def test_unpaired_label_that_is_not_a_boolean_fails_the_contract(tmp_path):
    ctx, stage, output = imported(tmp_path, unpaired_rows(2)[:3] + [{"prompt": "p", "completion": "c",
                                                                           "label": "yes"}])
    with pytest.raises(ContractViolation, match=r"data contract 'unpaired' failed on 4 rows: .*"
                                                r"expect_column_values_to_be_null\(malformed\): 1 rows, e.g. row-3"):
        contract_gate.check(ctx, output, stage.contract)
    [bad] = [row for row in read_rows(output.local_dir) if isinstance(row["malformed"], str)]
    assert bad["malformed"] == "row 3.label: must be true (desirable) or false (undesirable), got 'yes'"


def kto_context(tmp_path) -> StageContext:
    """A store with the tiny preset as the policy and an imported unpaired dataset `prefs`."""
    from artifacts.store import Store
    from models.presets import materialize

    (tmp_path / "import").mkdir()
    _, _, output = imported(tmp_path / "import", unpaired_rows())
    store = Store(f"file://{tmp_path / 'store'}")
    policy_ref = store.commit("t/sft", "checkpoint", materialize("tiny-llama"), producer={})
    prefs_ref = store.commit("t/prefs", "dataset", output.local_dir, producer={})
    return StageContext(store=store, pipeline="t", run_id="r", stage_id="align", cache_key="k", model=ModelConfig(),
                        envs={}, inputs={"sft": str(policy_ref), "prefs": str(prefs_ref)}, workdir=tmp_path / "work")


def history_of(outputs) -> list[dict]:
    import json

    lines = (outputs["report"].local_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if "loss" in json.loads(line)]


def test_kto_stage_trains_on_an_unpaired_dataset(tmp_path):
    from tasks.stages.preference import run

    outputs = run(align_stage(method="kto", data="prefs", batch_size=4, max_steps=3, desirable_weight=1.2),
                  kto_context(tmp_path))
    metrics = outputs["checkpoint"].metrics
    assert (metrics["method"], metrics["rows"], metrics["desirable"], metrics["steps"]) == ("kto", 8, 4, 3)
    assert outputs["pairs"].contract_summary["success"] is True
    rows = read_rows(outputs["pairs"].local_dir)
    assert sorted(row["label"] for row in rows) == [False] * 4 + [True] * 4
    assert all(row["ref_logp"] < 0 for row in rows)  # the reference's log-probs, computed before training
    history = history_of(outputs)
    assert len(history) == 3 and all(math.isfinite(h["loss"]) and h["kl"] >= 0 for h in history)
    assert all({"rewards/chosen", "rewards/rejected", "reward_margin"} <= set(h) for h in history)
    assert (outputs["checkpoint"].local_dir / "config.json").exists()


def test_kto_splits_the_pairs_of_rollouts_into_desirable_and_undesirable_rows(tmp_path):
    from tasks.stages.preference import run

    outputs = run(align_stage(method="kto", max_steps=2, batch_size=4), stage_context(tmp_path, [1.2, 0.0],
                                                                                      ModelConfig()))
    rows = read_rows(outputs["pairs"].local_dir)
    assert outputs["checkpoint"].metrics["pairs"] == 3 and len(rows) == 6
    assert {row["id"].rsplit("/", 1)[1]: row["label"] for row in rows} == {"desirable": True, "undesirable": False}
    assert {row["completion"] for row in rows if row["label"]} == {"The final answer is 4."}


@pytest.fixture
def reference_calls(monkeypatch) -> list:
    """One entry per call of the offline stage's reference pass (the real one runs: counted, not replaced)."""
    import tasks.stages.preference.stage as offline

    calls = []
    real_reference_logps = offline.reference_logps
    monkeypatch.setattr(offline, "reference_logps", lambda *args: calls.append(1) or real_reference_logps(*args))
    return calls


@pytest.mark.parametrize("method", ["orpo", "simpo", "cpo"])
def test_orpo_simpo_cpo_train_without_any_reference_forward(method, tmp_path, reference_calls):
    from tasks.stages.preference import run

    outputs = run(align_stage(method=method), stage_context(tmp_path, [1.2, 0.0], ModelConfig()))
    assert reference_calls == []  # no reference model loaded, no reference log-prob computed
    pairs = read_rows(outputs["pairs"].local_dir)
    assert len(pairs) == 3 and not {"ref_chosen_logp", "ref_rejected_logp"} & set(pairs[0])
    history = history_of(outputs)
    assert len(history) == 3 and all(math.isfinite(h["loss"]) for h in history)
    assert all(("nll_loss" in h) == (method != "simpo") for h in history)
    assert outputs["checkpoint"].metrics["method"] == method


def test_dpo_still_computes_its_reference_log_probs_once(tmp_path, reference_calls):
    """The control of the test above: the counter sees the DPO family's two reference passes."""
    from tasks.stages.preference import run

    run(align_stage(method="dpo", max_steps=1), stage_context(tmp_path, [1.2, 0.0], ModelConfig()))
    assert len(reference_calls) == 2  # chosen and rejected sides


def test_orpo_held_out_loss_needs_no_reference(tmp_path):
    """`eval_fraction` with a reference-free method: the held-out pairs' loss (its NLL term included)."""
    from tasks.stages.preference import run

    outputs = run(align_stage(method="orpo", eval_fraction=0.3, eval_every=2, checkpoint_every=10),
                  stage_context(tmp_path, [1.2, 0.0], ModelConfig()))
    metrics = outputs["checkpoint"].metrics
    assert metrics["held_out_pairs"] == 1 and math.isfinite(metrics["final_held_out_loss"])
    assert metrics["final_held_out_loss"] > 0  # ORPO's NLL term alone is positive
