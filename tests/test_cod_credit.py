"""Connect the Dots credit assignment by hand: mean-style returns per solve and hint turn, the
per-slot group baseline, and the steppo rows built with `credit: cod`."""

import math
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from models.rl_losses import cod_advantages, cod_returns, cod_slots
from tasks.rollout.episodes import TurnRecord
from tasks.stages.rl import RlStage
from tasks.stages.rl.batch import cod_kinds, training_rows

PACK = ["solve", "hint", "solve", "hint", "solve"]  # S = 3: solve 0, hint 0, solve 1, hint 1, solve 2
# Group of G = 2 rollouts of one pack:
#   A: solves r = 0, 1, 1; hints r^z = 0, −0.5 (a long hint)  → step rewards 0, 0, 1, −.5, 1
#   B: solves r = 1, 0, 1; hints r^z = 0, 0                   → step rewards 1, 0, 0, 0, 1
A = [0.0, 0.0, 1.0, -0.5, 1.0]
B = [1.0, 0.0, 0.0, 0.0, 1.0]
# Returns, R_j = mean(r_j … r_2) and R^z_k = mean(r^z_k, r_{k+1} … r_2):
#   A: R_0 = (0+1+1)/3 = 2/3, R^z_0 = (0+1+1)/3 = 2/3, R_1 = (1+1)/2 = 1, R^z_1 = (−.5+1)/2 = .25, R_2 = 1
#   B: R_0 = (1+0+1)/3 = 2/3, R^z_0 = (0+0+1)/3 = 1/3, R_1 = (0+1)/2 = .5, R^z_1 = (0+1)/2 = .5,  R_2 = 1
RETURNS_A = [2 / 3, 2 / 3, 1.0, 0.25, 1.0]
RETURNS_B = [2 / 3, 1 / 3, 0.5, 0.5, 1.0]
# Slot means over the group: solve 0: 2/3, hint 0: 1/2, solve 1: 3/4, hint 1: 3/8, solve 2: 1, so
#   A − mean: 0, +1/6, +1/4, −1/8, 0   (A's first hint is paid for the tasks that went better after it)
#   B − mean: 0, −1/6, −1/4, +1/8, 0
ADVANTAGES_A = [0.0, 1 / 6, 0.25, -0.125, 0.0]


def test_mean_style_returns_by_hand():
    assert cod_returns(A, PACK) == pytest.approx(RETURNS_A)
    assert cod_returns(B, PACK) == pytest.approx(RETURNS_B)
    assert cod_returns([1.0], ["solve"]) == [1.0]  # a pack of one task
    assert cod_returns([0.0, -0.2], ["solve", "hint"]) == pytest.approx([0.0, -0.2])  # cut after a hint
    assert cod_slots(PACK) == [("solve", 0), ("hint", 0), ("solve", 1), ("hint", 1), ("solve", 2)]
    with pytest.raises(ValueError, match="kind"):
        cod_returns([1.0], ["action"])


def test_advantage_is_the_return_minus_the_mean_of_the_same_slot_over_the_group():
    advantages = cod_advantages([A, B], [PACK, PACK], group_size=2)
    assert advantages[0] == pytest.approx(ADVANTAGES_A)
    assert advantages[1] == pytest.approx([-a for a in ADVANTAGES_A])


def test_std_scaling_when_asked_and_groups_kept_apart():
    # group: the unbiased std of two values is |a − b|/√2; hint 0: (2/3 − 1/3)/√2,
    # A's advantage (1/6)/(std + 1e-4)
    scaled = cod_advantages([A, B], [PACK, PACK], group_size=2, scale="group")
    hint_std = (1 / 3) / math.sqrt(2)
    assert scaled[0][1] == pytest.approx((1 / 6) / (hint_std + 1e-4))
    assert scaled[0][0] == 0.0 and scaled[1][4] == 0.0  # equal returns: no signal, no division blow-up
    # a second pack: C cut after its first hint (no solve 1), D solved everything
    C, D = [1.0, 0.0], [1.0, 0.0, 1.0, 0.0, 1.0]
    both = cod_advantages([A, B, C, D], [PACK, PACK, ["solve", "hint"], PACK], group_size=2)
    assert both[0] == pytest.approx(ADVANTAGES_A)  # the first group is untouched by the second
    # C: R_0 = 1, R^z_0 = 0/1 = 0 (no solve after it); D: R_0 = 1, R^z_0 = (0+1+1)/3 = 2/3: hint-0 mean 1/3;
    # D's later slots have no other rollout: advantage 0
    assert both[2] == pytest.approx([0.0, -1 / 3]) and both[3] == pytest.approx([0.0, 1 / 3, 0.0, 0.0, 0.0])


def test_a_nan_reward_gets_no_advantage_and_stays_out_of_the_baseline():
    nan = float("nan")
    advantages = cod_advantages([[nan], [1.0], [0.0]], [["solve"]] * 3, group_size=3)
    assert advantages == [[0.0], [0.5], [-0.5]]


def scored(rewards, kinds):
    turns = [TurnRecord([1, 2], [7] * (k + 1), [], 0.0, False, kind) for k, kind in enumerate(kinds)]
    return SimpleNamespace(step_rewards=rewards, reward=sum(rewards), trajectory=SimpleNamespace(turns=turns))


def test_steppo_rows_under_cod_credit_and_reward_to_go_for_other_envs_of_a_mix():
    calc = [scored([0.0, 1.0], ["action", "action"]), scored([0.0, 0.0], ["action", "action"])]
    groups = [[scored(A, PACK), scored(B, PACK)], calc]
    rows = training_rows(groups, "steppo", 2, "none", 1.0, False, credit="cod")
    assert [r.advantage for r in rows[:5]] == pytest.approx(ADVANTAGES_A)
    assert [r.advantage for r in rows[5:10]] == pytest.approx([-a for a in ADVANTAGES_A])
    # calc keeps rewards-to-go 1, 1 | 0, 0 against their group mean 1/2
    assert [r.advantage for r in rows[10:]] == pytest.approx([0.5, 0.5, -0.5, -0.5])
    # the default credit, rewards-to-go pooled over every step of the group: A 1.5 1.5 1.5 .5 1, B 2 1 1 1 1,
    # mean 12/10 = 1.2, so A's first step gets .3
    plain = training_rows(groups, "steppo", 2, "none", 1.0, False)
    assert plain[0].advantage == pytest.approx(0.3)


def test_a_cut_action_takes_the_kind_alternation_gives_it():
    def turns(*kinds):
        return [TurnRecord([], [], [], 0.0, kind == "action", kind) for kind in kinds]

    assert cod_kinds(turns("action")) == ["solve"]
    assert cod_kinds(turns("solve", "action")) == ["solve", "hint"]
    assert cod_kinds(turns("solve", "hint", "action")) == ["solve", "hint", "solve"]


def test_cod_credit_needs_steppo_and_defaults_to_no_std():
    base = {"kind": "rl", "id": "rl", "policy": "sft", "envs": {"cod": 1.0}, "steps": 2}
    stage = RlStage(**base, algorithm="steppo", credit="cod")
    assert stage.scale_rewards == "none" and RlStage(**stage.model_dump()).scale_rewards == "none"
    assert RlStage(**base, algorithm="steppo", credit="cod", scale_rewards="group").scale_rewards == "group"
    assert RlStage(**base, algorithm="steppo").scale_rewards == "group"  # reward_to_go unchanged
    with pytest.raises(ValidationError, match="use algorithm: steppo"):
        RlStage(**base, credit="cod")
