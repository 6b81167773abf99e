"""DPO, length-normalized DPO and IPO losses against TRL's DPOTrainer loss path (pinned TRL).

Both sides get the same policy, the same reference model and the same token ids; TRL computes
its loss with `DPOTrainer._compute_loss` on a batch from its own collator, ours with
`side_logps` + `models.losses.preference_loss` as the preference stage does.
"""

import copy

import pytest
import torch

from envs.arith import ArithEnv, ArithEnvConfig
from models.loading import load_tokenizer
from models.losses import preference_loss
from models.presets import materialize
from models.sampling import chat_prompt
from tasks.common.encoding import encode_ids
from tasks.stages.preference import side_logps

TRL_VERSION = "1.16.0"
OUR_METHOD_FOR_TRL = {"sigmoid": "dpo", "sigmoid_norm": "ln_dpo", "ipo": "ipo"}


@pytest.fixture(scope="module")
def policy_reference_tokenizer():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    folder = materialize("tiny-llama")
    reference = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    policy = copy.deepcopy(reference)
    with torch.no_grad():  # a policy that differs from its reference, so every log-ratio is non-zero
        for parameter in policy.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    return policy, reference, load_tokenizer(folder)


@pytest.fixture(scope="module")
def pairs(policy_reference_tokenizer):
    """Arith prompts; chosen = the oracle's answer, rejected = a wrong, longer, repetitive one."""
    _, _, tokenizer = policy_reference_tokenizer
    env = ArithEnv(ArithEnvConfig(kind="arith"))
    rows = []
    for i, task in enumerate(env.tasks("train", 6, 0)):
        rejected = "We have it. The answer is correct." * (1 + i % 3)
        rows.append({"prompt_ids": chat_prompt(tokenizer, task.prompt),
                     "chosen_ids": tokenizer(env.reference_completion(task))["input_ids"] + [tokenizer.eos_token_id],
                     "rejected_ids": tokenizer(rejected)["input_ids"] + [tokenizer.eos_token_id]})
    return rows


def trl_loss(loss_type: str, beta: float, policy, reference, tokenizer, rows, tmp_path) -> float:
    import trl
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    assert trl.__version__ == TRL_VERSION
    args = DPOConfig(output_dir=str(tmp_path), loss_type=[loss_type], beta=beta, max_length=None, report_to=[],
                     bf16=False, use_cpu=True, precompute_ref_log_probs=False)
    text = [{"prompt": "q", "chosen": "a", "rejected": "b"}]
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(text),
                         processing_class=tokenizer)
    inputs = trainer.data_collator(rows)
    with torch.no_grad():
        return trainer._compute_loss(trainer.model, inputs, return_outputs=False).item()


def our_loss(method: str, beta: float, policy, reference, tokenizer, rows) -> float:
    pad = tokenizer.pad_token_id
    chosen = [encode_ids(r["prompt_ids"], r["chosen_ids"], 512) for r in rows]
    rejected = [encode_ids(r["prompt_ids"], r["rejected_ids"], 512) for r in rows]
    with torch.no_grad():
        chosen_logps, chosen_tokens, _ = side_logps(policy, chosen, pad, "cpu")
        rejected_logps, rejected_tokens, _ = side_logps(policy, rejected, pad, "cpu")
        ref_chosen, _, _ = side_logps(reference, chosen, pad, "cpu")
        ref_rejected, _, _ = side_logps(reference, rejected, pad, "cpu")
        losses, _, _ = preference_loss(method, beta, chosen_logps, rejected_logps, ref_chosen, ref_rejected,
                                       chosen_tokens, rejected_tokens)
    return losses.mean().item()


@pytest.mark.parametrize("loss_type", sorted(OUR_METHOD_FOR_TRL))
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_preference_loss_matches_trl(loss_type, beta, policy_reference_tokenizer, pairs, tmp_path):
    policy, reference, tokenizer = policy_reference_tokenizer
    theirs = trl_loss(loss_type, beta, copy.deepcopy(policy), reference, tokenizer, pairs, tmp_path)
    ours = our_loss(OUR_METHOD_FOR_TRL[loss_type], beta, policy, reference, tokenizer, pairs)
    assert abs(theirs) > 1e-3  # a degenerate batch would agree trivially
    assert ours == pytest.approx(theirs, abs=1e-5)


def test_policy_equal_to_reference_gives_log_two_for_dpo(policy_reference_tokenizer, pairs):
    _, reference, tokenizer = policy_reference_tokenizer
    assert our_loss("dpo", 0.1, reference, reference, tokenizer, pairs) == pytest.approx(0.693147, abs=1e-6)
