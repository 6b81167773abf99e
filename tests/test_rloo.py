"""RLOO as rl's advantage estimator (`advantage: rloo`): the leave-one-out formula by hand, the
advantages TRL's RLOOTrainer computes for the same rewards (pinned TRL), and the config's rules."""

import pytest
import torch

from models.rl_losses import rloo_advantages
from tasks.stages.rl.config import RlStage

TRL_VERSION = "1.16.0"
# two groups of 4; a reward function answered None (unscorable) for one completion
REWARDS = [1.0, 0.0, 0.5, None, 0.2, 0.2, 0.9, 0.1]


def as_tensor(rewards):
    return torch.tensor([float("nan") if r is None else r for r in rewards])


def test_rloo_baseline_is_the_mean_of_the_other_completions():
    advantages = rloo_advantages(as_tensor(REWARDS), 4).tolist()
    # group 1: three finite rewards, each baseline the mean of the two others; the NaN one gets 0
    assert advantages[:4] == pytest.approx([1.0 - 0.25, 0.0 - 0.75, 0.5 - 0.5, 0.0])
    assert advantages[4:] == pytest.approx([0.2 - 1.2 / 3, 0.2 - 1.2 / 3, 0.9 - 0.5 / 3, 0.1 - 1.3 / 3])
    lone = rloo_advantages(torch.tensor([1.0, float("nan")]), 2)  # one finite reward: no baseline, no signal
    assert lone.tolist() == [0.0, 0.0]


def trl_advantages(tmp_path, normalize: bool) -> list[float]:
    """RLOOTrainer's advantages for REWARDS, from its own generate-and-score step."""
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import RLOOConfig, RLOOTrainer

    from models.loading import load_tokenizer
    from models.presets import materialize

    assert trl.__version__ == TRL_VERSION
    folder = materialize("tiny-llama")
    args = RLOOConfig(output_dir=str(tmp_path), num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=4, report_to=[], use_cpu=True, bf16=False, normalize_advantages=normalize)
    trainer = RLOOTrainer(model=AutoModelForCausalLM.from_pretrained(str(folder)), args=args,
                          reward_funcs=lambda completions, **_: list(REWARDS), processing_class=load_tokenizer(folder),
                          train_dataset=Dataset.from_list([{"prompt": "q"}, {"prompt": "r"}]))
    return trainer._generate_and_score_completions([{"prompt": "q"}] * 4 + [{"prompt": "r"}] * 4)["advantages"].tolist()


@pytest.mark.parametrize("normalize, scale", [(False, "none"), (True, "batch")])
def test_rloo_advantages_match_trls_rloo_trainer(tmp_path, normalize, scale):
    assert rloo_advantages(as_tensor(REWARDS), 4, scale).tolist() == pytest.approx(trl_advantages(tmp_path, normalize),
                                                                                    abs=1e-6)


def rl_stage(**fields) -> RlStage:
    return RlStage(**{"kind": "rl", "id": "rl", "policy": "align", "envs": {"arith": 1.0}, "steps": 2, **fields})


def test_rloo_config_takes_trls_defaults_and_refuses_what_it_cannot_mean():
    assert rl_stage(advantage="rloo").scale_rewards == "none"  # TRL's RLOO: no normalization unless asked
    assert rl_stage(advantage="rloo", scale_rewards="batch").scale_rewards == "batch"
    assert rl_stage().scale_rewards == "group"  # grpo keeps its default
    with pytest.raises(ValueError, match="advantage: rloo gives one advantage per trajectory; use algorithm: grpo"):
        rl_stage(advantage="rloo", algorithm="steppo")
    with pytest.raises(ValueError, match="scale_rewards: group divides by each group's std"):
        rl_stage(advantage="rloo", scale_rewards="group")


def test_rloo_rows_carry_leave_one_out_advantages():
    """training_rows under `advantage: rloo`: each trajectory's row holds its leave-one-out advantage."""
    from tasks.rollout.episodes import Trajectory, TurnRecord
    from tasks.stages.rl.batch import training_rows
    from tasks.stages.rl.scoring import Scored

    def scored(reward: float) -> Scored:
        turn = TurnRecord(context_ids=[1, 2], action_ids=[5, 6], observation_ids=[], reward=0.0, truncated=False)
        trajectory = Trajectory(env_id="e", task=None, prompt_ids=[1, 2], turns=[turn], finished=True)
        return Scored(trajectory, [reward], False, False, 0.0, 0.0, True)

    rows = training_rows([[scored(r) for r in (1.0, 0.0, 0.0, 0.0)]], "grpo", 4, "none", 1.0, False,
                         advantage="rloo")
    assert [row.advantage for row in rows] == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
