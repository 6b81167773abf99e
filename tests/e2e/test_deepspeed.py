"""A `gpus: 2` stage under a DeepSpeed accelerate config, on two CPU processes (DeepSpeed's own CPU
accelerator, gloo): the engine steps once per optimizer step, after the step's last micro-batch,
not after every one, with the micro-batch size DeepSpeed needs set from the stage. Trained on 3
rows against 2 per step in micro-batches of 2, its losses are those of one process on the whole
batch."""

from __future__ import annotations

import json

import pytest

from artifacts.store import Store
from conftest import ROOT
from e2e.helpers import by_id, posttrain, summary, tiny_spec, write

DEEPSPEED_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
num_machines: 1
num_processes: 2
mixed_precision: 'no'
deepspeed_config:
  zero_stage: {stage}
"""
SFT = {"max_steps": 3, "batch_size": 5, "micro_batch_size": 2, "warmup_steps": 0, "learning_rate": 0.003,
       "checkpoint_every": 100}


# `make test` installs DeepSpeed here, out of the project's environment (Makefile)
DEEPSPEED_PATH = ROOT / ".venv" / "deepspeed"


def losses(folder, sft: dict, model: dict | None = None, env: dict | None = None,
           says: str | None = None) -> list[float]:
    """The sft stage's loss at each step of a tiny spec run in `folder` (whose output says `says`)."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = tiny_spec(f"file://{folder / 'store'}", sft=sft)
    spec["model"].update(model or {})
    spec["stages"] = spec["stages"][:2]
    run = posttrain("run", write(folder, spec), "--summary-json", folder / "run.json", env=env)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert says is None or says in run.stdout.splitlines(), run.stdout[-4000:]
    stage = by_id(summary(folder / "run.json"))["sft"]
    report = Store(f"file://{folder / 'store'}").fetch(stage["outputs"]["report"])
    return [json.loads(line)["loss"] for line in (report / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> list[float]:
    return losses(tmp_path_factory.mktemp("alone"), SFT)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_deepspeed_steps_once_per_step_and_trains_as_one_process(tmp_path, zero_stage, alone):
    if not (DEEPSPEED_PATH / "deepspeed").is_dir():
        pytest.skip(f"DeepSpeed is not installed in {DEEPSPEED_PATH} (make test installs it)")
    (tmp_path / "ds.yaml").write_text(DEEPSPEED_CONFIG.format(stage=zero_stage))
    sharded = losses(tmp_path / "run", {**SFT, "gpus": 2, "accelerate_config": str(tmp_path / "ds.yaml")},
                     {"device": "cpu"}, env={"PYTHONPATH": str(DEEPSPEED_PATH)},
                     says="[sft] 2 processes (DEEPSPEED), each on its share of every batch")  # not DDP instead
    assert sharded == pytest.approx(alone, rel=1e-4)
    assert sharded[-1] < sharded[0]
