"""Conversational SFT trains on exactly the assistant tokens of the chat template's rendering, tools
reach the template, and a template that rewrites earlier turns is refused in one line."""

import pytest

from models.loading import load_tokenizer, resolve_base
from models.losses import IGNORE_INDEX
from tasks.common.encoding import TemplateError, encode_conversation, encode_row, preference_examples

CONVERSATION = [
    {"role": "system", "content": "You are a calculator."},
    {"role": "user", "content": "What is 12+7?"},
    {"role": "assistant", "content": "12 + 7 = 19. The answer is 19."},
    {"role": "user", "content": "And plus 3?"},
    {"role": "assistant", "content": "19 + 3 = 22. The answer is 22."},
]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_base("tiny-llama"))


def trained_runs(tokenizer, example) -> tuple[list[str], str]:
    """The decoded runs of consecutive trained tokens, and the decoded text of the whole example."""
    runs, current = [], []
    for token, label in zip(example.input_ids, example.labels):
        if label != IGNORE_INDEX:
            assert label == token
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs], tokenizer.decode(example.input_ids)


def test_every_assistant_token_and_nothing_else_is_trained(tokenizer):
    example = encode_conversation(tokenizer, CONVERSATION, 10_000)
    runs, text = trained_runs(tokenizer, example)
    assert text == tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert runs == [turn["content"] + "<|end|>\n" for turn in CONVERSATION if turn["role"] == "assistant"]
    assert example.input_ids == tokenizer(text, add_special_tokens=False)["input_ids"]  # the template's own tokens


def test_a_prompt_completion_row_trains_on_its_completion_only(tokenizer):
    row = {"prompt": '[{"role": "user", "content": "What is 12+7?"}, {"role": "assistant", "content": "Let me see."}, '
                     '{"role": "user", "content": "Go on"}]',
           "completion": '[{"role": "assistant", "content": "It is 19."}]', "conversational": True, "tools": None}
    runs, _ = trained_runs(tokenizer, encode_row(tokenizer, row, 10_000))
    assert runs == ["It is 19.<|end|>\n"]  # the prompt's assistant turn is context, not a target


def test_tools_reach_the_template(tokenizer):
    import json

    row = {"messages": json.dumps(CONVERSATION[1:3]), "tools": json.dumps(TOOLS)}
    example = encode_row(tokenizer, row, 10_000)
    text = tokenizer.decode(example.input_ids)
    assert text.startswith('<|system|>\nTools: [{"type": "function", "function": {"name": "add"')
    assert trained_runs(tokenizer, example)[0] == [CONVERSATION[2]["content"] + "<|end|>\n"]


def test_preference_sides_share_the_masked_prompt(tokenizer):
    row = {"prompt": "What is 12+7?", "chosen": "19", "rejected": "20", "conversational": False}
    chosen, rejected = preference_examples(tokenizer, row, 10_000)
    assert trained_runs(tokenizer, chosen)[0] == ["19<|end|>\n"]
    assert trained_runs(tokenizer, rejected)[0] == ["20<|end|>\n"]


def test_a_template_that_rewrites_earlier_turns_is_refused():
    tokenizer = load_tokenizer(resolve_base("tiny-llama"))
    # like templates that drop past reasoning: an assistant turn renders differently once a later turn exists
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n"
        "{% if m['role'] == 'assistant' and not loop.last %}(earlier answer){% else %}{{ m['content'] }}{% endif %}"
        "<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    tokenizer.name_or_path = "rewriting-model"
    with pytest.raises(TemplateError) as error:
        encode_conversation(tokenizer, CONVERSATION, 10_000)
    assert str(error.value) == ("the chat template of rewriting-model rewrites earlier turns when a later one is "
                                "added, so assistant-only masks cannot come from it; train on prompt_completion "
                                "rows instead")
