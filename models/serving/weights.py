"""Weights `posttrain serve-model` loads at runtime: how a trainer publishes new weights to it
(tasks/rollout/weight_sync.py).

LoRA adapters, over vLLM's endpoints: `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` loads
a PEFT adapter, and requests that name the adapter as their `model` decode with it;
`POST /v1/unload_lora_adapter {"lora_name"}` drops it. Full weights, serve-model's own call (vLLM
has no documented equivalent): `POST /v1/reload_weights {"weights_path", "version"}` copies a saved
checkpoint's tensors into the served model between two batches; answers then carry
`weights_version`. Both load only from the one folder the server was started with
(`--lora-folder`; both are off without it).

A path is hostile input: it must name a folder inside that folder (no `..`, no symlink on the way,
nothing outside), holding safetensors files (never a pickled `.bin`) that fit the served model:
`adapter_config.json` and `adapter_model.safetensors` for an adapter; `model.safetensors` (or its
shards' index) with exactly the served model's tensor names and shapes for full weights.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager, nullcontext
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from models.loading import ADAPTER_CONFIG
from models.serving.limits import ServingError

ADAPTER_WEIGHTS = "adapter_model.safetensors"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")
MAX_ADAPTERS = 8  # loaded at once; a sync unloads the previous version first


class LoadAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(pattern=NAME.pattern)
    lora_path: str = Field(min_length=1, max_length=4096)


class ReloadWeights(BaseModel):
    model_config = ConfigDict(extra="ignore")

    weights_path: str = Field(min_length=1, max_length=4096)
    version: int = Field(ge=0)


class UnloadAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(pattern=NAME.pattern)
    lora_int_id: int | None = None  # vLLM's clients may send it; the name is what counts


class Adapters:
    """The adapters loaded onto the served model (a peft model once the first is loaded)."""

    def __init__(self, folder: str | Path | None, served_name: str):
        self.folder = Path(folder).resolve() if folder is not None else None
        # the folder as it was given: a trainer names its versions by that path, never a resolved one
        self.given = Path(folder).absolute() if folder is not None else None
        self.served_name = served_name
        self.names: set[str] = set()

    def adapter_folder(self, path: str) -> Path:
        """The adapter folder `path` names, inside the LoRA folder; a 400 for anything else."""
        candidate = self.inside(path, "lora_path")
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            file = candidate / name
            if file.is_symlink() or not file.is_file():
                raise ServingError(400, f"lora_path: no {name} in {candidate.name}",
                                   param="lora_path")
        return candidate

    def inside(self, path: str, field: str) -> Path:
        """The folder `path` names, inside the LoRA folder, reached without a symlink; 400 otherwise."""
        if self.folder is None:
            raise ServingError(404, "runtime LoRA loading is off (start serve-model with --lora-folder)")
        candidate = Path(path)
        if not candidate.is_absolute():
            candidate = self.folder / candidate
        if ".." in candidate.parts:
            raise ServingError(400, f"{field}: `..` is not allowed", param=field)
        base = next((folder for folder in (self.folder, self.given) if candidate.is_relative_to(folder)), None)
        if base is None:
            raise ServingError(400, f"{field}: not inside the LoRA folder {self.folder}", param=field)
        relative = candidate.relative_to(base)
        walked = base
        for part in relative.parts:
            walked = walked / part
            if walked.is_symlink():
                raise ServingError(400, f"{field}: symlinks are not followed", param=field)
        if not candidate.is_dir():
            raise ServingError(400, f"{field}: {relative} is not a folder", param=field)
        return candidate

    def load(self, model, request: LoadAdapter):
        """`model` with the adapter loaded under its name (the caller holds the engine)."""
        if request.lora_name in self.names or request.lora_name == self.served_name:
            raise ServingError(400, f"lora_name: the adapter {request.lora_name!r} is already loaded",
                               param="lora_name")
        if len(self.names) >= MAX_ADAPTERS:
            raise ServingError(400, f"at most {MAX_ADAPTERS} adapters are loaded at once; unload one first")
        folder = self.adapter_folder(request.lora_path)
        try:
            config = json.loads((folder / ADAPTER_CONFIG).read_text())
            if config.get("peft_type") != "LORA":
                raise ValueError(f"peft_type is {config.get('peft_type')!r}, not LORA")
            if hasattr(model, "peft_config"):
                model.load_adapter(str(folder), adapter_name=request.lora_name)
            else:
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, str(folder), adapter_name=request.lora_name)
        except (ValueError, KeyError, RuntimeError, OSError) as exc:
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ServingError(400, f"lora_path: not an adapter for this model ({message[:300]})",
                               param="lora_path") from None
        model.eval()
        self.names.add(request.lora_name)
        return model

    def unload(self, model, name: str):
        """`model` without the adapter: the plain served model again once the last one goes (a peft
        model left with no adapter is not a working model)."""
        if name not in self.names:
            raise ServingError(404, f"The LoRA adapter `{name}` is not loaded.", param="lora_name")
        self.names.discard(name)
        if not self.names:
            return model.unload()
        model.delete_adapter(name)
        return model

    def served(self) -> list[str]:
        return sorted(self.names)

    @contextmanager
    def active(self, model, name: str | None):
        """Decode with adapter `name`, or with the served weights alone (None)."""
        if not self.names:
            with nullcontext():
                yield
            return
        if name is None:
            with model.disable_adapter():
                yield
            return
        model.set_adapter(name)
        yield


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a saved checkpoint: `model.safetensors`, or the shards its index names."""
    single = folder / "model.safetensors"
    if single.is_file() and not single.is_symlink():
        return [single]
    index = folder / "model.safetensors.index.json"
    if not index.is_file() or index.is_symlink():
        raise ServingError(400, "weights_path: no model.safetensors (nor its index) there", param="weights_path")
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ServingError(400, "weights_path: model.safetensors.index.json is not a shard index",
                           param="weights_path") from None
    files = []
    for name in names:
        if not isinstance(name, str) or "/" in name or name in ("", ".", "..") or not name.endswith(".safetensors"):
            raise ServingError(400, f"weights_path: the index names {str(name)[:80]!r}, not a shard file here",
                               param="weights_path")
        file = folder / name
        if file.is_symlink() or not file.is_file():
            raise ServingError(400, f"weights_path: no shard {name}", param="weights_path")
        files.append(file)
    return files


def copy_weights(model, files: list[Path]) -> None:
    """Copy the tensors of `files` into `model`'s parameters in place (the engine's references to them
    stay valid), after checking that they are exactly its tensors: every name known, every shape the
    same, and every parameter given except those tied to another."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    params = served_tensors(model)
    try:
        state = {name: tensor for file in files for name, tensor in load_file(str(file)).items()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise ServingError(400, f"weights_path: unreadable safetensors ({str(exc)[:200]})", param="weights_path") \
            from None
    unknown = sorted(set(state) - set(params))
    if unknown:
        raise ServingError(400, f"weights_path: {unknown[0]} is not a tensor of the served model", param="weights_path")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ServingError(400, f"weights_path: {name} is {list(tensor.shape)}, the served model's is "
                                    f"{list(params[name].shape)}", param="weights_path")
    given = {id(params[name]) for name in state}  # a tensor tied to a given one is given too
    tied = {name for name, p in params.items() if id(p) in given}
    missing = sorted(set(params) - set(state) - tied)
    if missing:
        raise ServingError(400, f"weights_path: {missing[0]} is missing", param="weights_path")
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)


def served_tensors(model) -> dict:
    """The served model's parameters by their names in a saved checkpoint (under a peft wrapper, that
    of its base model: a LoRA layer's `base_layer` is the plain weight; the adapters' own are left out)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {name.replace(".base_layer", ""): param for name, param in base.named_parameters(remove_duplicate=False)
            if ".lora_" not in name}
