"""Shared pieces of the benchmarks: offline environment, machine facts, the result file (DESIGN §10)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from bench import repeats

RESULTS_DIR = Path(__file__).resolve().parent / "results"
RESULT_KEYS = ("metric", "unit", "higher_is_better", "ours", "peer", "peer_name", "ratio", "config", "machine")

BENCH_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TQDM_DISABLE": "1",  # TRL's reference log-prob pass
}


def go_offline() -> None:
    """Nothing a benchmark runs may reach the network (and no progress bars); call before importing HF libraries."""
    os.environ.update(BENCH_ENV)


def machine_info() -> dict:
    import torch

    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_average_1m": round(os.getloadavg()[0], 2),  # other work on the machine when the result was written
    }


def package_versions(*names: str) -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in names}


def make_result(*, metric: str, unit: str, ours: float, peer: float | None, peer_name: str | None,
                config: dict, higher_is_better: bool = True) -> dict:
    return {
        "metric": metric,
        "unit": unit,
        "higher_is_better": higher_is_better,
        "ours": ours,
        "peer": peer,
        "peer_name": peer_name,
        "ratio": ours / peer if peer else None,
        "config": config,
        "machine": machine_info(),
    }


def write_result(result: dict, out: str | Path) -> Path:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


@dataclass
class SideResult:
    """One side of a training-throughput comparison."""

    timed_tokens: int
    timed_seconds: float
    mean_train_loss: float
    final_loss: float  # the trained model's loss on the last training batch, same function both sides
    torch_threads: int
    details: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.timed_tokens / self.timed_seconds


def side_config(side: SideResult) -> dict:
    return {"tokens_per_second": round(side.tokens_per_second, 1), "timed_tokens": side.timed_tokens,
            "timed_seconds": round(side.timed_seconds, 4), "mean_train_loss": side.mean_train_loss,
            "final_loss": side.final_loss, "torch_threads": side.torch_threads, **side.details}


class Stopwatch:
    """Seconds and tokens of the steps after the first `skip` steps, from cumulative token counts."""

    def __init__(self, skip: int):
        self.skip = skip
        self.start: tuple[float, int] | None = None
        self.seconds = 0.0
        self.tokens = 0

    def step_done(self, step: int, tokens_seen: int) -> None:
        now = time.perf_counter()
        if step == self.skip:
            self.start = (now, tokens_seen)
        elif step > self.skip:
            self.seconds = now - self.start[0]
            self.tokens = tokens_seen - self.start[1]


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---- training benches (ours vs a TRL trainer) -------------------------------------------------

TRAIN_WARMUP_STEPS = 3  # untimed on both sides: first-call allocations and kernel selection
GRAD_CLIP = 1.0  # what tasks/train/loop.py clips to
MIN_LR_RATE = 0.1  # tasks/train/loop.py's cosine decays to 10% of the peak
TRAIN_METRIC, TRAIN_UNIT = "train tokens/s", "tokens/s"


def trl_cpu_args(output_dir: str, *, steps: int, batch_size: int, learning_rate: float, warmup_steps: int,
                 weight_decay: float, seed: int) -> dict:
    """TRL trainer arguments matched to our loop, with TRL's CPU-hostile defaults off (DESIGN §10)."""
    return dict(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=1,
        learning_rate=learning_rate,
        weight_decay=weight_decay,
        lr_scheduler_type="cosine_warmup_with_min_lr",  # warm-up (s+1)/W like ours, cosine to min_lr_rate
        lr_scheduler_kwargs={"min_lr_rate": MIN_LR_RATE},
        warmup_steps=warmup_steps,
        max_grad_norm=GRAD_CLIP,
        seed=seed,
        bf16=False,  # TRL's default True is ~10x slower on CPU
        fp16=False,
        gradient_checkpointing=False,  # TRL's default True recomputes activations
        activation_checkpointing=False,  # transformers 5's name for it; passing both avoids the alias warning
        model_init_kwargs={"dtype": "float32"},
        train_sampling_strategy="sequential",  # the dataset is already laid out in our batch order
        eval_strategy="no",
        save_strategy="no",
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def train_bench_args(argv: list[str] | None, *, prog: str, description: str, steps: int, batch_size: int,
                     default_out: Path, more=None):
    """The arguments every training comparison takes; `more(parser)` adds a bench's own."""
    import argparse

    import torch

    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--steps", type=int, default=steps,
                        help=f"training steps, the first {TRAIN_WARMUP_STEPS} untimed")
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    parser.add_argument("--out", default=str(default_out))
    repeats.add_arguments(parser)
    if more is not None:
        more(parser)
    args = parser.parse_args(argv)
    if args.steps <= TRAIN_WARMUP_STEPS:
        parser.error(f"--steps must be more than the {TRAIN_WARMUP_STEPS} untimed warm-up steps")
    return args


def measured_sides(runs: dict[str, list[SideResult]]) -> tuple[float, float, dict]:
    """`repeats.measured` of a training comparison: tokens/s, each side's median run's `side_config`."""
    return repeats.measured(runs, lambda run: run.tokens_per_second, side_config, "tokens_per_second_runs")


def resolved_config(args) -> dict:
    """Every setting of a TRL config after its own defaults and post-init resolution, as JSON."""
    settings = {**args.to_dict(), "output_dir": "<temporary directory>"}
    return json.loads(json.dumps(settings, default=str))


def report(name: str, result: dict, out) -> dict:
    path = write_result(result, out)
    print(f"{name}: ours {result['ours']:,.1f} vs {result['peer_name']} {result['peer']:,.1f} {result['unit']} "
          f"(ratio {result['ratio']:.2f}) -> {path}")
    return result
