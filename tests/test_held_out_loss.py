"""`eval_fraction` / `eval_every` of sft and preference: a held-out slice of each input dataset, the
same on every run, never trained on, its loss measured without gradients and recorded in the
stage's curves and report as `held_out/<metric>`."""

import json

import pytest
import yaml

from flows.spec import SpecError, parse_spec
from tasks.train.held_out import due, split_held_out


def test_eval_fraction_holds_out_a_seeded_slice_of_each_dataset():
    split = split_held_out([10, 4], 0.2, seed=3)
    assert len(split.held) == 3 and split.sizes == [8, 3]  # 2 of the first, 1 (at least one) of the second
    assert sum(i < 10 for i in split.held) == 2
    assert sorted(split.train + split.held) == list(range(14))
    assert split_held_out([10, 4], 0.2, seed=3) == split != split_held_out([10, 4], 0.2, seed=4)
    assert split_held_out([5], 0.0, seed=0).train == [0, 1, 2, 3, 4]  # off: every row trains, in order
    assert [step + 1 for step in range(7) if due(step, 7, 3)] == [3, 6, 7]


def test_eval_fraction_held_out_loss_of_sft_is_in_the_curves_and_report(tmp_path):
    from artifacts.store import Store
    from models.config import ModelConfig
    from tasks.common.context import StageContext
    from tasks.common.datasets import write_rows
    from tasks.stages.sft import SftStage, run

    store = Store(f"file://{tmp_path / 'store'}")
    write_rows([{"prompt": f"What is {i} + 1?", "completion": f"The answer is {i + 1}."} for i in range(20)],
               tmp_path / "rows")
    data = store.commit("t/data", "dataset", tmp_path / "rows", producer={})
    ctx = StageContext(store=store, pipeline="t", run_id="r", stage_id="sft", cache_key="k", model=ModelConfig(),
                       envs={}, inputs={"data": str(data)}, workdir=tmp_path / "work")
    stage = SftStage(kind="sft", id="sft", data="data", max_steps=4, batch_size=4, learning_rate=3e-3,
                     warmup_steps=0, checkpoint_every=10, eval_fraction=0.25, eval_every=2)
    outputs = run(stage, ctx)
    metrics = outputs["checkpoint"].metrics
    assert (metrics["examples"], metrics["held_out_examples"]) == (15, 5)
    history = [json.loads(line) for line in (outputs["report"].local_dir / "metrics.jsonl").read_text().splitlines()]
    measured = [entry["held_out/loss"] for entry in history if "held_out/loss" in entry]
    assert [entry["step"] for entry in history if "held_out/loss" in entry] == [2, 4]
    assert measured[1] < measured[0]  # the held-out rows share the training rows' form: their loss falls too
    assert metrics["final_held_out_loss"] == measured[-1]
    assert "| held_out/loss |" in (outputs["report"].local_dir / "report.md").read_text()


def test_eval_fraction_of_online_preference_is_refused_in_one_line():
    spec = {"name": "t", "envs": {"arith": {"kind": "arith", "digits": 2}}, "stages": [
        {"id": "warmup", "kind": "synthesize", "env": "arith", "n": 10},
        {"id": "sft", "kind": "sft", "data": "warmup", "max_steps": 2},
        {"id": "align", "kind": "preference", "policy": "sft", "mode": "online", "envs": {"arith": 1.0},
         "max_steps": 2, "eval_fraction": 0.1}]}
    with pytest.raises(SpecError) as raised:
        parse_spec(yaml.safe_load(yaml.safe_dump(spec)), read_sources=False)
    assert str(raised.value).startswith("stages[2]: Value error, eval_fraction: mode: online samples new pairs every "
                                        "step; a held-out loss is measured on a dataset's pairs (mode: offline) (got ")
    assert "\n" not in str(raised.value)
    spec["stages"][1]["eval_fraction"] = 1.0
    with pytest.raises(SpecError, match=r"^stages\[1\]\.eval_fraction: Input should be less than 1"):
        parse_spec(yaml.safe_load(yaml.safe_dump(spec)), read_sources=False)
