"""Orchestration overhead: quickstart wall time against the sum of the stages' compute time.

Runs `posttrain run` on the spec (a fresh store, so nothing is cached) as a user would, then
reads the run summary: compute = Σ `compute_seconds` (the stage function's own time in its child
process) of the stages and of the inline evaluations of new checkpoints (`evaluation:
on_new_checkpoint`, which the quickstart asks for: work the spec orders, not orchestration);
overhead = wall − compute (CLI start, Prefect's ephemeral API, task and evaluation-flow
orchestration, child-process start and imports, committing artifacts, reports). No peer: `--runs`
runs in a row on a quiet machine, the median reported. Each stage's output refs are kept: a run
whose refs equal the README's made the same artifacts, byte for byte.

    python -m bench.overhead [--spec pipelines/quickstart.yaml] [--runs 3] [--no-wait]
                             [--out bench/results/overhead.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import repeats
from bench.common import RESULTS_DIR, go_offline, make_result, write_result

ROOT = Path(__file__).resolve().parent.parent


def measure(spec: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        summary_path = Path(tmp) / "summary.json"
        began = time.monotonic()
        subprocess.run([str(Path(sys.executable).with_name("posttrain")), "run", str(spec), "--store",
                        f"file://{tmp}/store", "--summary-json", str(summary_path)], check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
        wall = time.monotonic() - began
        summary = json.loads(summary_path.read_text())
    return timing(wall, summary)


def timing(wall: float, summary: dict) -> dict:
    """One run's wall time split by its summary into compute and overhead."""
    stages = {s["id"]: {"compute_seconds": s["compute_seconds"], "task_seconds": s["seconds"], "outputs": s["outputs"]}
              for s in summary["stages"]}
    failed = [e["checkpoint"] for e in summary["evaluations"] if e["state"] == "failed"]
    if failed:
        raise SystemExit(f"bench.overhead: the inline evaluation of {failed[0]} failed; nothing measured")
    evaluations = {e["checkpoint"]: e["compute_seconds"] for e in summary["evaluations"]}
    compute = sum(s["compute_seconds"] for s in stages.values()) + sum(evaluations.values())
    per_stage = sum(s["task_seconds"] - s["compute_seconds"] for s in stages.values())
    return {"wall_seconds": round(wall, 2), "compute_seconds": round(compute, 2),
            "flow_seconds": summary["seconds"], "stages": stages, "evaluations_compute_seconds": evaluations,
            "overhead_percent": round((wall - compute) / wall * 100, 2),
            # where the overhead goes: before and after the flow (CLI start, Prefect's API), around each
            # stage's function (child process, imports, commits), and the flow's own time between stages
            # (the inline evaluations' flows and processes included)
            "parts_seconds": {"fixed": round(wall - summary["seconds"], 2), "per_stage": round(per_stage, 2),
                              "flow_between_stages": round(summary["seconds"] - compute - per_stage, 2)}}


def main(argv: list[str] | None = None) -> dict:
    go_offline()
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default=str(ROOT / "pipelines" / "quickstart.yaml"))
    parser.add_argument("--out", default=str(RESULTS_DIR / "overhead.json"))
    repeats.add_arguments(parser)
    args = parser.parse_args(argv)
    quiet = repeats.wait_for_quiet(args.no_wait)
    runs = [measure(Path(args.spec)) for _ in range(args.runs)]
    overheads = [run["overhead_percent"] for run in runs]
    timing = runs[repeats.median_index(overheads)]
    overhead = repeats.spread(overheads, 2)["median"]
    result = make_result(metric="orchestration overhead (share of wall time)", unit="%", ours=overhead,
                         peer=None, peer_name=None, higher_is_better=False,
                         config={"spec": Path(args.spec).name, **timing,
                                 "overhead_percent_runs": repeats.spread(overheads, 2),
                                 "command": f"posttrain run {Path(args.spec).name} (fresh store)",
                                 "repeats": repeats.protocol(args.runs, quiet, one_side=True)})
    path = write_result(result, args.out)
    print(f"overhead: {overhead:.1f}% of {timing['wall_seconds']:.0f}s wall "
          f"({timing['compute_seconds']:.0f}s stage compute) -> {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
