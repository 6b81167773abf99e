"""Attacks through resume state (issue 20, item 2, in part): a crafted pickle in the store's scratch/
runs no code, and a step that does not load is skipped for the one before it."""

import io
import os
import pickle

import torch

from artifacts.store import Store
from models.config import ModelConfig
from tasks.common.context import StageContext
from tasks.train import checkpointing


class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['ATTACK_MARKER']}",))


def context(tmp_path) -> StageContext:
    return StageContext(store=Store(f"file://{tmp_path / 'store'}"), pipeline="t", run_id="r", stage_id="sft",
                        cache_key="0" * 32, model=ModelConfig(), envs={}, inputs={}, workdir=tmp_path / "work")


def write_step(ctx: StageContext, step: int, state_bytes: bytes) -> None:
    folder = f"{ctx.scratch}/step-{step}"
    ctx.store.write_bytes(f"{folder}/model/config.json", b"{}")
    ctx.store.write_bytes(f"{folder}/state.pt", state_bytes)
    ctx.store.write_bytes(f"{folder}/DONE", b"ok")


def good_state() -> bytes:
    buffer = io.BytesIO()
    torch.save({"history": [{"loss": 1.0}], "rng": checkpointing.rng_state()}, buffer)
    return buffer.getvalue()


def test_a_crafted_pickle_runs_no_code_and_the_step_before_is_used(tmp_path, monkeypatch, capsys):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("ATTACK_MARKER", str(marker))
    ctx = context(tmp_path)
    write_step(ctx, 10, good_state())
    buffer = io.BytesIO()
    torch.save({"history": Payload()}, buffer, pickle_protocol=pickle.DEFAULT_PROTOCOL)
    write_step(ctx, 20, buffer.getvalue())
    resumed = checkpointing.latest(ctx)
    assert not marker.exists()
    assert resumed.step == 10 and resumed.state["history"] == [{"loss": 1.0}]
    assert "WARNING: in-stage checkpoint at step 20 does not load (UnpicklingError" in capsys.readouterr().out
    torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)  # the control: the old loading ran it
    assert marker.exists()


def test_a_truncated_state_falls_back_and_none_is_left_when_nothing_loads(tmp_path):
    ctx = context(tmp_path)
    write_step(ctx, 10, good_state()[:100])
    assert checkpointing.latest(ctx) is None
    write_step(ctx, 5, good_state())
    assert checkpointing.latest(ctx).step == 5


def test_the_rng_state_round_trips_through_weights_only(tmp_path):
    import random

    import numpy as np

    buffer = io.BytesIO()
    torch.save(checkpointing.rng_state(), buffer)
    expected = (random.random(), float(np.random.rand()), torch.rand(1).item())
    buffer.seek(0)
    checkpointing.set_rng_state(torch.load(buffer, weights_only=True))
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == expected
