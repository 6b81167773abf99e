"""The spec's `model:` section."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class LoraConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    r: int = Field(8, gt=0)
    alpha: int = Field(16, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj"]


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    base: str = "tiny-llama"  # a preset name, a local folder or a hub id
    lora: LoraConfig | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    threads: int | None = Field(None, gt=0)  # torch CPU threads; unset: the cores, shared by parallel stages
    # where every model of a stage runs: auto = cuda:<local rank> when the stage holds GPUs
    # (`gpus: N`) and CUDA is present, else the CPU (models/loading.py, stage_device)
    device: Literal["auto", "cpu"] = "auto"
    # arguments of the model's chat template, in every rendering (Qwen3: {enable_thinking: false})
    chat_template_kwargs: dict[str, bool | int | float | str] = {}
