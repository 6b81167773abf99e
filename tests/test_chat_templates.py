"""Assistant-only masks under the chat templates of the production models the README names, kept
verbatim in tests/data/chat_templates/ (SOURCES.md says from where): Qwen3 rewrites earlier turns
once a later one follows (it drops the reasoning of answers before the last question and gives the
last answer a think block), LFM2 does not. Multi-turn SFT rows train on exactly the assistant turns
of the conversation as rendered whole; the spec's `model.chat_template_kwargs` reach the template."""

from pathlib import Path

import pytest

from models.config import ModelConfig
from models.loading import load_tokenizer
from models.losses import IGNORE_INDEX
from models.presets import materialize
from models.sampling import chat_prompt
from tasks.common.encoding import encode_conversation, encode_row

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
CONVERSATION = [{"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n5"},
                {"role": "user", "content": "And 4 + 4?"},
                {"role": "assistant", "content": "<think>\nagain\n</think>\n\n8"}]


def tokenizer_with(template: str, model: ModelConfig | None = None):
    tokenizer = load_tokenizer(materialize("tiny-llama"), model)
    tokenizer.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    return tokenizer


def trained_parts(tokenizer, example) -> list[str]:
    """The runs of trained tokens, decoded."""
    parts, run = [], []
    for token, label in zip(example.input_ids, example.labels):
        if label != IGNORE_INDEX:
            run.append(token)
        elif run:
            parts.append(tokenizer.decode(run))
            run = []
    return parts + ([tokenizer.decode(run)] if run else [])


def test_qwen3_multi_turn_trains_on_each_answer_as_the_whole_conversation_shows_it():
    tokenizer = tokenizer_with("qwen3")
    example = encode_conversation(tokenizer, CONVERSATION, 4096)
    text = tokenizer.decode(example.input_ids)
    assert "add them" not in text  # the earlier answer's reasoning is dropped, as Qwen3 renders history
    assert trained_parts(tokenizer, example) == ["5<|im_end|>\n", "<think>\nagain\n</think>\n\n8<|im_end|>\n"]


def test_qwen3_prompt_completion_rows_train_on_the_answer_and_its_think_block():
    tokenizer = tokenizer_with("qwen3")
    row = {"prompt": '[{"role": "user", "content": "Hi"}]', "completion": '[{"role": "assistant", "content": "Hello"}]',
           "conversational": True}
    assert trained_parts(tokenizer, encode_row(tokenizer, row, 4096)) == ["<think>\n\n</think>\n\nHello<|im_end|>\n"]


def test_lfm2_multi_turn_masks_every_answer():
    tokenizer = tokenizer_with("lfm2")
    example = encode_conversation(tokenizer, CONVERSATION, 4096)
    assert trained_parts(tokenizer, example) == ["<think>\nadd them\n</think>\n\n5<|im_end|>\n",
                                                 "<think>\nagain\n</think>\n\n8<|im_end|>\n"]


@pytest.mark.parametrize("thinking, ending", [(True, "<|im_start|>assistant\n"),
                                              (False, "<|im_start|>assistant\n<think>\n\n</think>\n\n")])
def test_chat_template_kwargs_of_the_spec_reach_the_prompt(thinking, ending):
    tokenizer = tokenizer_with("qwen3", ModelConfig(chat_template_kwargs={"enable_thinking": thinking}))
    assert tokenizer.decode(chat_prompt(tokenizer, "What is 2 + 3?")).endswith(ending)
