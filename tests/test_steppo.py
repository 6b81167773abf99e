"""StepPO on a hand-computed 3-step trajectory: rewards-to-go, group-normalized step
advantages, the per-step sequence ratio clipped once per step, and the rows it trains on."""

import math

import pytest
import torch

from models.rl_losses import grpo_loss, rewards_to_go, step_advantages


def test_rewards_to_go_discount_later_rewards():
    assert rewards_to_go([0.0, 0.5, 1.0], gamma=0.5) == [0.5, 1.0, 1.0]  # 0 + .5(.5 + .5·1), .5 + .5·1, 1
    assert rewards_to_go([0.0, 0.5, 1.0], gamma=1.0) == [1.5, 1.5, 1.0]


def test_step_advantages_normalize_rewards_to_go_over_the_steps_of_the_group():
    # group of 2: a 3-step trajectory with returns [.5, 1, 1] and a 3-step one that earned nothing
    advantages = step_advantages([[0.0, 0.5, 1.0], [0.0, 0.0, 0.0]], group_size=2, gamma=0.5)
    # by hand: values .5 1 1 0 0 0, mean 2.5/6 = .416667, unbiased var (.006944 + 2·.340278 + 3·.173611)/5
    mean, std = 2.5 / 6, math.sqrt((0.0069444 + 2 * 0.3402778 + 3 * 0.1736111) / 5)
    assert std == pytest.approx(0.491596, abs=1e-5)
    expected = [[(0.5 - mean) / (std + 1e-4), (1 - mean) / (std + 1e-4), (1 - mean) / (std + 1e-4)],
                [-mean / (std + 1e-4)] * 3]
    for got, want in zip(advantages, expected):
        assert got == pytest.approx(want, abs=1e-5)
    assert advantages[0] == pytest.approx([0.16948, 1.18630, 1.18630], abs=1e-4)


def test_step_advantages_across_groups_nan_and_no_scaling():
    advantages = step_advantages([[1.0], [0.0, 0.0], [float("nan")], [2.0]], group_size=2, scale="none")
    assert advantages[0] == pytest.approx([2 / 3]) and advantages[1] == pytest.approx([-1 / 3, -1 / 3])
    assert advantages[2] == [0.0] and advantages[3] == [0.0]  # NaN left out; alone in its group


def test_the_per_step_ratio_is_one_sequence_ratio_clipped_once_per_step():
    # two steps (rows) of one trajectory, both with advantage 1
    logps = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -2.3], [-1.5, -2.5]])
    mask = torch.ones(2, 2)
    loss, clipped = grpo_loss(logps, old, torch.tensor([1.0, 1.0]), mask, epsilon_low=0.2, epsilon_high=0.28,
                              aggregation="grpo", ratio_level="sequence")
    # step 1: s = exp((.1 + .3)/2) = 1.2214 inside the clip range; step 2: s = exp(.5) = 1.6487 → 1.28
    assert loss.item() == pytest.approx(-(math.exp(0.2) + 1.28) / 2, abs=1e-6)
    assert clipped.item() == pytest.approx(0.5)
    loss.backward()
    # the unclipped step's gradient is shared evenly by its tokens (d s / d logp_t = s / n); the clipped one has none
    assert logps.grad[0].tolist() == pytest.approx([-math.exp(0.2) / 4] * 2, abs=1e-6)
    assert logps.grad[1].tolist() == [0.0, 0.0]
