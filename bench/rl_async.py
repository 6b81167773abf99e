"""Asynchronous RL against lockstep RL, both decoding on `posttrain serve-model`, on the quickstart.

The quickstart's stages up to the rl stage's input run first (cached in the store). Then its rl
stage runs with `rollout: {backend: server}` against a serve-model of that checkpoint started here
(one torch thread; the trainer gets one too, so each side of the overlap has a core), in turns:
lockstep, asynchronous (max_staleness 1), lockstep, ... Each run's checkpoint is then evaluated
greedily on the quickstart's held-out tasks. Reports seconds per step (sampling or waiting for it,
the update, the weight sync), the reward curve, the staleness histogram and held-out accuracy;
`ratio` = lockstep seconds per step / asynchronous seconds per step (medians over runs).

    python -m bench.rl_async [--runs 2] [--steps N] [--store URI] [--no-wait]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.common import RESULTS_DIR, go_offline, make_result, package_versions, write_result
from bench.repeats import paired_ratios, protocol, spread, wait_for_quiet
from bench.rl_seeds import run_spec

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("lockstep", "asynchronous")
CURVE_EVERY = 10  # steps per point of the reward curve


def upstream(spec: dict, store: str | None) -> tuple[dict, dict, str, dict]:
    """(rl stage, evaluate stage, the rl input's committed ref, spec) after running what the rl stage needs."""
    rl = next(s for s in spec["stages"] if s["kind"] == "rl")
    evaluate = next(s for s in spec["stages"] if s["kind"] == "evaluate")
    before = spec["stages"][:spec["stages"].index(rl)]
    # without the rl stage, an `evaluation:` naming it would not validate; the bench evaluates its own runs
    upstream_spec = {key: value for key, value in spec.items() if key != "evaluation"}
    summary = run_spec({**upstream_spec, "stages": before}, store)
    stage = next(s for s in summary["stages"] if s["id"] == rl["policy"])
    return rl, evaluate, stage["outputs"]["checkpoint"], spec


def serve(ref: str, store: str, folder: Path) -> tuple[subprocess.Popen, str]:
    """serve-model of `ref` on a free port with one torch thread; (process, base URL)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    process = subprocess.Popen([str(Path(sys.executable).with_name("posttrain")), "serve-model", ref, "--store", store,
                                "--port", "0", "--name", "policy", "--lora-folder", str(folder)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
    line = process.stdout.readline()
    if not line.startswith("serving "):
        process.kill()
        raise RuntimeError(f"serve-model did not start: {line!r}")
    return process, line.split(" on ")[1].strip()


def one_run(side: str, rl: dict, evaluate: dict, ref: str, store, spec: dict, steps: int) -> dict:
    """One rl stage through a fresh serve-model, and its checkpoint's held-out accuracy."""
    import torch

    from tasks.common.context import StageContext
    from tasks.stages.evaluate import EvaluateStage
    from tasks.stages.evaluate import run as run_evaluate
    from tasks.stages.rl import RlStage
    from flows.spec import parse_spec
    from tasks.stages.rl.stage import run as run_rl

    torch.set_num_threads(1)
    parsed = parse_spec(spec)
    model, envs = parsed.model.model_copy(update={"threads": 1}), parsed.envs
    with tempfile.TemporaryDirectory(prefix="bench-rl-async-") as tmp:
        folder = Path(tmp) / "sync"
        folder.mkdir()
        process, url = serve(ref, store.uri, folder)
        try:
            fields = {**rl, "steps": steps, "checkpoint_every": steps,
                      "rollout": {"backend": "server", "endpoint": url, "model": "policy", "sync_folder": str(folder)}}
            if side == "asynchronous":
                fields["asynchronous"] = {"max_staleness": 1}
            stage = RlStage(**fields)
            ctx = StageContext(store=store, pipeline=spec["name"], run_id=f"bench-{side}", stage_id=rl["id"],
                               cache_key=f"bench-rl-async-{side}-{time.time_ns()}", model=model,
                               envs={e: envs[e] for e in stage.envs}, inputs={rl["policy"]: ref},
                               workdir=Path(tmp) / "work", producer={"stage_id": rl["id"]})
            began = time.perf_counter()
            outputs = run_rl(stage, ctx)
            seconds = time.perf_counter() - began
        finally:
            process.kill()
            process.wait()
        history = read_history(outputs["report"].local_dir / "metrics.jsonl")
        checkpoint = outputs["checkpoint"].local_dir
        evaluation = EvaluateStage(**{**evaluate, "checkpoints": ["rl"], "envs": evaluate["envs"][:1],
                                      "sampled": None})
        eval_ctx = StageContext(store=store, pipeline=spec["name"], run_id="bench", stage_id="eval", cache_key="k",
                                model=parsed.model, envs={e: envs[e] for e in evaluation.envs},
                                inputs={"rl": str(store.commit(f"{spec['name']}/bench-rl-async", "checkpoint",
                                                               checkpoint, producer={}))},
                                workdir=Path(tmp) / "eval")
        metrics = run_evaluate(evaluation, eval_ctx)["results"].metrics["rl"][evaluation.envs[0]]
    return summarize(history, seconds, metrics)


def read_history(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines()]


def summarize(history: list[dict], stage_seconds: float, metrics: dict) -> dict:
    steps = [h["rollout_seconds"] + h["update_seconds"] + h["sync_seconds"] for h in history]
    staleness: dict[str, int] = {}
    for h in history:
        for key, count in h.items():
            if key.startswith("staleness_"):
                staleness[key.removeprefix("staleness_")] = staleness.get(key.removeprefix("staleness_"), 0) + count
    curve = [round(statistics.mean(h["reward"] for h in history[i:i + CURVE_EVERY]), 4)
             for i in range(0, len(history), CURVE_EVERY)]
    return {"seconds_per_step": round(sum(steps) / len(steps), 4),
            "parts_per_step": {part: round(statistics.mean(h[f"{part}_seconds"] for h in history), 4)
                               for part in ("rollout", "update", "sync")},
            "stage_seconds": round(stage_seconds, 1), "steps": len(history),
            "reward_curve": curve, "staleness_histogram": dict(sorted(staleness.items())),
            "stale_groups": sum(h["stale_groups"] for h in history),
            "held_out_accuracy": metrics["accuracy"], "held_out_n": metrics["n"]}


def main(argv: list[str] | None = None) -> dict:
    go_offline()
    parser = argparse.ArgumentParser(prog="python -m bench.rl_async", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default=str(ROOT / "pipelines" / "quickstart.yaml"))
    parser.add_argument("--runs", type=int, default=2, help="runs per side, interleaved")
    parser.add_argument("--steps", type=int, default=None, help="default: the spec's rl steps")
    parser.add_argument("--store", default=None, help="default: the spec's store (reuses what make run cached)")
    parser.add_argument("--no-wait", action="store_true", help="start however busy the machine is")
    parser.add_argument("--out", default=str(RESULTS_DIR / "rl_async.json"))
    args = parser.parse_args(argv)
    from artifacts.store import Store

    spec = yaml.safe_load(Path(args.spec).read_text())
    store = Store(args.store or spec["store"].replace("file://.", f"file://{ROOT}/."))
    rl, evaluate, ref, spec = upstream(spec, store.uri)
    steps = args.steps or rl["steps"]
    quiet = wait_for_quiet(args.no_wait)
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for index in range(args.runs):
        for side in SIDES:
            print(f"[rl_async] {side} run {index + 1}", file=sys.stderr, flush=True)
            runs[side].append(one_run(side, rl, evaluate, ref, store, spec, steps))
    per_step = {side: spread([r["seconds_per_step"] for r in runs[side]]) for side in SIDES}
    lockstep, ahead = per_step["lockstep"]["median"], per_step["asynchronous"]["median"]
    accuracy = {side: [r["held_out_accuracy"] for r in runs[side]] for side in SIDES}
    n = runs["lockstep"][0]["held_out_n"]
    result = make_result(
        metric="rl seconds per step, decoding on serve-model: lockstep / asynchronous (max_staleness 1)",
        unit="seconds per step", ours=ahead, peer=lockstep, peer_name="lockstep RL on the same server",
        higher_is_better=False,
        config={"spec": Path(args.spec).name, "steps": steps, "input": ref, "threads": "1 trainer, 1 server",
                "seconds_per_step": per_step, "runs": runs,
                "ratio_runs": paired_ratios([r["seconds_per_step"] for r in runs["lockstep"]],
                                            [r["seconds_per_step"] for r in runs["asynchronous"]]),
                "held_out_accuracy": {side: {"runs": acc, "mean": round(statistics.mean(acc), 4)}
                                      for side, acc in accuracy.items()},
                "held_out_binomial_se": round((statistics.mean(accuracy["lockstep"])
                                               * (1 - statistics.mean(accuracy["lockstep"])) / n) ** 0.5, 4),
                "repeats": protocol(args.runs, quiet), "versions": package_versions("torch", "transformers"),
                "command": "python -m bench.rl_async" + (f" --runs {args.runs}" if args.runs != 2 else "")
                           + (f" --steps {steps}" if args.steps else "")})
    result["ratio"] = round(lockstep / ahead, 4)  # lockstep / asynchronous seconds per step: > 1 is faster
    path = write_result(result, args.out)
    print(f"rl seconds per step: lockstep {lockstep:.3f}, asynchronous {ahead:.3f} -> {result['ratio']:.2f}x; "
          f"held-out accuracy {accuracy} -> {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
