"""A LoRA pipeline's checkpoints are adapters: the stages after sft read them. generate reads the
context length from the base model (an adapter folder has no model config), and a reward model
started from a policy's adapter trains that adapter on under its new score head, then loads back
from its own adapter with the same scores. (Both failed on the gpu-check's LoRA pass, run on CPU.)"""

import pytest
import torch


@pytest.fixture(scope="module")
def lora_policy(tmp_path_factory):
    """tiny-llama under a LoRA adapter whose weights are not zero, saved as a checkpoint folder."""
    from models.config import ModelConfig
    from models.loading import load_model, load_tokenizer
    from models.presets import materialize

    torch.manual_seed(0)
    config = ModelConfig(base="tiny-llama", lora={"r": 4, "alpha": 8})
    model = load_model(materialize("tiny-llama"), config, trainable=True)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.add_(0.05 * torch.randn_like(parameter))
    folder = tmp_path_factory.mktemp("lora-policy")
    model.save_pretrained(str(folder))
    load_tokenizer(materialize("tiny-llama")).save_pretrained(str(folder))
    return folder, config


def test_generate_takes_a_lora_policy(lora_policy, tmp_path):
    from artifacts.store import Store
    from envs.arith import ArithEnvConfig
    from tasks.common.context import StageContext
    from tasks.stages.generate import GenerateStage, run

    folder, config = lora_policy
    store = Store(f"file://{tmp_path / 'store'}")
    ctx = StageContext(store=store, pipeline="t", run_id="r", stage_id="gen", cache_key="k", model=config,
                       envs={"arith": ArithEnvConfig(kind="arith")}, workdir=tmp_path / "work",
                       inputs={"sft": str(store.commit("t/sft", "checkpoint", folder, producer={}))})
    stage = GenerateStage(kind="generate", id="gen", policy="sft", env="arith", n=2, samples=2, greedy=0,
                          max_tokens=8, contract={"max_truncated_fraction": 1.0})
    output = run(stage, ctx)["rollouts"]
    assert output.metrics["rows"] == 4 and output.contract.context_length == 512  # tiny-llama's, from the base


def test_a_reward_model_trains_on_from_a_policys_lora_adapter_and_loads_back(lora_policy, tmp_path):
    from peft.utils import load_peft_weights

    from models.loading import load_model, load_tokenizer
    from tasks.rollout.reward_models import reward_examples, scores_in_batches

    folder, config = lora_policy
    reward_model = load_model(folder, config, trainable=True, reward_head=True)
    policy_weights = load_peft_weights(str(folder))
    parameters = dict(reward_model.named_parameters())
    for key, value in policy_weights.items():  # the policy's adapter, carried over as it is
        name = key.replace(".weight", ".default.weight")
        assert torch.equal(parameters[name].detach(), value)
    trainable = [name for name, p in reward_model.named_parameters() if p.requires_grad]
    assert "base_model.model.score.modules_to_save.default.weight" in trainable and any("lora_A" in n for n in trainable)

    saved = tmp_path / "rm"
    reward_model.save_pretrained(str(saved))
    tokenizer = load_tokenizer(folder)
    examples = reward_examples(tokenizer, [("What is 2+2?", "The answer is 4."), ("What is 2+2?", "5")], 64)
    before = scores_in_batches(reward_model, examples, tokenizer.pad_token_id, "cpu")
    after = scores_in_batches(load_model(saved, config, reward_head=True), examples, tokenizer.pad_token_id, "cpu")
    assert after == pytest.approx(before, abs=1e-5)
