"""`posttrain export`: a committed checkpoint as a plain folder others load without posttrain.

The folder is what `save_pretrained` writes (safetensors weights, config, generation_config) with
the tokenizer and its chat template, and a model card (flows/model_card.py). A LoRA checkpoint is
its adapter as trained (adapter_config.json, adapter_model.safetensors: load it with peft over the
base), or with `merge_lora` the base with the adapter merged in (peft's merge_and_unload): full
weights that `AutoModelForCausalLM.from_pretrained` loads alone. It is written into a temporary
folder beside `out` and renamed into place at the end, so `out` is whole or absent.

`push_to_hub` uploads the folder with huggingface_hub's upload API (create_repo, upload_folder)
to HF_ENDPOINT (default the Hub) with the token of HF_TOKEN.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from artifacts.refs import Ref
from artifacts.store import Store
from models.config import ModelConfig
from models.loading import ADAPTER_CONFIG, ADAPTER_WEIGHTS, require_safetensors

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype -> torch's name
ADAPTER_FILES = (ADAPTER_CONFIG, *ADAPTER_WEIGHTS)


class ExportError(ValueError):
    """What cannot be exported as asked; one line naming the option."""


def export_checkpoint(store: Store, ref: Ref, folder: Path, model: ModelConfig, out: Path, merge_lora: bool,
                      dtype: str | None) -> str:
    """Write checkpoint `ref` (its files in `folder`, its spec's `model`) to the new folder `out`;
    returns what the folder holds, in words."""
    from flows.model_card import model_card

    adapter = (folder / ADAPTER_CONFIG).exists()
    if merge_lora and not adapter:
        raise ExportError(f"--merge-lora: {ref} holds full weights, not a LoRA adapter")
    if adapter and not merge_lora and dtype is not None:
        raise ExportError("--dtype: a LoRA adapter is exported as trained; add --merge-lora to export full weights "
                          f"in {dtype}")
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        if adapter and not merge_lora:
            weights = copy_adapter(folder, staging)
        else:
            weights = save_full(folder, model, staging, dtype)
        card = model_card(store, ref, model.base, weights, adapter=adapter and not merge_lora)
        (staging / "README.md").write_text(card)
        if out.exists():  # an empty folder, checked by the caller
            out.rmdir()
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return weights


def copy_adapter(folder: Path, staging: Path) -> str:
    """The adapter and tokenizer files as the stage saved them (peft's own README left out)."""
    require_safetensors(folder, ADAPTER_WEIGHTS)
    for file in sorted(folder.iterdir()):
        if file.is_file() and not file.is_symlink() and file.name != "README.md" and not file.name.endswith(".bin"):
            shutil.copyfile(file, staging / file.name)
    save_tokenizer(folder, staging)
    return "a LoRA adapter over the base model (load it with peft)"


def save_full(folder: Path, model_cfg: ModelConfig, staging: Path, dtype: str | None) -> str:
    """Full weights (a LoRA adapter merged into its base) in `dtype` (None: the spec's), as
    save_pretrained writes them, with a generation_config that stops at the tokenizer's end token."""
    import torch

    from models.loading import load_model, load_tokenizer, torch_dtype

    tokenizer = load_tokenizer(folder)
    model = load_model(folder, model_cfg.model_copy(update={"dtype": "float32"}))  # merged at full precision
    merged = hasattr(model, "merge_and_unload")
    if merged:
        model = model.merge_and_unload()
    name = DTYPES[dtype] if dtype else model_cfg.dtype
    model = model.to(torch_dtype(name))
    model.config.dtype = torch_dtype(name)
    generation = model.generation_config
    if generation.eos_token_id is None:
        generation.eos_token_id = tokenizer.eos_token_id
    if generation.pad_token_id is None:
        generation.pad_token_id = tokenizer.pad_token_id
    with torch.no_grad():
        model.save_pretrained(str(staging))
    save_tokenizer(folder, staging, tokenizer)
    return f"{'the base model with the LoRA adapter merged in' if merged else 'full weights'}, {name}"


def save_tokenizer(folder: Path, staging: Path, tokenizer=None) -> None:
    from models.loading import load_tokenizer

    tokenizer = tokenizer or load_tokenizer(folder)
    if not tokenizer.chat_template:
        raise ExportError(f"ref: the checkpoint's tokenizer has no chat template ({folder})")
    tokenizer.save_pretrained(str(staging))


def push_to_hub(folder: Path, repo: str, message: str) -> str:
    """Upload `folder` to the model repo `repo` (created if missing) at HF_ENDPOINT with HF_TOKEN's
    token; returns the commit's URL. HF_HUB_OFFLINE keeps the rest of posttrain off the network;
    this push was asked for by name, so the flag is lifted for its requests only."""
    from huggingface_hub import HfApi

    token = os.environ.get("HF_TOKEN")
    if not token:
        raise ExportError("--push-to-hub: set HF_TOKEN in the environment (a token with write access)")
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token)
    with online():
        api.create_repo(repo, repo_type="model", exist_ok=True)
        return api.upload_folder(folder_path=str(folder), repo_id=repo, repo_type="model",
                                 commit_message=message).commit_url


@contextlib.contextmanager
def online():
    """huggingface_hub's offline switch (read from HF_HUB_OFFLINE at its import, checked on every
    request) turned off for the requests made inside, then put back."""
    from huggingface_hub import constants

    was = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = False
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = was
