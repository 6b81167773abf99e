"""Memory that scales: a step in micro-batches equals the whole-batch step (loss and update), logits
in chunks equal the full logits, activation checkpointing changes no gradient, bf16 autocast runs
on the CPU and fp16 is refused there."""

import copy

import pytest
import torch

from models.loading import enable_activation_checkpointing, load_tokenizer
from models.presets import materialize
from models.rl_losses import grpo_loss, loss_denominator
from tasks.common.encoding import Example, collate
from tasks.stages.rl.batch import Row, completion_logps, padded_rows
from tasks.train.learner import Learner


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    folder = materialize("tiny-llama")
    return AutoModelForCausalLM.from_pretrained(str(folder)), load_tokenizer(folder)


def ragged_examples(seed: int, n: int = 6) -> list[Example]:
    """Rows of different lengths, prompt (-100) then completion tokens."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for i in range(n):
        prompt = torch.randint(5, 200, (2 + i % 3,), generator=generator).tolist()
        completion = torch.randint(5, 200, (1 + (3 * i) % 7,), generator=generator).tolist()
        examples.append(Example(prompt + completion, [-100] * len(prompt) + completion, False))
    return examples


def sgd_learner(model, micro_batch_size):
    """SGD with lr 1: the update is the (clipped) gradient itself, so equal updates mean equal gradients."""
    from accelerate import Accelerator

    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return Learner(model, Accelerator(cpu=True), optimizer, scheduler, micro_batch_size)


def assert_same_weights(a, b, tolerance=2e-6):
    worst = max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
    assert worst < tolerance, worst


def test_sft_step_in_micro_batches_equals_the_whole_batch(tiny):
    from tasks.stages.sft import train_step

    model, tokenizer = tiny
    batch = ragged_examples(1)
    results = {}
    for micro in (None, 2, 1):
        trained = copy.deepcopy(model).train()
        loss, tokens = train_step(sgd_learner(trained, micro), batch, tokenizer.pad_token_id)
        results[micro] = (loss, tokens, trained)
    for micro in (2, 1):
        assert results[micro][1] == results[None][1]  # the same non-pad tokens
        assert results[micro][0] == pytest.approx(results[None][0], abs=1e-5)
        assert_same_weights(results[micro][2], results[None][2])
    assert_differs(results[None][2], model)


def assert_differs(trained, original):
    assert max((p - q).abs().max().item() for p, q in zip(trained.parameters(), original.parameters())) > 1e-4


@pytest.mark.parametrize("method", ["dpo", "ipo"])
def test_preference_step_in_micro_batches_equals_the_whole_batch(tiny, method):
    from tasks.stages.preference import PreferenceStage, train_step

    model, tokenizer = tiny
    chosen, rejected = ragged_examples(2, 5), ragged_examples(3, 5)
    ref_chosen, ref_rejected = -torch.rand(5) * 20, -torch.rand(5) * 20
    stage = PreferenceStage(kind="preference", id="p", policy="s", data="g", method=method)
    results = {}
    for micro in (None, 2):
        trained = copy.deepcopy(model).train()
        metrics, _ = train_step(sgd_learner(trained, micro), chosen, rejected, ref_chosen, ref_rejected, stage,
                                tokenizer.pad_token_id)
        results[micro] = (metrics, trained)
    for key in ("loss", "reward_accuracy", "reward_margin"):
        assert results[2][0][key] == pytest.approx(results[None][0][key], abs=1e-5)
    assert_same_weights(results[2][1], results[None][1])
    assert_differs(results[None][1], model)


@pytest.mark.parametrize("aggregation", ["grpo", "dr_grpo", "dapo"])
def test_rl_loss_over_micro_batches_sums_to_the_whole_batch(tiny, aggregation):
    """Rows of ragged prompts and completions, some tokens masked: the whole batch's grpo_loss and
    gradient against the sum over micro-batches of 2, each divided by the step's denominator."""
    model, tokenizer = tiny
    generator = torch.Generator().manual_seed(4)
    rows = []
    for i in range(5):
        completion = torch.randint(5, 200, (2 + (5 * i) % 9,), generator=generator).tolist()
        mask = [0 if (i == 2 and t < 2) else 1 for t in range(len(completion))]  # env-written tokens
        rows.append(Row(torch.randint(5, 200, (1 + i % 4,), generator=generator).tolist(), completion, mask,
                        float(i) - 2.0))
    longest = max(len(r.completion_ids) for r in rows)

    def loss_of(part, denominator):
        prompt, prompt_mask, completion, completion_mask, loss_mask = padded_rows(part, tokenizer.pad_token_id, "cpu")
        logps, _ = completion_logps(model, prompt, prompt_mask, completion, completion_mask, 1.0)
        old = logps.detach() + 0.1  # ratios off 1, so that clipping binds somewhere
        loss, _ = grpo_loss(logps, old, torch.tensor([r.advantage for r in part]), loss_mask, epsilon_low=0.2,
                            epsilon_high=0.28, aggregation=aggregation, max_completion_length=longest + 3,
                            denominator=denominator)
        return loss

    params = [p for p in model.parameters()]
    whole = loss_of(rows, None)
    whole_grads = torch.autograd.grad(whole, params)
    denominator = loss_denominator(aggregation, [sum(r.mask) for r in rows], longest + 3)
    pieces = sum(loss_of(rows[i:i + 2], denominator) for i in range(0, len(rows), 2))
    piece_grads = torch.autograd.grad(pieces, params)
    assert pieces.item() == pytest.approx(whole.item(), abs=1e-6)
    assert max((a - b).abs().max().item() for a, b in zip(whole_grads, piece_grads)) < 1e-6


def test_logits_in_chunks_equal_the_full_logits(tiny, monkeypatch):
    """Chunks of 3 positions (recomputed in the backward pass) against one full-vocabulary pass:
    log-probs, entropies and gradients."""
    import models.token_logps as token_logps

    model, tokenizer = tiny
    ids, mask, labels = collate(ragged_examples(5), tokenizer.pad_token_id, "cpu")
    targets, scored = labels[:, 1:], labels[:, 1:] != -100
    full = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
    expected = full.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * scored
    expected_entropy = -(full.exp() * full).sum(-1) * scored
    params = list(model.parameters())
    expected_grads = torch.autograd.grad(expected.sum(), params)
    monkeypatch.setattr(token_logps, "CHUNK_BYTES", 3 * 4 * model.config.vocab_size)
    logps, entropy, chunk_scored = token_logps.label_logps(model, ids, mask, labels, with_entropy=True)
    grads = torch.autograd.grad(logps.sum(), params)
    assert torch.equal(chunk_scored, scored) and int(scored.sum()) > 9  # several chunks
    assert (logps - expected).abs().max().item() < 1e-5
    assert (entropy - expected_entropy.detach()).abs().max().item() < 1e-5
    assert max((a - b).abs().max().item() for a, b in zip(grads, expected_grads)) < 1e-5


def test_gradient_checkpointing_changes_no_gradient(tiny):
    from tasks.stages.sft import train_step

    model, tokenizer = tiny
    plain, checkpointed = copy.deepcopy(model).train(), copy.deepcopy(model).train()
    enable_activation_checkpointing(checkpointed)
    batch = ragged_examples(6)
    plain_loss, _ = train_step(sgd_learner(plain, None), batch, tokenizer.pad_token_id)
    checkpointed_loss, _ = train_step(sgd_learner(checkpointed, 2), batch, tokenizer.pad_token_id)
    assert checkpointed_loss == pytest.approx(plain_loss, abs=1e-5)
    assert_same_weights(checkpointed, plain)


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one state per process (a stage's child is a fresh process); a test that
    asks for another mixed precision starts from a clean one and leaves one."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_bf16_autocast_trains_on_the_cpu_and_fp16_is_refused(tiny, fresh_accelerate_state):
    from accelerate.state import AcceleratorState

    from tasks.stages.sft import SftStage, train_step
    from tasks.train.loop import make_accelerator

    model, tokenizer = tiny
    bf16 = SftStage(kind="sft", id="s", data="d", mixed_precision="bf16")
    accelerator = make_accelerator(bf16, "cpu")
    trained = copy.deepcopy(model).train()
    optimizer = torch.optim.SGD(trained.parameters(), lr=1.0)
    learner = Learner(trained, accelerator, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))
    loss, _ = train_step(learner, ragged_examples(7), tokenizer.pad_token_id)
    AcceleratorState._reset_state(reset_partial_state=True)
    fp32_loss, _ = train_step(sgd_learner(copy.deepcopy(model).train(), None), ragged_examples(7),
                              tokenizer.pad_token_id)
    assert loss == pytest.approx(fp32_loss, rel=0.05) and loss != fp32_loss  # computed in bf16
    assert all(p.dtype == torch.float32 for p in trained.parameters())  # autocast over fp32 weights
    with pytest.raises(ValueError, match="mixed_precision: fp16 needs a CUDA device"):
        make_accelerator(SftStage(kind="sft", id="s", data="d", mixed_precision="fp16"), "cpu")


def test_length_buckets_split_stragglers_and_keep_every_row_once():
    from tasks.train.learner import length_buckets

    widths = [(18, 38)] * 40 + [(18, 64)] * 8 + [(30, 38)] * 2
    buckets = length_buckets(widths)
    assert sorted(i for bucket in buckets for i in bucket) == list(range(len(widths)))
    assert len(buckets) == 2 and set(buckets[1]) == set(range(40, 50))  # the long rows ride together
    assert length_buckets([(18, 38)] * 64) == [list(range(64))]  # nothing to gain: one call
    assert all(len(bucket) <= 6 for bucket in length_buckets(widths, max_rows=6))
    assert length_buckets([]) == []
