"""models/decoding.py: the direct decode path of llama and qwen3 gives transformers' own answers:
greedy output equal to `model.generate` token for token, log-probs equal to a teacher-forced
forward, and rows that do not depend on the batch they share (shared prompts, dropped rows)."""

import pytest
import torch

from models.decoding import Decoder, fast_decoder
from models.sampling import SamplingParams, generate_tokens, left_padded


def preset(name: str):
    from transformers import AutoModelForCausalLM

    from models.loading import load_tokenizer
    from models.presets import materialize

    folder = materialize(name)
    return AutoModelForCausalLM.from_pretrained(str(folder)).eval(), load_tokenizer(folder)


def ragged_prompts(tokenizer) -> list[list[int]]:
    from models.sampling import chat_prompt

    return [chat_prompt(tokenizer, text) for text in ("What is 2 + 2?", "Add 17 and 25, then say why.", "Hi",
                                                       "Subtract 3 from 10 and check the answer twice.")]


def reference_greedy(model, tokenizer, prompts, max_new_tokens: int) -> list[list[int]]:
    ids, mask = left_padded(prompts, tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    rows = out[:, ids.shape[1]:].tolist()
    return [row[:row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row for row in rows]


def teacher_forced_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_greedy_output_equals_model_generate_and_logprobs_a_teacher_forced_pass(name):
    model, tokenizer = preset(name)
    assert isinstance(fast_decoder(model), Decoder)
    prompts = ragged_prompts(tokenizer)
    greedy = generate_tokens(model, tokenizer, prompts, SamplingParams(max_new_tokens=24))
    assert [g.token_ids for g in greedy] == reference_greedy(model, tokenizer, prompts, 24)

    sampled = generate_tokens(model, tokenizer, prompts, SamplingParams(max_new_tokens=24, temperature=0.8), seed=3)
    for prompt, generation in zip(prompts, sampled):
        expected = teacher_forced_logprobs(model, prompt, generation.token_ids, 0.8)
        assert generation.logprobs == pytest.approx(expected, abs=1e-4)


def test_a_row_samples_the_same_alone_or_in_a_group_sharing_its_prompt():
    # one prefill for the group's shared prompt, finished rows dropped from the batch as they end:
    # neither changes what a row samples
    model, tokenizer = preset("tiny-llama")
    prompt = ragged_prompts(tokenizer)[1]
    params = SamplingParams(max_new_tokens=16, temperature=1.5, stop=("e", "o"))  # rows stop at different steps
    group = generate_tokens(model, tokenizer, [prompt] * 6, params, row_seeds=list(range(10, 16)))
    assert len({len(g.token_ids) for g in group}) > 1  # the rows did finish at different steps
    for seed, generation in zip(range(10, 16), group):
        [alone] = generate_tokens(model, tokenizer, [prompt], params, row_seeds=[seed])
        assert alone.token_ids == generation.token_ids and alone.finish_reason == generation.finish_reason
        assert alone.logprobs == pytest.approx(generation.logprobs, abs=1e-5)


def test_a_lora_policy_decodes_through_its_adapters():
    from models.config import LoraConfig, ModelConfig
    from models.loading import add_lora

    model, tokenizer = preset("tiny-qwen3")
    lora = add_lora(model, ModelConfig(base="tiny-qwen3", lora=LoraConfig(r=4))).eval()
    torch.manual_seed(0)
    for name, weight in lora.named_parameters():
        if "lora_B" in name:  # peft starts B at zero (no change); a trained adapter is not
            weight.data.normal_(0, 0.5)
    assert isinstance(fast_decoder(lora), Decoder)
    prompts = ragged_prompts(tokenizer)
    greedy = generate_tokens(lora, tokenizer, prompts, SamplingParams(max_new_tokens=16))
    assert [g.token_ids for g in greedy] == reference_greedy(lora, tokenizer, prompts, 16)
    with lora.disable_adapter():  # the base model's own answer differs: the adapters were used
        assert [g.token_ids for g in generate_tokens(lora, tokenizer, prompts, SamplingParams(max_new_tokens=16))] \
            == reference_greedy(lora, tokenizer, prompts, 16) != [g.token_ids for g in greedy]


def test_other_architectures_adapters_and_training_keep_the_generic_path():
    from models.config import LoraConfig, ModelConfig
    from models.loading import add_lora

    lfm2, _ = preset("tiny-lfm2")
    assert fast_decoder(lfm2) is None
    llama, _ = preset("tiny-llama")
    assert fast_decoder(llama.train()) is None
    lora = add_lora(llama, ModelConfig(base="tiny-llama", lora=LoraConfig(r=4)))
    assert fast_decoder(lora.train()) is None
    lora.peft_config["default"].peft_type = "IA3"
    assert fast_decoder(lora.eval()) is None
    sharded, _ = preset("tiny-qwen3")  # a ZeRO-3 / FSDP shard holds an empty placeholder, not the weight
    sharded.model.layers[1].self_attn.q_proj.weight = torch.nn.Parameter(torch.empty(0))
    assert fast_decoder(sharded.eval()) is None
