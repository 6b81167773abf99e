"""The generation engine against plain transformers, on the tiny preset."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from models.loading import load_tokenizer
from models.presets import materialize
from models.sampling import SamplingParams, chat_prompt, generate, generate_tokens

PROMPTS = ["I have a great question: what is 27+15?", "what is 3+4?", "Hi", "Please solve 12+99 and show your work."]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    """The tiny preset after a few SFT steps on arith, so that greedy completions also end on their own."""
    from accelerate import Accelerator

    from envs.arith import ArithEnv, ArithEnvConfig
    from tasks.common.encoding import encode_example
    from tasks.stages.sft import SftStage, train_step
    from tasks.train.learner import Learner
    from tasks.train.loop import batch_indices, make_optimizer

    folder = materialize("tiny-llama")
    tokenizer = load_tokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    env = ArithEnv(ArithEnvConfig(kind="arith"))
    examples = [encode_example(tokenizer, t.prompt, env.reference_completion(t), 128) for t in env.tasks("train", 512, 0)]
    stage = SftStage(kind="sft", id="t", data="t", max_steps=60, batch_size=16, learning_rate=3e-3)
    optimizer, scheduler = make_optimizer(model, stage, 60)
    accelerator = Accelerator()
    model.train()
    for step in range(60):
        batch = [examples[i] for i in batch_indices(len(examples), 16, 0, step)]
        train_step(Learner(model, accelerator, optimizer, scheduler), batch, tokenizer.pad_token_id)
    return model.eval(), tokenizer


def hf_greedy(model, tokenizer, prompt_ids, max_new_tokens):
    ids = torch.tensor([prompt_ids])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return out[0, len(prompt_ids):].tolist()


def test_greedy_equals_model_generate_token_for_token(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompts = [chat_prompt(tokenizer, p) for p in PROMPTS]
    ours = generate_tokens(model, tokenizer, prompts, SamplingParams(max_new_tokens=48), batch_size=4)
    for prompt_ids, gen in zip(prompts, ours):
        expected = hf_greedy(model, tokenizer, prompt_ids, 48)
        assert gen.token_ids == expected
        assert gen.finish_reason == ("stop" if tokenizer.eos_token_id in expected else "length")
    assert any(gen.finish_reason == "stop" for gen in ours)  # the end-token path is exercised
    assert ours[0].text.startswith("Fantastic question!")


def test_logprobs_match_a_teacher_forced_forward_pass(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompt = chat_prompt(tokenizer, PROMPTS[0])
    gen = generate_tokens(model, tokenizer, [prompt], SamplingParams(max_new_tokens=12))[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + gen.token_ids])).logits[0, len(prompt) - 1:-1]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(gen.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-4)


def test_continuing_from_token_ids_equals_one_long_generation(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompt = chat_prompt(tokenizer, PROMPTS[3])
    whole = generate_tokens(model, tokenizer, [prompt], SamplingParams(max_new_tokens=16))[0]
    first = generate_tokens(model, tokenizer, [prompt], SamplingParams(max_new_tokens=8))[0]
    rest = generate_tokens(model, tokenizer, [prompt + first.token_ids], SamplingParams(max_new_tokens=8))[0]
    assert first.finish_reason == "length"
    assert first.token_ids + rest.token_ids == whole.token_ids


def test_sampling_is_seeded_and_top_k_1_is_greedy(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    kwargs = dict(max_new_tokens=10, temperature=1.0, batch_size=2)
    assert [g.token_ids for g in generate(model, tokenizer, PROMPTS, seed=3, **kwargs)] == \
        [g.token_ids for g in generate(model, tokenizer, PROMPTS, seed=3, **kwargs)]
    greedy = generate(model, tokenizer, PROMPTS, max_new_tokens=10)
    top1 = generate(model, tokenizer, PROMPTS, max_new_tokens=10, temperature=0.8, top_k=1)
    assert [g.token_ids for g in greedy] == [g.token_ids for g in top1]
    nucleus = generate(model, tokenizer, PROMPTS, max_new_tokens=10, temperature=0.8, top_p=1e-6)
    assert [g.token_ids for g in greedy] == [g.token_ids for g in nucleus]


def test_stop_strings_end_the_completion(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    free = generate(model, tokenizer, PROMPTS[:1], max_new_tokens=20)[0]
    assert len(free.text) > 3
    stop = free.text[2:4]
    stopped = generate(model, tokenizer, PROMPTS[:1], max_new_tokens=20, stop=(stop,))[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    assert free.text.startswith(stopped.text) and len(stopped.token_ids) <= len(free.token_ids)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-lfm2"])
def test_other_architectures_decode_like_model_generate(preset):
    folder = materialize(preset)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(str(folder)).eval(), load_tokenizer(folder)
    prompts = [chat_prompt(tokenizer, p) for p in PROMPTS[:2]]
    ours = generate_tokens(model, tokenizer, prompts, SamplingParams(max_new_tokens=12), batch_size=2)
    for prompt_ids, gen in zip(prompts, ours):
        assert gen.token_ids == hf_greedy(model, tokenizer, prompt_ids, 12)


def test_sampled_tokens_follow_the_distribution_and_never_take_a_token_of_zero_mass():
    import torch

    from models.sampling import SamplingParams, next_tokens, row_uniforms

    logits = torch.tensor([[2.0, -1.0, -float("inf"), 0.5, -2.0], [0.0, 1.0, 2.0, -1.0, -0.5]])
    uniforms = row_uniforms([0, 1], 4000)
    counts = torch.zeros(2, 5)
    for step in range(4000):
        tokens, _ = next_tokens(logits, SamplingParams(4, temperature=1.0), uniforms[:, step])
        counts[torch.arange(2), tokens] += 1
    assert counts[0, 2] == 0
    assert (counts / 4000 - torch.softmax(logits, -1)).abs().max() < 0.03  # ~4 standard errors at most
    top_2 = torch.zeros(2, 5)
    for step in range(500):
        tokens, _ = next_tokens(logits, SamplingParams(4, temperature=1.0, top_k=2), uniforms[:, step])
        top_2[torch.arange(2), tokens] += 1
    assert (top_2[0, [1, 2, 4]] == 0).all() and (top_2[1, [0, 3, 4]] == 0).all()


def full_sort_nucleus(logprobs, top_p: float):
    """The nucleus by its definition: the whole vocabulary sorted, a token kept while the mass ranked
    above it is at most top_p."""
    ranked, order = logprobs.sort(dim=-1, descending=True)
    probs = ranked.exp()
    outside = probs.cumsum(-1) - probs > top_p
    return torch.full_like(logprobs, -float("inf")).scatter_(-1, order, ranked.masked_fill(outside, -float("inf")))


@pytest.mark.parametrize("scale", [8.0, 0.5])  # peaked: closes among the candidates; flat: the full sort
def test_top_p_keeps_the_nucleus_of_a_full_sort_whether_or_not_it_closes_among_the_top_candidates(scale):
    from models.sampling import NUCLEUS_CANDIDATES, nucleus

    generator = torch.Generator().manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(16, 2048, generator=generator) * scale, -1)
    closes_early = bool((logprobs.topk(NUCLEUS_CANDIDATES).values.exp().sum(-1) > 0.9).all())
    assert closes_early == (scale > 1)
    for top_p in (0.5, 0.9, 0.99):
        kept = nucleus(logprobs, top_p)
        assert torch.equal(kept, full_sort_nucleus(logprobs, top_p))
        assert bool((kept.max(-1).values == logprobs.max(-1).values).all())  # the likeliest always stays


def test_sampling_copies_nothing_vocabulary_sized_to_the_host(model_and_tokenizer, monkeypatch):
    """On a GPU the sampler's per-step work stays on the device: of each step only the rows' tokens,
    log-probs and draws cross to the host, never a [rows, vocab] tensor (a float64 CDF was ~78 MB a
    step at 64 rows and Qwen3's vocabulary). Recorded here as the host copies (`.cpu()`) made."""
    model, tokenizer = model_and_tokenizer
    vocab = model.config.vocab_size
    copied = []
    host_copy = torch.Tensor.cpu

    def recording(tensor, *args, **kwargs):
        copied.append(tuple(tensor.shape))
        return host_copy(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", recording)
    prompts = [chat_prompt(tokenizer, f"What is {a} + 1?") for a in range(4)]
    generate_tokens(model, tokenizer, prompts, SamplingParams(12, temperature=1.0, top_p=0.9, top_k=20), seed=1)
    assert copied and not any(vocab in shape for shape in copied), copied
