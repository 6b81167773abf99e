"""A tokenizer made on this machine: byte-level BPE with one token per digit and a chat template."""

from __future__ import annotations

from pathlib import Path

# OpenAI-style `tools` schemas go in a system block first; an assistant turn's tool calls follow its text as JSON
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\nTools: {{ tools | tojson }}<|end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}{{ message['tool_calls'] | tojson }}{% endif %}"
    "<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<s>", "<|end|>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]

# Plain English the BPE merges are learned from; digits are always single tokens, and every
# byte stays encodable, so any text round-trips.
_CORPUS = """
I have a great question: what is the answer? Fantastic question! Let me unpack this for you.
We have the numbers and the result. The final answer is below. Let me think step by step.
First, we add the ones, then the tens, and carry when the sum is more than nine.
You asked a good question, and here is what we know. The answer is correct.
Please solve the following problem. Show your work, then give the final answer.
Search the documents for the information you need, then answer the question briefly.
Run the command in the terminal and read the output. Write the file, edit the file, read it.
The user wants help with a task. The assistant thinks, calls a tool, and answers.
what is plus minus times equals sum total result number value question answer think
"""


def build_tokenizer(out_dir: Path, vocab_size: int = 512):
    """Train the BPE on the built-in corpus and save a transformers tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    lines = [line for line in _CORPUS.strip().splitlines()] * 20
    bpe.train_from_iterator(lines, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="<|end|>",
                                        pad_token="<pad>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer
