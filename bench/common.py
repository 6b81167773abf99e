"""Shared pieces of the benchmarks: offline environment, machine facts, the result file (DESIGN §10)."""

from __future__ import annotations

import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

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
