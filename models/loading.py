"""One loading path for presets, local folders and hub ids (offline where no network)."""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

from artifacts.refs import hash_value
from models.config import ModelConfig
from models.presets import PRESETS, materialize, preset_digest

ADAPTER_CONFIG = "adapter_config.json"
# the only weights loaded: safetensors hold tensors, while a pickle (pytorch_model.bin,
# adapter_model.bin) may run code as it loads, and whoever can write the store can place one
MODEL_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
ADAPTER_WEIGHTS = ("adapter_model.safetensors",)


class PickledWeights(ValueError):
    """A model or adapter folder without safetensors weights (perhaps a pickle only); one line."""


def require_safetensors(folder: Path, names: tuple[str, ...]) -> None:
    """Raise PickledWeights unless `folder` holds one of the safetensors files `names`."""
    if not any((folder / name).is_file() for name in names):
        raise PickledWeights(f"{folder}: no {' or '.join(names)}; weights load only as safetensors, never from a "
                             "pickle such as pytorch_model.bin")


def resolve_base(base: str) -> str:
    """A preset name becomes its local folder; a path or hub id is passed to from_pretrained."""
    if base in PRESETS:
        return str(materialize(base))
    return base


def base_identity(base: str) -> str:
    """Stable identity of a base model for cache keys and manifests."""
    if base in PRESETS:
        return f"preset:{base}@{preset_digest(base)}"
    path = Path(base)
    if path.is_dir():
        stats = sorted((p.name, p.stat().st_size) for p in path.iterdir() if p.is_file())
        return f"path:{path.resolve()}@{hash_value(stats)[:12]}"
    return f"hub:{base}"


def context_length(path_or_id: str) -> int | None:
    """The model's context window (max positions) from its config."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(str(path_or_id)), "max_position_embeddings", None)


def vocab_size(path_or_id) -> int | None:
    """The model's vocabulary size from its config (None for a folder without one: an adapter's)."""
    from transformers import AutoConfig

    try:
        return getattr(AutoConfig.from_pretrained(str(path_or_id)), "vocab_size", None)
    except (OSError, ValueError):
        return None


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_tokenizer(path: str | Path, model_cfg: ModelConfig | None = None):
    """The tokenizer of a model folder; with `model_cfg`, its chat template's arguments
    (`chat_template_kwargs`) go with it to every rendering (models/sampling.py: template_kwargs)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    # transformers keeps HF_HUB_OFFLINE's value among the arguments it saves with the tokenizer:
    # a checkpoint's files, and so its ref, must not depend on the environment it was made in
    tokenizer.init_kwargs.pop("local_files_only", None)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model_cfg is not None and model_cfg.chat_template_kwargs:
        tokenizer.posttrain_template_kwargs = dict(model_cfg.chat_template_kwargs)
    return tokenizer


def load_model(path: str | Path, model_cfg: ModelConfig, *, trainable: bool = False, reward_head: bool = False):
    """Load a base model or a checkpoint folder (full weights or a PEFT adapter). `reward_head`: as
    a reward model, a scalar score head over the same backbone (transformers' sequence
    classification with one label: a causal LM's folder gets a new head, a reward model's keeps
    its own)."""
    path = Path(path) if Path(str(path)).exists() else path
    dtype = torch_dtype(model_cfg.dtype)
    load = functools.partial(pretrained, dtype=dtype, reward_head=reward_head)
    if isinstance(path, Path) and (path / ADAPTER_CONFIG).exists():
        from peft import PeftConfig, PeftModel

        # peft loads adapter_model.safetensors where there is one, else unpickles adapter_model.bin
        require_safetensors(path, ADAPTER_WEIGHTS)
        config = PeftConfig.from_pretrained(str(path))
        if reward_head and config.task_type != "SEQ_CLS":
            return reward_model_on_policy_adapter(path, config, load(resolve_base(model_cfg.base)), trainable)
        return PeftModel.from_pretrained(load(resolve_base(model_cfg.base)), str(path), is_trainable=trainable,
                                         use_safetensors=True)
    model = load(str(path))
    if trainable and model_cfg.lora is not None:
        model = add_lora(model, model_cfg, "SEQ_CLS" if reward_head else "CAUSAL_LM")
    return model


def pretrained(folder: str, dtype, reward_head: bool):
    """A model from a folder or hub id, from safetensors weights only (a local folder without them
    is a PickledWeights): a causal LM, or with `reward_head` a reward model."""
    from transformers import AutoModelForCausalLM

    if Path(folder).is_dir():
        require_safetensors(Path(folder), MODEL_WEIGHTS)
    if reward_head:
        return with_pad_id(new_head_quietly(folder, dtype))
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, use_safetensors=True)


def reward_model_on_policy_adapter(path: Path, config, model, trainable: bool):
    """A reward model that starts from a policy's LoRA adapter: the same adapter weights over the
    base (`model`, with its new score head), trained on as a sequence classifier's adapter, the
    whole head trained and saved beside it."""
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from peft.utils import load_peft_weights

    config.task_type, config.modules_to_save, config.inference_mode = "SEQ_CLS", None, not trainable
    with warnings.catch_warnings():  # peft's SEQ_CLS wrapper reads a property transformers deprecates
        warnings.simplefilter("ignore", FutureWarning)
        model = get_peft_model(model, config)
    # the policy's adapter weights over the new model's own state (its fresh head among them)
    set_peft_model_state_dict(model, {**get_peft_model_state_dict(model), **load_peft_weights(str(path))})
    return model


def new_head_quietly(path: str, dtype):
    """A reward model from a folder: a causal LM's gets a fresh score head, which transformers
    reports as missing weights on every load; that is the intent here, so its report is silenced
    (only for this call)."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype, num_labels=1, use_safetensors=True)
    finally:
        hf_logging.set_verbosity(level)


def with_pad_id(model):
    """A reward model reads its score at the last token that is not padding: its config must
    name the padding id (our tokenizers pad with the end token where they have no pad token)."""
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = model.config.eos_token_id
    return model


def enable_activation_checkpointing(model) -> None:
    """Recompute each layer's activations in the backward pass instead of keeping them
    (transformers' non-reentrant checkpointing: no extra hooks needed for LoRA's frozen inputs)."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def add_lora(model, model_cfg: ModelConfig, task_type: str = "CAUSAL_LM"):
    """LoRA adapters on the spec's target modules; a reward model (`SEQ_CLS`) also trains and
    saves its whole score head (peft's modules_to_save for that task type)."""
    from peft import LoraConfig, get_peft_model

    lora = model_cfg.lora
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), task_type=task_type)
    with warnings.catch_warnings():  # peft's SEQ_CLS wrapper reads a property transformers deprecates
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(model, config)


def stage_device(model_cfg: ModelConfig, gpus: int) -> str:
    """The device every model of a stage sits on: `cuda:<LOCAL_RANK>` when `model.device` is auto,
    the stage holds GPUs and CUDA is present (one process per GPU under accelerate launch; a
    single-GPU stage is rank 0 of the devices it was given); else `cpu`."""
    import torch

    if model_cfg.device == "cpu" or gpus == 0 or not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"


def set_threads(model_cfg: ModelConfig) -> None:
    import torch

    if model_cfg.threads:
        torch.set_num_threads(model_cfg.threads)
