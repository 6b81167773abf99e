"""Online DPO (preference `mode: online`): the pairs of each step's two completions per prompt, the
config's rules, and the stage on a tiny store, its pairs judged by a reward model and its reference
the input checkpoint (under LoRA: the model with its adapters off)."""

import math
from types import SimpleNamespace

import pytest
import torch

from tasks.common.pairs import PairStats
from tasks.stages.preference import PreferenceStage
from tasks.stages.preference.online import episode_pairs


def test_online_dpo_pairs_each_prompts_two_completions_by_reward_ties_and_nans_dropped():
    episodes = [SimpleNamespace(name=name) for name in "abcdefgh"]
    stats = PairStats()
    pairs = episode_pairs(episodes, [0.2, 0.9, 1.0, 0.0, 0.5, 0.5, math.nan, 1.0], stats)
    assert [(c.name, r.name, cr, rr) for c, r, cr, rr in pairs] == [("b", "a", 0.9, 0.2), ("c", "d", 1.0, 0.0)]
    assert (stats.prompts, stats.pairs, stats.dropped_tied, stats.dropped_unscored) == (4, 2, 1, 1)


def preference(**fields) -> PreferenceStage:
    return PreferenceStage(**{"kind": "preference", "id": "odpo", "policy": "sft", **fields})


def test_online_dpo_and_offline_preference_each_take_their_own_inputs():
    assert preference(mode="online", envs={"sums": 1.0}, max_steps=3).datasets() == []
    assert preference(data="onpolicy").mode == "offline"
    with pytest.raises(ValueError, match="mode: online samples its pairs from `envs`"):
        preference(mode="online", data="onpolicy", max_steps=3)
    with pytest.raises(ValueError, match="mode: online needs max_steps"):
        preference(mode="online", envs={"sums": 1.0})
    with pytest.raises(ValueError, match="mode: offline trains on the pairs of `data`"):
        preference(envs={"sums": 1.0})


def test_online_dpo_trains_on_pairs_a_reward_model_picks_against_the_adapter_free_reference(tmp_path):
    from test_learned_rewards import reward_model_folder

    from artifacts.store import Store
    from envs.dataset import DatasetEnvConfig
    from models.config import ModelConfig
    from models.loading import load_model
    from models.presets import materialize
    from tasks.common.context import StageContext
    from tasks.common.datasets import read_rows, write_rows
    from tasks.common.encoding import encode_ids
    from tasks.stages.preference import run, side_logps

    store = Store(f"file://{tmp_path / 'store'}")
    folder = materialize("tiny-llama")
    write_rows([{"id": str(i), "prompt": f"What is {i % 9}+{i % 7}?", "answer": str(i % 9 + i % 7)}
                for i in range(40)], tmp_path / "prompts")
    inputs = {"rm": str(store.commit("t/rm", "reward_model", reward_model_folder(), producer={})),
              "prompts": str(store.commit("t/prompts", "dataset", tmp_path / "prompts", producer={})),
              "sft": str(store.commit("t/sft", "checkpoint", folder, producer={}))}
    env = DatasetEnvConfig(kind="dataset", data="prompts", rewards=[
        {"function": "posttrain.rewards:answer_format", "weight": 0.0}, {"reward_model": "rm"}])
    ctx = StageContext(store=store, pipeline="t", run_id="r", stage_id="odpo", cache_key="k",
                       model=ModelConfig(base="tiny-llama", lora={"r": 4, "alpha": 8}), envs={"sums": env},
                       inputs=inputs, workdir=tmp_path / "work")
    stage = preference(mode="online", envs={"sums": 1.0}, max_steps=2, batch_size=4, max_tokens=12,
                       learning_rate=1e-3, warmup_steps=0)
    outputs = run(stage, ctx)

    checkpoint = outputs["checkpoint"]
    assert (checkpoint.local_dir / "adapter_config.json").exists()
    assert checkpoint.metrics["mode"] == "online" and checkpoint.metrics["pairs"] == 8  # the head's scores never tie
    pairs = read_rows(outputs["pairs"].local_dir)
    assert len(pairs) == 8 and all(p["chosen_score"] > p["rejected_score"] for p in pairs)
    assert sorted({p["step"] for p in pairs}) == [0, 1]
    # the reference is the input checkpoint: its log-prob of a pair's chosen side, recomputed here
    base = load_model(folder, ModelConfig()).eval()
    pair = pairs[-1]
    from models.loading import load_tokenizer
    from models.sampling import chat_prompt

    tokenizer = load_tokenizer(folder)
    example = encode_ids(chat_prompt(tokenizer, pair["prompt"]), list(pair["chosen_tokens"]), stage.max_seq_len)
    with torch.no_grad():
        logp, _, _ = side_logps(base, [example], tokenizer.pad_token_id, "cpu")
    assert logp.item() == pytest.approx(pair["ref_chosen_logp"], abs=1e-4)


TRL_VERSION = "1.16.0"


def test_online_dpo_loss_matches_trls_online_dpo_trainer(tmp_path):
    """The same two completions per prompt and the same rewards: TRL's OnlineDPOTrainer (its
    generation replaced by these completions, the one thing it samples) and ours pick the same
    pairs and give the same loss."""
    import copy

    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    from models.loading import load_tokenizer
    from models.losses import preference_loss
    from models.presets import materialize
    from tasks.common.encoding import encode_ids
    from tasks.stages.preference import side_logps

    assert trl.__version__ == TRL_VERSION
    torch.manual_seed(0)
    folder = materialize("tiny-llama")
    tokenizer = load_tokenizer(folder)
    reference = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    policy = copy.deepcopy(reference)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    prompts = [[5, 6, 7], [8, 9, 10]]  # one length: no prompt padding to place
    completions = [[20, 21, 22, 2], [30, 31, 2], [40, 41, 2], [50, 51, 52, 53, 2]]  # sample 1 of each, then sample 2
    rewards = [0.2, 0.9, 0.7, 0.1]  # prompt 0: its second completion wins; prompt 1: its first
    width = max(map(len, completions))
    completion_ids = torch.full((4, width), tokenizer.pad_token_id)
    completion_mask = torch.zeros((4, width), dtype=torch.long)
    for row, ids in enumerate(completions):
        completion_ids[row, :len(ids)], completion_mask[row, :len(ids)] = torch.tensor(ids), 1
    prompt_ids = torch.tensor(prompts * 2)

    args = OnlineDPOConfig(output_dir=str(tmp_path), beta=[0.1], loss_type="sigmoid", report_to=[], use_cpu=True,
                           bf16=False, per_device_train_batch_size=2)
    trainer = OnlineDPOTrainer(model=policy, ref_model=reference, args=args, processing_class=tokenizer,
                               reward_funcs=lambda completions, **_: list(rewards),
                               train_dataset=Dataset.from_list([{"prompt": "a"}, {"prompt": "b"}]))
    trainer._generate = lambda model, prompts, images=None: (prompt_ids, torch.ones_like(prompt_ids), completion_ids,
                                                             completion_mask, None)
    theirs = trainer.training_step(policy, {"prompt": ["a", "b"]}).item()

    from tasks.common.pairs import PairStats
    from tasks.stages.preference.online import episode_pairs

    episodes = [SimpleNamespace(prompt=prompts[i % 2], ids=completions[i]) for i in (0, 2, 1, 3)]  # prompt by prompt
    pairs = episode_pairs(episodes, [rewards[i] for i in (0, 2, 1, 3)], PairStats())
    sides = [[encode_ids(e.prompt, e.ids, 64) for e in side] for side in ([c for c, *_ in pairs], [r for _, r, *_ in pairs])]
    with torch.no_grad():
        (chosen, chosen_n, _), (rejected, rejected_n, _) = [side_logps(policy, s, tokenizer.pad_token_id, "cpu") for s in sides]
        (ref_chosen, _, _), (ref_rejected, _, _) = [side_logps(reference, s, tokenizer.pad_token_id, "cpu") for s in sides]
        losses, _, _ = preference_loss("dpo", 0.1, chosen, rejected, ref_chosen, ref_rejected, chosen_n, rejected_n)
    assert losses.mean().item() == pytest.approx(theirs, rel=1e-5)
