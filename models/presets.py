"""Tiny models built from a config (no download): saved once as normal HF folders.

`tiny-llama` is the CPU default (`tiny-llama-1k` the same with 1,024 positions, for the
agentic envs' longer episodes); `tiny-qwen3` and `tiny-lfm2` have the architectures of the
production models at toy size. Each preset folder is deterministic (fixed seed), so the
same preset on another machine is the same model.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from artifacts.refs import hash_value

_COMMON = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
PRESETS = {
    "tiny-llama": ("llama", dict(_COMMON, rope_theta=10000.0)),
    # the agentic envs' episodes (tool docs, JSON calls, observations) run to ~650 tokens
    "tiny-llama-1k": ("llama", dict(_COMMON, rope_theta=10000.0, max_position_embeddings=1024)),
    # 4.8M parameters, 1,024 positions: big enough to copy made-up names from a prompt into a command
    "small-llama": ("llama", dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
                                  num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=True,
                                  rope_theta=10000.0)),
    "tiny-qwen3": ("qwen3", dict(_COMMON, head_dim=32)),
    "tiny-lfm2": ("lfm2", dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=512, tie_word_embeddings=True,
                               layer_types=["conv", "full_attention", "conv", "full_attention"])),
}
PRESET_FORMAT = 2  # bump when the tokenizer (corpus, chat template) or the build changes


def cache_root() -> Path:
    return Path(os.environ.get("POSTTRAIN_CACHE", Path.home() / ".cache" / "posttrain"))


def preset_digest(name: str) -> str:
    return hash_value({"preset": name, "config": PRESETS[name], "format": PRESET_FORMAT})[:12]


def materialize(name: str) -> Path:
    """Folder of the preset model (built on first use, then reused)."""
    folder = cache_root() / "presets" / f"{name}-{preset_digest(name)}"
    if (folder / "config.json").exists():
        return folder
    staging = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    _build(name, staging)
    try:
        staging.rename(folder)
    except OSError:  # another process built it first
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _build(name: str, out_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(out_dir)
    model_type, kwargs = PRESETS[name]
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                  **kwargs)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(out_dir))
