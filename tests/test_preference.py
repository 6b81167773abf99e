"""Preference pairs from rollouts, and the preference losses, on toy objects."""

import math

import pytest
import torch

from models.losses import IGNORE_INDEX, preference_loss, sequence_logps
from tasks.common.encoding import encode_ids
from tasks.stages.preference import preference_pairs


def rollout(prompt_id: str, index: int, reward: float, tokens: int, mode: str = "sampled", doom: bool = False):
    return {"id": f"{prompt_id}-{index}", "prompt_id": prompt_id, "group_index": index, "mode": mode,
            "prompt": f"question {prompt_id}", "completion": f"{prompt_id} answer {index}",
            "tokens": list(range(tokens)), "reward": reward, "doom_loop": doom}


def test_best_is_chosen_and_worst_rejected_per_prompt():
    rows = [rollout("p", 0, 0.2, 30), rollout("p", 1, 1.2, 30), rollout("p", 2, 1.0, 30),
            rollout("p", 3, 0.0, 64, mode="greedy", doom=True)]
    pairs, stats = preference_pairs(rows)
    assert stats.pairs == 1 and stats.prompts == 1
    [pair] = pairs
    assert (pair["chosen"], pair["rejected"]) == ("p answer 1", "p answer 3")
    assert (pair["chosen_score"], pair["rejected_score"]) == (1.2, 0.0)
    assert pair["rejected_mode"] == "greedy" and pair["rejected_doom_loop"]
    assert pair["chosen_tokens"] == list(range(30)) and len(pair["rejected_tokens"]) == 64


def test_equal_scores_prefer_the_shorter_chosen_and_the_longer_rejected():
    rows = [rollout("p", 0, 1.0, 40), rollout("p", 1, 1.0, 20), rollout("p", 2, 0.0, 30), rollout("p", 3, 0.0, 64)]
    [pair], _ = preference_pairs(rows)
    assert (pair["chosen"], pair["rejected"]) == ("p answer 1", "p answer 3")


def test_tied_and_unscored_groups_are_dropped_and_counted():
    rows = [rollout("tied", i, 0.2, 30) for i in range(4)]
    rows += [rollout("unscored", 0, math.nan, 30), rollout("unscored", 1, 1.0, 30)]
    rows += [rollout("ok", 0, math.nan, 30), rollout("ok", 1, 1.0, 30), rollout("ok", 2, 0.0, 30)]
    pairs, stats = preference_pairs(rows)
    assert [p["id"] for p in pairs] == ["ok"]
    assert (stats.prompts, stats.pairs, stats.dropped_tied, stats.dropped_unscored) == (3, 1, 1, 1)


def test_every_pair_of_a_group_for_a_reward_model_held_out_by_group():
    """`rollout_pairs: all`: each completion over each one scored lower (ties are no pair); a group's
    pairs share its split key, so the held-out pairs are whole groups."""
    from tasks.common.pairs import split_key

    rows = [rollout("p", 0, 1.0, 20), rollout("p", 1, 1.0, 30), rollout("p", 2, 0.0, 30), rollout("p", 3, 0.5, 30)]
    rows += [rollout("tied", i, 0.0, 30) for i in range(2)]
    pairs, stats = preference_pairs(rows, every_pair=True)
    assert sorted((p["chosen"], p["rejected"]) for p in pairs) == [
        ("p answer 0", "p answer 2"), ("p answer 0", "p answer 3"), ("p answer 1", "p answer 2"),
        ("p answer 1", "p answer 3"), ("p answer 3", "p answer 2")]
    assert (stats.prompts, stats.pairs, stats.dropped_tied) == (2, 5, 1)
    assert len({p["id"] for p in pairs}) == 5 and {split_key(p) for p in pairs} == {"p"}
    assert preference_pairs(rows, min_reward_gap=0.5, every_pair=True)[1].pairs == 2
    [best_vs_worst], _ = preference_pairs(rows[:4])
    assert split_key(best_vs_worst) == best_vs_worst["id"] == "p"
    assert split_key({"id": "prefs/pair-7"}) == "prefs/pair-7"  # a given pair's id is its own key


def test_min_reward_gap_drops_near_ties():
    rows = [rollout("p", 0, 1.0, 30), rollout("p", 1, 0.9, 30)]
    assert preference_pairs(rows, min_reward_gap=0.0)[1].pairs == 1
    assert preference_pairs(rows, min_reward_gap=0.1)[1].dropped_tied == 1


def test_encode_ids_masks_the_prompt_and_cuts_at_max_len():
    example = encode_ids([1, 2, 3], [7, 8, 9, 2], max_len=6)
    assert example.input_ids == [1, 2, 3, 7, 8, 9]
    assert example.labels == [IGNORE_INDEX] * 3 + [7, 8, 9]
    assert example.truncated


def test_sequence_logps_sums_completion_tokens_only():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 3, 4, IGNORE_INDEX], [IGNORE_INDEX, 5, 6, 7, 8]])
    logps, tokens = sequence_logps(logits, labels)
    log_probs = logits.log_softmax(-1)
    expected = [log_probs[0, 1, 3] + log_probs[0, 2, 4], log_probs[1, 0, 5] + log_probs[1, 1, 6]
                + log_probs[1, 2, 7] + log_probs[1, 3, 8]]
    assert torch.allclose(logps, torch.stack(expected)) and tokens.tolist() == [2, 4]


def toy_loss(method, beta=0.5):
    """h_w = 2 - 0 = 2 over 4 tokens, h_l = -1 - 1 = -2 over 8 tokens."""
    t = torch.tensor
    return preference_loss(method, beta, t([2.0]), t([-1.0]), t([0.0]), t([1.0]), t([4]), t([8]))


def test_losses_follow_their_formulas():
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    dpo, chosen_reward, rejected_reward = toy_loss("dpo")
    assert dpo.item() == pytest.approx(-math.log(sigmoid(0.5 * (2 - -2))))
    assert (chosen_reward.item(), rejected_reward.item()) == (1.0, -1.0)
    assert toy_loss("ln_dpo")[0].item() == pytest.approx(-math.log(sigmoid(0.5 * (2 / 4 - -2 / 8))))
    assert toy_loss("ipo")[0].item() == pytest.approx((2 / 4 - -2 / 8 - 1 / (2 * 0.5)) ** 2)
    with pytest.raises(ValueError, match="unknown preference method"):
        toy_loss("rso")


def stage_context(tmp_path, rewards: list[float], model_config):
    """A store holding the tiny preset as the policy and 3 prompt groups of rollouts scored `rewards`."""
    from artifacts.store import Store
    from models.loading import load_tokenizer
    from models.presets import materialize
    from tasks.common.context import StageContext
    from tasks.common.datasets import write_rows

    store = Store(f"file://{tmp_path / 'store'}")
    folder = materialize("tiny-llama")
    tokenizer = load_tokenizer(folder)
    policy_ref = store.commit("t/sft", "checkpoint", folder, producer={})
    texts = ["The final answer is 4.", "The answer is correct." * 3]
    rows = []
    for p in range(3):
        for index, (text, reward) in enumerate(zip(texts, rewards)):
            rows.append(rollout(f"p{p}", index, reward, 0) | {
                "prompt": f"what is {p}+4?", "completion": text,
                "tokens": tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]})
    write_rows(rows, tmp_path / "rollouts")
    rollouts_ref = store.commit("t/onpolicy", "dataset", tmp_path / "rollouts", producer={})
    return StageContext(store=store, pipeline="t", run_id="r", stage_id="align", cache_key="k", model=model_config,
                        envs={}, inputs={"sft": str(policy_ref), "onpolicy": str(rollouts_ref)},
                        workdir=tmp_path / "work")


def align_stage(**overrides):
    from tasks.stages.preference import PreferenceStage

    return PreferenceStage(**{"kind": "preference", "id": "align", "policy": "sft", "data": "onpolicy",
                              "method": "ln_dpo", "max_steps": 3, "batch_size": 2, "learning_rate": 1e-3,
                              "warmup_steps": 0, "checkpoint_every": 2, **overrides})


def test_stage_with_lora_trains_an_adapter_against_the_input_checkpoint(tmp_path):
    """`run` on a tiny store: pairs with the input checkpoint's log-probs, an adapter checkpoint out."""
    from models.config import ModelConfig
    from models.loading import load_model, load_tokenizer
    from models.presets import materialize
    from models.sampling import chat_prompt
    from tasks.common.datasets import read_rows
    from tasks.stages.preference import reference_logps, run

    ctx = stage_context(tmp_path, [1.2, 0.0], ModelConfig(base="tiny-llama", lora={"r": 4, "alpha": 8}))
    outputs = run(align_stage(), ctx)

    assert list(outputs) == ["checkpoint", "report", "pairs"]
    assert (outputs["checkpoint"].local_dir / "adapter_config.json").exists()
    assert outputs["checkpoint"].metrics["pairs"] == 3 and outputs["checkpoint"].metrics["steps"] == 3
    assert outputs["pairs"].contract_summary["success"] is True  # checked before the first step
    pairs = read_rows(outputs["pairs"].local_dir)
    assert [p["chosen"] for p in pairs] == ["The final answer is 4."] * 3
    # the reference is the input checkpoint itself (here the full preset under fresh adapters)
    folder = materialize("tiny-llama")
    tokenizer = load_tokenizer(folder)
    chosen = [encode_ids(chat_prompt(tokenizer, p["prompt"]), list(p["chosen_tokens"]), 256) for p in pairs]
    expected = reference_logps(load_model(folder, ModelConfig()), chosen, tokenizer.pad_token_id, "cpu")
    assert [p["ref_chosen_logp"] for p in pairs] == pytest.approx(expected, abs=1e-4)
    assert ctx.store.listdir(ctx.scratch) == ["step-2"]  # the in-stage checkpoint, until the child clears it


def test_rollouts_without_a_single_pair_fail_the_stage_without_retries(tmp_path):
    from models.config import ModelConfig
    from tasks.common.errors import NoTrainingData
    from tasks.stages.preference import run

    ctx = stage_context(tmp_path, [0.2, 0.2], ModelConfig())
    with pytest.raises(NoTrainingData, match=r"no preference pairs in t/onpolicy@[0-9a-f]{16}: all 3 prompt "
                                                r"groups tied or unscored"):
        run(align_stage(), ctx)


def test_eval_fraction_held_out_loss_of_preference_is_in_the_curves_and_report(tmp_path):
    """Pairs held out of training (`eval_fraction`): their loss and reward accuracy every `eval_every`
    steps and after the last, as `held_out/...` series beside the training ones."""
    import json

    from models.config import ModelConfig
    from tasks.stages.preference import run

    ctx = stage_context(tmp_path, [1.2, 0.0], ModelConfig())
    outputs = run(align_stage(eval_fraction=0.3, eval_every=2, checkpoint_every=10), ctx)
    metrics = outputs["checkpoint"].metrics
    assert metrics["held_out_pairs"] == 1 and metrics["pairs"] == 3
    history = [json.loads(line) for line in (outputs["report"].local_dir / "metrics.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in history if "held_out/loss" in entry] == [2, 3]
    assert metrics["final_held_out_loss"] == history[-1]["held_out/loss"] > 0
    assert 0 <= history[-1]["held_out/reward_accuracy"] <= 1
    report = (outputs["report"].local_dir / "report.md").read_text()
    assert "| held_out/loss |" in report and "| held_out/reward_accuracy |" in report and "| loss |" in report
