"""models/direct_forward.py: the training forward of llama and qwen3 through plain torch calls gives
the transformers forward's log-probs and gradients, on right-padded rows (SFT, preference) and on
RL's left-padded prompts followed by right-padded completions, with and without LoRA."""

import pytest
import torch

from models.direct_forward import scored_hidden, trainable_directly
from models.losses import IGNORE_INDEX
from models.token_logps import label_logps


def preset(name: str):
    from transformers import AutoModelForCausalLM

    from models.presets import materialize

    return AutoModelForCausalLM.from_pretrained(str(materialize(name))).train()


def right_padded(vocab: int):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (6, 24), generator=generator)
    mask = (torch.arange(24)[None] < torch.tensor([24, 20, 13, 24, 9, 17])[:, None]).long()
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    labels[:, :6] = IGNORE_INDEX  # the prompt
    return ids, mask, labels, None


def prompt_then_completion(vocab: int):
    """As tasks/stages/rl/batch.py lays rows out: left-padded prompts, right-padded completions,
    positions counted over the real tokens."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(5, vocab, (5, 30), generator=generator)
    prompt_lengths, completion_lengths = [10, 4, 7, 10, 1], [20, 11, 3, 16, 20]
    columns = torch.arange(30)
    prompt_mask = columns[None, :10] >= (10 - torch.tensor(prompt_lengths))[:, None]
    completion_mask = columns[None, :20] < torch.tensor(completion_lengths)[:, None]
    mask = torch.cat([prompt_mask, completion_mask], dim=1).long()
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    labels[:, :10] = IGNORE_INDEX
    return ids, mask, labels, (mask.cumsum(-1) - 1).clamp(min=0)


def reference_logps(model, ids, mask, labels, positions):
    """The transformers forward's full logits, log-softmaxed, at the scored positions."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, :-1]
    targets = labels[:, 1:]
    scored = targets != IGNORE_INDEX
    return torch.log_softmax(logits.float(), -1)[scored].gather(-1, targets[scored][:, None])[:, 0]


def with_trained_adapter(model, base: str):
    from models.config import LoraConfig, ModelConfig
    from models.loading import add_lora

    lora = add_lora(model, ModelConfig(base=base, lora=LoraConfig(r=4)))
    torch.manual_seed(0)
    for name, weight in lora.named_parameters():
        if "lora_B" in name:  # peft starts B at zero (no change); a trained adapter is not
            weight.data.normal_(0, 0.5)
    return lora


@pytest.mark.parametrize("name, lora", [("tiny-llama", False), ("tiny-qwen3", False), ("tiny-qwen3", True)])
@pytest.mark.parametrize("rows", [right_padded, prompt_then_completion])
def test_logps_and_gradients_equal_the_transformers_forward(name, lora, rows):
    model = preset(name)
    if lora:
        model = with_trained_adapter(model, name)
    assert trainable_directly(model) is not None
    ids, mask, labels, positions = rows(model.config.vocab_size)
    parameters = [p for p in model.parameters() if p.requires_grad]

    logps, _, scored = label_logps(model, ids, mask, labels, positions)
    expected = reference_logps(model, ids, mask, labels, positions)
    assert logps[scored].tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    ours = torch.autograd.grad(logps.sum(), parameters)
    theirs = torch.autograd.grad(expected.sum(), parameters)
    for mine, reference in zip(ours, theirs):
        assert torch.allclose(mine, reference, atol=1e-4, rtol=1e-4)


def test_other_models_and_rows_take_the_transformers_forward():
    from models.loading import enable_activation_checkpointing

    assert trainable_directly(preset("tiny-lfm2")) is None
    checkpointed = preset("tiny-llama")
    enable_activation_checkpointing(checkpointed)
    assert trainable_directly(checkpointed) is None

    model = preset("tiny-llama")
    ids, mask, labels, _ = right_padded(model.config.vocab_size)
    mask[0, 3] = 0  # a hole in a row: no causal kernel can hide it
    scored = labels[:, 1:] != IGNORE_INDEX
    assert scored_hidden(model, ids, mask, None, scored) is None
    logps, _, scored = label_logps(model, ids, mask, labels)  # still right, through transformers
    assert logps[scored].tolist() == pytest.approx(reference_logps(model, ids, mask, labels, None).tolist(), abs=1e-5)
    padded_target = torch.zeros_like(scored)
    padded_target[1, 21] = True  # predicts a padding token
    assert scored_hidden(model, ids, right_padded(model.config.vocab_size)[1], None, padded_target) is None


def preference_sides(vocab: int):
    """Pairs as the preference stage encodes them: a shared prompt (unscored), then a chosen and a
    rejected completion of different lengths; one pair whose sides differ inside the prompt."""
    from tasks.common.encoding import Example

    generator = torch.Generator().manual_seed(2)

    def tokens(n):
        return torch.randint(5, vocab, (n,), generator=generator).tolist()

    def side(prompt, completion):
        return Example(prompt + completion, [IGNORE_INDEX] * len(prompt) + completion, False)

    chosen, rejected = [], []
    for prompt_length, chosen_length, rejected_length in [(9, 12, 30), (4, 7, 7), (14, 3, 21)]:
        prompt = tokens(prompt_length)
        chosen.append(side(prompt, tokens(chosen_length)))
        rejected.append(side(prompt, tokens(rejected_length)))
    prompt = tokens(6)
    chosen.append(side(prompt, tokens(5)))
    rejected.append(side(prompt[:3] + tokens(3), tokens(8)))  # shares 3 of its 6 prompt tokens
    return chosen, rejected


@pytest.mark.parametrize("name, lora", [("tiny-llama", False), ("tiny-qwen3", True)])
def test_a_pairs_shared_prompt_once_gives_both_sides_whole(name, lora):
    from tasks.stages.preference import bucketed_logps, shared_length, shared_prompt_logps

    model = preset(name)
    if lora:
        model = with_trained_adapter(model, name)
    chosen, rejected = preference_sides(model.config.vocab_size)
    split = [shared_length(c, r) for c, r in zip(chosen, rejected)]
    assert split == [9, 4, 14, 3]
    parameters = [p for p in model.parameters() if p.requires_grad]
    logps, scored, seen = shared_prompt_logps(model, chosen, rejected, split, 0, "cpu")
    whole, whole_scored, whole_seen = bucketed_logps(model, chosen + rejected, 0, "cpu")
    assert seen == whole_seen - sum(split)  # each prompt once
    assert scored.tolist() == whole_scored.tolist()
    assert logps.tolist() == pytest.approx(whole.tolist(), abs=1e-4)
    ours = torch.autograd.grad((logps * torch.arange(1.0, 9.0)).sum(), parameters)
    theirs = torch.autograd.grad((whole * torch.arange(1.0, 9.0)).sum(), parameters)
    for mine, reference in zip(ours, theirs):
        assert torch.allclose(mine, reference, atol=1e-4, rtol=1e-4)


def test_pairs_share_their_prompt_where_that_pads_less():
    from tasks.common.encoding import Example
    from tasks.stages.preference import pair_logps

    model = preset("tiny-llama")
    prompt, answer = list(range(5, 45)), list(range(50, 80))
    alike = [Example(prompt + answer, [IGNORE_INDEX] * 40 + answer, False)] * 4
    assert pair_logps(model, alike, alike, 0, "cpu")[2] == 4 * 40 + 8 * 30  # prompts once
    looping = [Example(prompt + answer * 8, [IGNORE_INDEX] * 40 + answer * 8, False)]
    short = [Example(prompt[:4] + answer, [IGNORE_INDEX] * 4 + answer, False)] * 4
    # one 280-token rejected side would pad four 30-token chosen ones: both sides whole instead
    assert pair_logps(model, short, short[:3] + looping, 0, "cpu")[2] == 4 * 34 + 3 * 34 + 40 + 240


@pytest.mark.parametrize("name, lora", [("tiny-llama", False), ("tiny-qwen3", True)])
def test_an_rl_groups_prompt_once_gives_every_completion_whole(name, lora):
    """RL rows as tasks/stages/rl/batch.py pads them (left-padded prompts, a group's samples
    sharing theirs; right-padded completions): each distinct prompt computed once gives the
    log-probs, entropies and gradients of every row whole, temperature-scaled."""
    from tasks.stages.rl.batch import Row, padded_rows, shared_prompt_logps

    model = preset(name)
    if lora:
        model = with_trained_adapter(model, name)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, model.config.vocab_size, (n,), generator=generator).tolist() for n in (7, 3, 11)]
    rows = [Row(prompts[group], torch.randint(5, model.config.vocab_size, (n,), generator=generator).tolist(),
                [1] * n, 0.0) for group, n in [(0, 9), (0, 2), (1, 14), (1, 5), (1, 1), (2, 6)]]
    prompt, prompt_mask, completion, completion_mask, _ = padded_rows(rows, 0, "cpu")
    parameters = [p for p in model.parameters() if p.requires_grad]

    logps, entropy = shared_prompt_logps(model, prompt, prompt_mask, completion, completion_mask, 0.7, True)
    ids, mask = torch.cat([prompt, completion], 1), torch.cat([prompt_mask, completion_mask], 1)
    labels = torch.cat([torch.full_like(prompt, IGNORE_INDEX), completion.masked_fill(completion_mask == 0,
                                                                                      IGNORE_INDEX)], 1)
    whole, whole_entropy, _ = label_logps(model, ids, mask, labels, (mask.cumsum(-1) - 1).clamp(min=0), 0.7, True)
    start = prompt.size(1) - 1
    assert torch.allclose(logps, whole[:, start:], atol=1e-5)
    assert torch.allclose(entropy, whole_entropy[:, start:], atol=1e-5)
    weights = torch.linspace(0.5, 1.5, logps.numel()).view_as(logps)
    ours = torch.autograd.grad((logps * weights).sum(), parameters)
    theirs = torch.autograd.grad((whole[:, start:] * weights).sum(), parameters)
    for mine, reference in zip(ours, theirs):
        assert torch.allclose(mine, reference, atol=1e-4, rtol=1e-4)


def test_an_rl_groups_gradients_do_not_depend_on_threads():
    """A shared prompt's keys and values reach its completions by a gather whose backward sums the
    completions' gradients; the sum must not race across threads (advanced indexing's CPU backward
    adds with atomics, in an order that varied from run to run and made RL checkpoints differ)."""
    from tasks.stages.rl.batch import Row, padded_rows, shared_prompt_logps

    model = preset("tiny-llama")
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, model.config.vocab_size, (n,), generator=generator).tolist() for n in (40, 36, 44)]
    rows = [Row(prompts[group], torch.randint(5, model.config.vocab_size, (12,), generator=generator).tolist(),
                [1] * 12, 0.0) for group in [0] * 5 + [1] * 6 + [2] * 5]  # a group spans the threads' halves
    prompt, prompt_mask, completion, completion_mask, _ = padded_rows(rows, 0, "cpu")
    parameters = list(model.parameters())

    def gradients():
        logps, _ = shared_prompt_logps(model, prompt, prompt_mask, completion, completion_mask, 1.0, False)
        return torch.autograd.grad(logps.sum(), parameters)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = gradients()
        torch.set_num_threads(2)  # two threads even on a one-core machine: the race needs more than one
        for _ in range(3):
            assert all(torch.equal(a, b) for a, b in zip(gradients(), serial))
    finally:
        torch.set_num_threads(threads)
