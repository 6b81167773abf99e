"""GRPO-family losses against TRL's GRPOTrainer loss path (pinned TRL), and advantages by hand.

Both sides get the same policy, prompts, completions, masks, advantages, old and reference
log-probs; TRL computes `GRPOTrainer._compute_loss`, ours per-token log-probs from the same
forward pass + `models.rl_losses.grpo_loss`.
"""

import math

import pytest
import torch

from models.loading import load_tokenizer
from models.presets import materialize
from models.rl_losses import group_advantages, grpo_loss, kl_k3, rloo_advantages

TRL_VERSION = "1.16.0"
MAX_COMPLETION = 12


@pytest.fixture(scope="module")
def policy_and_batch():
    """4 completions (2 groups of 2) of different lengths, left-padded prompts, right-padded completions."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    folder = materialize("tiny-llama")
    policy = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    tokenizer = load_tokenizer(folder)
    prompts = [[5, 6, 7], [8, 9], [5, 6, 7], [8, 9]]
    completions = [[20, 21, 22, 23, 2], [30, 31, 2], [40, 41, 42, 43, 44, 45, 46, 2], [50, 2]]
    width_p, width_c = max(map(len, prompts)), MAX_COMPLETION
    prompt_ids = torch.full((4, width_p), tokenizer.pad_token_id)
    prompt_mask = torch.zeros((4, width_p), dtype=torch.long)
    completion_ids = torch.full((4, width_c), tokenizer.pad_token_id)
    completion_mask = torch.zeros((4, width_c), dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompts, completions)):
        prompt_ids[row, width_p - len(p):], prompt_mask[row, width_p - len(p):] = torch.tensor(p), 1
        completion_ids[row, :len(c)], completion_mask[row, :len(c)] = torch.tensor(c), 1
    with torch.no_grad():
        logps = completion_logps(policy, prompt_ids, prompt_mask, completion_ids, completion_mask)
    old = logps + 0.3 * torch.randn_like(logps)  # ratios far enough from 1 that both clip sides bind
    ref = logps + 0.2 * torch.randn_like(logps)
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
             "completion_mask": completion_mask, "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]),
             "old_per_token_logps": old, "ref_per_token_logps": ref,
             "num_items_in_batch": completion_mask.sum().float()}
    return policy, tokenizer, batch


def completion_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """Per-token log-probs [B, T] of the completion tokens (one forward over prompt + completion)."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, prompt_ids.size(1) - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


def trl_loss(policy, tokenizer, batch, tmp_path, *, loss_type, beta, epsilon_high, level="token",
             kl_correction=False) -> float:
    import trl
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    assert trl.__version__ == TRL_VERSION
    args = GRPOConfig(output_dir=str(tmp_path), loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=epsilon_high,
                      max_completion_length=MAX_COMPLETION, num_generations=2, per_device_train_batch_size=2,
                      importance_sampling_level=level, use_bias_correction_kl=kl_correction, bf16=False,
                      use_cpu=True, report_to=[])
    trainer = GRPOTrainer(model=policy, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list([{"prompt": "q"}] * 2), processing_class=tokenizer)
    with torch.no_grad():  # the model is in eval mode: TRL's eval normalizers (no gradient accumulation)
        return trainer._compute_loss(policy, dict(batch)).item()


def our_loss(policy, batch, *, aggregation, beta, epsilon_high, level="token", kl_correction=False) -> float:
    with torch.no_grad():
        logps = completion_logps(policy, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                 batch["completion_mask"])
        loss, _ = grpo_loss(logps, batch["old_per_token_logps"], batch["advantages"], batch["completion_mask"],
                            epsilon_low=0.2, epsilon_high=epsilon_high, aggregation=aggregation,
                            max_completion_length=MAX_COMPLETION, ref_logps=batch["ref_per_token_logps"], beta=beta,
                            ratio_level=level, kl_ratio_correction=kl_correction)
    return loss.item()


@pytest.mark.parametrize("aggregation", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("epsilon_high", [0.2, 0.28])
def test_grpo_loss_matches_trl(aggregation, beta, epsilon_high, policy_and_batch, tmp_path):
    policy, tokenizer, batch = policy_and_batch
    theirs = trl_loss(policy, tokenizer, batch, tmp_path, loss_type=aggregation, beta=beta,
                      epsilon_high=epsilon_high)
    ours = our_loss(policy, batch, aggregation=aggregation, beta=beta, epsilon_high=epsilon_high)
    assert abs(theirs) > 1e-3
    assert ours == pytest.approx(theirs, abs=1e-5)


@pytest.mark.parametrize("aggregation", ["grpo", "dapo"])
def test_kl_ratio_correction_matches_trl(aggregation, policy_and_batch, tmp_path):
    policy, tokenizer, batch = policy_and_batch
    theirs = trl_loss(policy, tokenizer, batch, tmp_path, loss_type=aggregation, beta=0.04, epsilon_high=0.28,
                      kl_correction=True)
    ours = our_loss(policy, batch, aggregation=aggregation, beta=0.04, epsilon_high=0.28, kl_correction=True)
    assert ours == pytest.approx(theirs, abs=1e-5)
    assert ours != pytest.approx(our_loss(policy, batch, aggregation=aggregation, beta=0.04, epsilon_high=0.28),
                                 abs=1e-6)


def rl_stage(**fields):
    from tasks.stages.rl.config import RlStage

    return RlStage(**{"kind": "rl", "id": "rl", "policy": "align", "envs": {"arith": 1.0}, "steps": 2,
                      "epsilon_high": 0.28, **fields})


def stage_loss(policy, batch, stage) -> float:
    """The loss the rl stage's update takes (PolicyUpdate.of(stage).loss) on the batch."""
    from tasks.stages.rl.update import PolicyUpdate

    loss_fn = PolicyUpdate.of(stage, 0).loss
    with torch.no_grad():
        logps = completion_logps(policy, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                 batch["completion_mask"])
        loss, _ = loss_fn(logps, batch["old_per_token_logps"], batch["advantages"], batch["completion_mask"],
                          ref_logps=batch["ref_per_token_logps"], max_completion_length=MAX_COMPLETION)
    return loss.item()


GSPO_REWARDS = torch.tensor([1.0, 0.0, 0.3, 0.9])  # two groups of two, as the batch's rows


@pytest.mark.parametrize("advantage", ["grpo", "rloo"])
@pytest.mark.parametrize("aggregation", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_gspo_sequence_ratio_matches_trl(advantage, aggregation, beta, policy_and_batch, tmp_path):
    """rl `importance_sampling_level: sequence` (GSPO) for grpo and rloo advantages: the stage's loss equals
    GRPOTrainer's with importance_sampling_level="sequence" on the same batch and advantages (rloo's as
    TRL's RLOOTrainer computes them: tests/test_rloo.py)."""
    policy, tokenizer, batch = policy_and_batch
    stage = rl_stage(advantage=advantage, loss_aggregation=aggregation, beta=beta,
                     importance_sampling_level="sequence")
    estimator = rloo_advantages if advantage == "rloo" else group_advantages
    batch = {**batch, "advantages": estimator(GSPO_REWARDS, 2, stage.scale_rewards)}
    theirs = trl_loss(policy, tokenizer, batch, tmp_path, loss_type=aggregation, beta=beta, epsilon_high=0.28,
                      level="sequence")
    ours = stage_loss(policy, batch, stage)
    assert abs(theirs) > 1e-3
    assert ours == pytest.approx(theirs, abs=1e-5)
    token_level = trl_loss(policy, tokenizer, batch, tmp_path, loss_type=aggregation, beta=beta, epsilon_high=0.28)
    assert ours != pytest.approx(token_level, abs=1e-4)  # the ratio's level changed the loss
    assert stage_loss(policy, batch, rl_stage(advantage=advantage, loss_aggregation=aggregation,
                                              beta=beta)) == pytest.approx(token_level, abs=1e-5)


def test_gspo_steppo_keeps_its_per_step_ratio_and_keys_stay_put():
    """steppo's ratio is sequence whatever is written but token, which it refuses; the field enters the
    cache key only where it is not the algorithm's own level."""
    assert rl_stage(algorithm="steppo").importance_sampling_level == "sequence"
    assert rl_stage(algorithm="steppo", importance_sampling_level="sequence").params() == \
        rl_stage(algorithm="steppo").params()
    with pytest.raises(ValueError, match="importance_sampling_level: token: steppo's ratio is one per step"):
        rl_stage(algorithm="steppo", importance_sampling_level="token")
    assert "importance_sampling_level" not in rl_stage().params()
    assert rl_stage(importance_sampling_level="sequence").params()["importance_sampling_level"] == "sequence"
    assert rl_stage(advantage="rloo", importance_sampling_level="sequence").gspo


def test_clip_higher_changes_the_loss(policy_and_batch):
    policy, _, batch = policy_and_batch
    assert our_loss(policy, batch, aggregation="dapo", beta=0.0, epsilon_high=0.28) != pytest.approx(
        our_loss(policy, batch, aggregation="dapo", beta=0.0, epsilon_high=0.2), abs=1e-6)


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 0.0])
    group = group_advantages(rewards, 2, "group")
    std = math.sqrt(0.5)  # unbiased std of the group {1, 0}
    assert group[:2].tolist() == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4)])
    assert group[2:4].tolist() == [0.0, 0.0]  # zero-variance group: no signal
    assert group[4:].tolist() == pytest.approx([1.0 / (math.sqrt(2) + 1e-4), -1.0 / (math.sqrt(2) + 1e-4)])
    assert group_advantages(rewards, 2, "none").tolist() == [0.5, -0.5, 0.0, 0.0, 1.0, -1.0]
    batch_std = rewards.std().item()
    assert group_advantages(rewards, 2, "batch")[4].item() == pytest.approx(1.0 / (batch_std + 1e-4))
    with pytest.raises(ValueError, match="unknown reward scaling"):
        group_advantages(rewards, 2, "rank")


def test_kl_k3_is_zero_at_the_reference_and_positive_elsewhere():
    logps = torch.tensor([-1.0, -2.0, -0.5])
    assert kl_k3(logps, logps).tolist() == [0.0, 0.0, 0.0]
    assert (kl_k3(logps, logps + torch.tensor([0.3, -0.3, 1.0])) > 0).all()


def test_a_nan_reward_is_left_out_of_its_group_and_gets_no_advantage():
    rewards = torch.tensor([1.0, float("nan"), 0.0, 0.5, 0.5, 0.5])
    advantages = group_advantages(rewards, 3, "group")
    std = math.sqrt(0.5)  # unbiased std of {1, 0}: the NaN is not a 0
    assert advantages[:3].tolist() == pytest.approx([0.5 / (std + 1e-4), 0.0, -0.5 / (std + 1e-4)])
    assert advantages[3:].tolist() == [0.0, 0.0, 0.0]
    assert not advantages.isnan().any()
    assert group_advantages(rewards, 3, "none").tolist()[:3] == [0.5, 0.0, -0.5]
