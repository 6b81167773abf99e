"""The reward_model stage: its Bradley–Terry loss against TRL's RewardTrainer (pinned TRL), the
pairs' token ids against what TRL makes of the same conversational rows, and the stage itself on
a tiny store: a LoRA reward model learns the pairs and reports its held-out pairwise accuracy."""

import json
import math

import pytest
import torch

from models.losses import reward_model_loss

TRL_VERSION = "1.16.0"
CALCULATOR = {"role": "system", "content": "You are a calculator. Answer with the sum."}


def preference_rows(n: int) -> list[dict]:
    """Conversational preference rows as examples/preferences.jsonl holds them: the right sum
    chosen, a wrong one rejected; every fifth rejected answer loops."""
    rows = []
    for i in range(n):
        a, b = i % 9 + 1, (i * 7) % 9 + 1
        wrong = "The answer is correct. " * 4 if i % 5 == 0 else f"{a} + {b} = {a + b + 1}. The answer is {a + b + 1}."
        rows.append({"id": f"p{i}", "prompt": [CALCULATOR, {"role": "user", "content": f"What is {a}+{b}?"}],
                     "chosen": [{"role": "assistant", "content": f"{a} + {b} = {a + b}. The answer is {a + b}."}],
                     "rejected": [{"role": "assistant", "content": wrong.strip()}]})
    return rows


def test_reward_model_loss_is_bradley_terry_with_trls_centering_term():
    chosen, rejected = torch.tensor([2.0, -1.0]), torch.tensor([0.5, 1.0])
    expected = [-math.log(1 / (1 + math.exp(-(c - r)))) for c, r in zip(chosen.tolist(), rejected.tolist())]
    assert reward_model_loss(chosen, rejected).tolist() == pytest.approx(expected)
    centered = reward_model_loss(chosen, rejected, center_coefficient=0.01)
    assert centered.tolist() == pytest.approx([e + 0.01 * (c + r) ** 2 for e, c, r in
                                               zip(expected, chosen.tolist(), rejected.tolist())])
    margins = reward_model_loss(chosen, rejected, margins=torch.tensor([1.0, 0.0]))
    assert margins[0].item() == pytest.approx(-math.log(1 / (1 + math.exp(-0.5))))


@pytest.fixture(scope="module")
def reward_model_and_tokenizer():
    from models.config import ModelConfig
    from models.loading import load_model, load_tokenizer
    from models.presets import materialize

    torch.manual_seed(0)
    folder = materialize("tiny-llama")
    return load_model(folder, ModelConfig(), reward_head=True).eval(), load_tokenizer(folder)


def trl_reward_trainer(model, tokenizer, rows, tmp_path, center=None):
    import trl
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    assert trl.__version__ == TRL_VERSION
    args = RewardConfig(output_dir=str(tmp_path), report_to=[], bf16=False, use_cpu=True, max_length=None,
                        center_rewards_coefficient=center)
    dataset = Dataset.from_list([{key: row[key] for key in ("prompt", "chosen", "rejected")} for row in rows])
    return RewardTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)


@pytest.mark.parametrize("center", [None, 0.01])
def test_reward_model_pairs_and_loss_match_trls_reward_trainer(reward_model_and_tokenizer, tmp_path, center):
    """The same conversational rows: our pairs' ids are TRL's (its chat template over prompt + answer),
    and on one batch of them our loss is RewardTrainer.compute_loss."""
    from trl.trainer.reward_trainer import DataCollatorForPreference

    from tasks.common.encoding import preference_examples
    from tasks.rollout.reward_models import reward_scores

    model, tokenizer = reward_model_and_tokenizer
    rows = preference_rows(6)
    trainer = trl_reward_trainer(model, tokenizer, rows, tmp_path, center)
    ours = [preference_examples(tokenizer, {**row, "prompt": json.dumps(row["prompt"])}, 256) for row in rows]
    processed = trainer.train_dataset
    assert [list(processed[i]["chosen_ids"]) for i in range(6)] == [c.input_ids for c, _ in ours]
    assert [list(processed[i]["rejected_ids"]) for i in range(6)] == [r.input_ids for _, r in ours]

    batch = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id)(
        [{"chosen_ids": c.input_ids, "rejected_ids": r.input_ids} for c, r in ours])
    with torch.no_grad():
        theirs = trainer.compute_loss(model, batch).item()
        scores = reward_scores(model, [c for c, _ in ours] + [r for _, r in ours], tokenizer.pad_token_id, "cpu")
        mine = reward_model_loss(scores[:6], scores[6:], center_coefficient=center).mean().item()
    assert mine == pytest.approx(theirs, rel=1e-5)


def test_reward_model_stage_learns_the_pairs_and_reports_held_out_accuracy(tmp_path):
    """LoRA over tiny-llama, 12 steps: a reward_model artifact (the adapter and its score head) whose
    held-out pairwise accuracy is reported; an in-stage checkpoint is committed as a reward model too."""
    from artifacts.store import Store
    from models.config import ModelConfig
    from tasks.common.context import StageContext
    from tasks.common.datasets import write_rows
    from tasks.stages.reward_model import RewardModelStage, run

    store = Store(f"file://{tmp_path / 'store'}")
    rows = [{**row, "prompt": json.dumps(row["prompt"]), "chosen": json.dumps(row["chosen"]),
             "rejected": json.dumps(row["rejected"]), "conversational": True} for row in preference_rows(60)]
    write_rows(rows, tmp_path / "prefs")
    prefs = store.commit("t/prefs", "dataset", tmp_path / "prefs", producer={})
    ctx = StageContext(store=store, pipeline="t", run_id="r", stage_id="rm", cache_key="k",
                       model=ModelConfig(base="tiny-llama", lora={"r": 4, "alpha": 8}), envs={},
                       inputs={"prefs": str(prefs)}, workdir=tmp_path / "work")
    stage = RewardModelStage(kind="reward_model", id="rm", data="prefs", max_steps=12, batch_size=8,
                             learning_rate=2e-3, warmup_steps=0, checkpoint_every=6, eval_fraction=0.2)
    outputs = run(stage, ctx)

    checkpoint = outputs["checkpoint"]
    assert checkpoint.kind == "reward_model"
    assert (checkpoint.local_dir / "adapter_config.json").exists()
    assert json.loads((checkpoint.local_dir / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"
    metrics = checkpoint.metrics
    assert metrics["train_pairs"] + metrics["eval_pairs"] == 60 and metrics["eval_pairs"] > 0
    assert metrics["eval_accuracy"] >= 0.8  # the pairs differ in the sum, and every fifth in a loop
    [promoted] = metrics["promoted_checkpoints"]
    assert store.manifest(store.resolve(promoted))["kind"] == "reward_model"
    assert "eval_accuracy" in json.loads((outputs["report"].local_dir / "metrics.jsonl").read_text().splitlines()[5])
