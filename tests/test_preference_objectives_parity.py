"""kto, orpo, simpo and cpo losses against TRL's trainers' loss paths (pinned TRL, as
tests/test_preference_parity.py does for the DPO family).

Both sides get the same policy, the same reference (kto) and the same token ids. TRL computes its
loss with its trainer's own loss path (KTOTrainer._compute_loss, ORPOTrainer and CPOTrainer's
compute_loss) on a batch from its own collator; ours with the preference stage's pieces:
`piece_losses` + the NLL term (orpo, cpo), or `mismatched` + `kto_baseline` + `kto_loss` (kto).
"""

import copy

import pytest
import torch
from test_preference_parity import TRL_VERSION, pairs, policy_reference_tokenizer  # noqa: F401 (fixtures)

from models.losses import kto_baseline, kto_loss
from tasks.common.encoding import encode_ids
from tasks.stages.preference.config import PreferenceStage
from tasks.stages.preference.kto import mismatched
from tasks.stages.preference.step import nll_tokens, nll_weight, piece_losses, side_logps

MAX_LEN = 512


def stage(method: str, beta: float, **fields) -> PreferenceStage:
    return PreferenceStage(kind="preference", id="align", policy="sft", data="pairs", method=method, beta=beta,
                           **fields)


def our_pair_loss(preference: PreferenceStage, policy, tokenizer, rows) -> float:
    """The step's loss of the preference stage on one micro-batch: the mean per-pair loss plus the NLL term."""
    chosen = [encode_ids(r["prompt_ids"], r["chosen_ids"], MAX_LEN) for r in rows]
    rejected = [encode_ids(r["prompt_ids"], r["rejected_ids"], MAX_LEN) for r in rows]
    with torch.no_grad():
        losses, _, _, nll_logps, _ = piece_losses(policy, chosen, rejected, None, None, preference,
                                                  tokenizer.pad_token_id, "cpu", one_call=False)
    return (losses.mean() - nll_weight(preference) * nll_logps / nll_tokens(preference, chosen)).item()


def trl_pair_features(rows) -> list[dict]:
    """The tokenized features ORPOTrainer and CPOTrainer's collator pads (their `tokenize_row`'s output)."""
    features = []
    for r in rows:
        feature = {"prompt_input_ids": r["prompt_ids"], "prompt_attention_mask": [1] * len(r["prompt_ids"])}
        for side in ("chosen", "rejected"):
            ids = r["prompt_ids"] + r[f"{side}_ids"]
            feature |= {f"{side}_input_ids": ids, f"{side}_attention_mask": [1] * len(ids),
                        f"{side}_labels": [-100] * len(r["prompt_ids"]) + r[f"{side}_ids"]}
        features.append(feature)
    return features


def trl_pair_loss(trainer_class, config_class, policy, tokenizer, rows, tmp_path, **config) -> float:
    import trl
    from datasets import Dataset

    assert trl.__version__ == TRL_VERSION
    args = config_class(output_dir=str(tmp_path), max_length=MAX_LEN, report_to=[], bf16=False, use_cpu=True,
                        **config)
    text = [{"prompt": "q", "chosen": "a", "rejected": "b"}]
    trainer = trainer_class(model=policy, args=args, train_dataset=Dataset.from_list(text), processing_class=tokenizer)
    inputs = trainer.data_collator(trl_pair_features(rows))
    with torch.no_grad():
        return trainer.compute_loss(trainer.model, inputs).item()


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_orpo_loss_matches_trl(beta, policy_reference_tokenizer, pairs, tmp_path):  # noqa: F811
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    policy, _, tokenizer = policy_reference_tokenizer
    theirs = trl_pair_loss(ORPOTrainer, ORPOConfig, copy.deepcopy(policy), tokenizer, pairs, tmp_path, beta=beta)
    ours = our_pair_loss(stage("orpo", beta), policy, tokenizer, pairs)
    assert abs(theirs) > 1e-3
    assert ours == pytest.approx(theirs, abs=1e-5)


@pytest.mark.parametrize("beta,gamma", [(0.5, 0.5), (2.0, 1.0)])
def test_simpo_loss_matches_trl_cpo_simpo_without_nll(beta, gamma, policy_reference_tokenizer, pairs,  # noqa: F811
                                                      tmp_path):
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    policy, _, tokenizer = policy_reference_tokenizer
    theirs = trl_pair_loss(CPOTrainer, CPOConfig, copy.deepcopy(policy), tokenizer, pairs, tmp_path, beta=beta,
                           loss_type="simpo", simpo_gamma=gamma, cpo_alpha=0.0)
    ours = our_pair_loss(stage("simpo", beta, simpo_gamma=gamma), policy, tokenizer, pairs)
    assert abs(theirs) > 1e-3
    assert ours == pytest.approx(theirs, abs=1e-5)


@pytest.mark.parametrize("beta,alpha", [(0.1, 1.0), (0.5, 0.0), (0.5, 2.0)])
def test_cpo_loss_matches_trl(beta, alpha, policy_reference_tokenizer, pairs, tmp_path):  # noqa: F811
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    policy, _, tokenizer = policy_reference_tokenizer
    theirs = trl_pair_loss(CPOTrainer, CPOConfig, copy.deepcopy(policy), tokenizer, pairs, tmp_path, beta=beta,
                           loss_type="sigmoid", cpo_alpha=alpha)
    ours = our_pair_loss(stage("cpo", beta, cpo_alpha=alpha), policy, tokenizer, pairs)
    assert abs(theirs) > 1e-3
    assert ours == pytest.approx(theirs, abs=1e-5)


@pytest.fixture(scope="module")
def kto_rows(pairs):  # noqa: F811
    """The pairs as unpaired rows, desirable and undesirable interleaved unevenly (4 and 2)."""
    rows = []
    for i, pair in enumerate(pairs):
        desirable = i % 3 != 2
        rows.append({"prompt_ids": pair["prompt_ids"], "label": desirable,
                     "completion_ids": pair["chosen_ids"] if desirable else pair["rejected_ids"]})
    return rows


@pytest.fixture(scope="module")
def kto_policy(policy_reference_tokenizer, kto_rows):  # noqa: F811
    """The reference after a few steps on the rows' completions: it gives them, and the mismatched
    pairs' completions, more mass than the reference does, so the KL baseline is positive (not clamped)."""
    _, reference, tokenizer = policy_reference_tokenizer
    policy = copy.deepcopy(reference).train()
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    examples = [encode_ids(r["prompt_ids"], r["completion_ids"], MAX_LEN) for r in kto_rows]
    for _ in range(5):
        logps, _, _ = side_logps(policy, examples, tokenizer.pad_token_id, "cpu")
        (-logps.mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return policy.eval()


def trl_kto(policy, reference, tokenizer, rows, tmp_path, **config) -> tuple[float, float, dict]:
    """TRL's loss and KL of the batch, and its collated batch."""
    import trl
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    assert trl.__version__ == TRL_VERSION
    args = KTOConfig(output_dir=str(tmp_path), max_length=None, report_to=[], bf16=False, use_cpu=True,
                     precompute_ref_log_probs=False, per_device_train_batch_size=len(rows), **config)
    text = [{"prompt": "q", "completion": "a", "label": True}, {"prompt": "r", "completion": "b", "label": False}]
    trainer = KTOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(text),
                         processing_class=tokenizer)
    completions = [r["completion_ids"] for r in rows]
    features = [r | {"KL_completion_ids": kl} for r, kl in zip(rows, completions[-1:] + completions[:-1])]
    inputs = trainer.data_collator(features)
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False).item()
    return loss, trainer._metrics["train" if trainer.model.training else "eval"]["kl"][-1], inputs


def our_kto(policy, reference, tokenizer, rows, beta: float, desirable_weight: float, undesirable_weight: float):
    """The kto stage's loss and KL baseline of one batch (kto_step's arithmetic, without the optimizer)."""
    pad = tokenizer.pad_token_id
    examples = [encode_ids(r["prompt_ids"], r["completion_ids"], MAX_LEN) for r in rows]
    kl_examples = mismatched(examples, list(range(len(rows))), MAX_LEN)
    with torch.no_grad():
        kl_logps, _, _ = side_logps(policy, kl_examples, pad, "cpu")
        ref_kl_logps, _, _ = side_logps(reference, kl_examples, pad, "cpu")
        kl = kto_baseline((kl_logps - ref_kl_logps).sum().item(), len(rows))
        logps, _, _ = side_logps(policy, examples, pad, "cpu")
        ref_logps, _, _ = side_logps(reference, examples, pad, "cpu")
        losses, _ = kto_loss(beta, logps, ref_logps, torch.tensor([r["label"] for r in rows]), kl, desirable_weight,
                             undesirable_weight)
    return losses.mean().item(), kl, kl_examples


@pytest.mark.parametrize("beta,desirable_weight,undesirable_weight", [(0.1, 1.0, 1.0), (0.5, 1.0, 1.5),
                                                                       (0.3, 0.7, 1.0)])
def test_kto_loss_and_kl_baseline_match_trl(beta, desirable_weight, undesirable_weight,
                                            policy_reference_tokenizer, kto_policy, kto_rows, tmp_path):  # noqa: F811
    _, reference, tokenizer = policy_reference_tokenizer
    theirs, their_kl, inputs = trl_kto(copy.deepcopy(kto_policy), reference, tokenizer, kto_rows, tmp_path,
                                       beta=beta, desirable_weight=desirable_weight,
                                       undesirable_weight=undesirable_weight)
    ours, our_kl, kl_examples = our_kto(kto_policy, reference, tokenizer, kto_rows, beta, desirable_weight,
                                        undesirable_weight)
    # the mismatched pairs are TRL's: each prompt with the previous row's completion
    widths = inputs["KL_attention_mask"].sum(-1).tolist()
    assert [e.input_ids for e in kl_examples] == [ids[:n] for ids, n in zip(inputs["KL_input_ids"].tolist(), widths)]
    assert their_kl > 1e-3  # a positive baseline: the clamp at 0 does not hide it
    assert our_kl == pytest.approx(their_kl, abs=1e-5)
    assert abs(theirs) > 1e-3
    assert ours == pytest.approx(theirs, abs=1e-5)


def test_kto_baseline_is_clamped_at_zero():
    assert kto_baseline(-3.0, 4) == 0.0 and kto_baseline(2.0, 4) == 0.5
