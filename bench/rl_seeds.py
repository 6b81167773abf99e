"""RL's gain over its input checkpoint, and its spread over seeds, on the quickstart.

Runs the quickstart spec with its `rl` stage repeated for each seed (`rl` is seed 0, then
`rl-seed1`, ...; everything upstream is shared and cached in the store) and one evaluate stage
over the rl stage's input checkpoint and every seed's result. Reports the held-out greedy
accuracy gain in points (mean over seeds), with every seed's greedy and sampled accuracy,
doom-loop rate, and gains over the input paired by task with their standard errors
(`paired_gain`, `paired_se`, `sampled_paired_gain`, `sampled_paired_se`), so "beyond noise" can
be read off. No peer.

    python -m bench.rl_seeds [--spec pipelines/quickstart.yaml] [--seeds 3] [--store URI]
    python -m bench.rl_seeds --table     # the README's table, from the results file
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from bench.common import RESULTS_DIR, go_offline, make_result, write_result

ROOT = Path(__file__).resolve().parent.parent
EVAL_ID = "seeds-eval"


def seeded_spec(spec: dict, seeds: int) -> tuple[dict, list[str], str]:
    """The spec with one rl stage per seed and one evaluate stage over all of them."""
    stages = [s for s in spec["stages"] if s["kind"] != "evaluate"]
    rl = next(s for s in stages if s["kind"] == "rl")
    copies = [{**rl, "id": f"{rl['id']}-seed{seed}", "seed": seed} for seed in range(1, seeds)]
    evaluate = next(s for s in spec["stages"] if s["kind"] == "evaluate")
    rl_ids = [rl["id"], *(c["id"] for c in copies)]
    evaluate = {**evaluate, "id": EVAL_ID, "checkpoints": [rl["policy"], *rl_ids], "baseline": rl["policy"]}
    return {**spec, "stages": [*stages, *copies, evaluate]}, rl_ids, rl["policy"]


def run_spec(spec: dict, store: str | None, spec_dir: Path | None = None) -> dict:
    """`posttrain run` of the spec, its summary. Written into `spec_dir` (the original spec's folder,
    hidden, removed after) where its relative paths must resolve as the original's do."""
    with tempfile.TemporaryDirectory(prefix="bench-rl-seeds-") as tmp:
        spec_path = Path(spec_dir) / f".bench-{spec['name']}.yaml" if spec_dir else Path(tmp) / "spec.yaml"
        summary_path = Path(tmp) / "summary.json"
        spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
        command = [str(Path(sys.executable).with_name("posttrain")), "run", str(spec_path), "--summary-json",
                   str(summary_path), *(["--store", store] if store else [])]
        try:
            subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        finally:
            spec_path.unlink(missing_ok=True)
        return json.loads(summary_path.read_text())


def seeded_parser(module: str, doc: str, spec: str, out: str) -> argparse.ArgumentParser:
    """The flags of every seeded bench (rl_seeds, agentic_seeds, learned_rewards)."""
    parser = argparse.ArgumentParser(prog=f"python -m bench.{module}", description=doc.splitlines()[0])
    parser.add_argument("--spec", default=str(ROOT / "pipelines" / spec))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--store", default=None, help="default: the spec's store (reuses what a run cached)")
    parser.add_argument("--out", default=str(RESULTS_DIR / out))
    parser.add_argument("--table", action="store_true", help="print the table from --out; run nothing")
    return parser


def printed_table(out: str, table) -> dict:
    """`--table`: the results file at `out`, its table printed."""
    result = json.loads(Path(out).read_text())
    print(table(result))
    return result


def table(result: dict) -> str:
    """The README's table: the input's and each seed's held-out accuracy, greedy and sampled, and
    each seed's gains over the input with their paired standard errors, in points."""
    config = result["config"]
    before = config["input"]
    lines = ["| checkpoint | greedy | sampled (T=0.7) | doom-loop | greedy gain ± paired SE | sampled gain ± paired SE |",
             "|---|---:|---:|---:|---:|---:|",
             f"| `{config['input_id']}` (the input) | {100 * before['accuracy']:.1f} % | "
             f"{100 * before['sampled_accuracy']:.1f} % | {100 * before['doom_loop_rate']:.1f} % | | |"]
    for rl_id, seed in config["seeds"].items():
        lines.append(f"| `{rl_id}` | {100 * seed['accuracy']:.1f} % | {100 * seed['sampled_accuracy']:.1f} % | "
                     f"{100 * seed['doom_loop_rate']:.1f} % | {100 * seed['paired_gain']:+.1f} ± "
                     f"{100 * seed['paired_se']:.1f} | {100 * seed['sampled_paired_gain']:+.1f} ± "
                     f"{100 * seed['sampled_paired_se']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    go_offline()
    args = seeded_parser("rl_seeds", __doc__, "quickstart.yaml", "rl_seeds.json").parse_args(argv)
    if args.table:
        return printed_table(args.out, table)
    spec, rl_ids, input_id = seeded_spec(yaml.safe_load(Path(args.spec).read_text()), args.seeds)
    summary = run_spec(spec, args.store)
    evaluation = next(s for s in summary["stages"] if s["id"] == EVAL_ID)["metrics"]
    env = next(iter(evaluation[input_id]))
    before = evaluation[input_id][env]
    per_seed = {rl_id: evaluation[rl_id][env] for rl_id in rl_ids}
    gains = [100 * (m["accuracy"] - before["accuracy"]) for m in per_seed.values()]
    keep = ("accuracy", "sampled_accuracy", "doom_loop_rate", "format_rate")
    paired = ("paired_gain", "paired_se", "sampled_paired_gain", "sampled_paired_se")
    result = make_result(
        metric=f"held-out greedy accuracy gain of rl over {input_id} (mean over {args.seeds} seeds)",
        unit="points", ours=round(statistics.mean(gains), 2), peer=None, peer_name=None, higher_is_better=True,
        config={"spec": Path(args.spec).name, "env": env, "eval_n": before["n"],
                "input_id": input_id, "input": {k: before.get(k) for k in keep},
                "seeds": {rl_id: {k: m.get(k) for k in keep + paired} for rl_id, m in per_seed.items()},
                "gain_points": [round(g, 2) for g in gains],
                "gain_std_points": round(statistics.stdev(gains), 2) if len(gains) > 1 else None,
                "rl_seconds": {s["id"]: s["seconds"] for s in summary["stages"] if s["id"] in rl_ids},
                "command": f"python -m bench.rl_seeds --seeds {args.seeds}"
                           + (f" --store {args.store}" if args.store else "")})
    path = write_result(result, args.out)
    print(f"rl gain over {input_id}: {', '.join(f'{g:+.1f}' for g in gains)} points "
          f"(input {100 * before['accuracy']:.1f}%) -> {path}")
    return result


if __name__ == "__main__":
    main()
