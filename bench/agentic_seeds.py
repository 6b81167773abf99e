"""Agentic RL on held-out tasks over three RL seeds: pipelines/agentic.yaml with its rl stage
repeated per seed (`rl` is seed 0, then `rl-seed1`, ...; SFT, generation and preference run once,
shared), and one evaluate stage over `sft` (what `align` was trained from), `align` and every
seed's checkpoint with `align` as the baseline, so each seed's paired gain over align, and its
standard error, come from the same held-out tasks. Writes bench/results/agentic_seeds.json:

    {"envs": {KIND: {"n", "sft": [..], "align": [..], "rl": [..], "paired_se": [..]}},
     "cod_by_position": {"rl": [..]}}

(one value per seed, rates in 0-1; sft and align are trained once, so their values repeat)
beside the usual bench fields. `--table` prints the README's agentic table from that file.

    python -m bench.agentic_seeds [--spec pipelines/agentic.yaml] [--seeds 3] [--store URI] [--fresh-run] [--table]

`--fresh-run` first runs the spec as it is on an empty --store, timed: `config.fresh_run_seconds`, the
end-to-end time of a fresh run (the seeds then reuse its stages).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import yaml

from bench.common import go_offline, make_result, write_result
from bench import rl_seeds
from bench.rl_seeds import EVAL_ID, printed_table, run_spec, seeded_parser

ROOT = Path(__file__).resolve().parent.parent


def seeded_spec(spec: dict, seeds: int) -> tuple[dict, list[str], str]:
    """rl_seeds' spec (one rl stage per seed, one evaluation), its evaluation over the checkpoint the
    rl input was trained from (agentic.yaml's `sft`, which its own evaluation leaves out to save
    its time), the spec's own checkpoints before RL and every seed, against the rl input."""
    seeded, rl_ids, input_id = rl_seeds.seeded_spec(spec, seeds)
    stages = {stage["id"]: stage for stage in spec["stages"]}
    evaluate = next(s for s in spec["stages"] if s["kind"] == "evaluate")
    policy = stages[input_id]["policy"] if "policy" in stages[input_id] else None
    trained_from = [policy] if policy in stages else []  # none where the input starts from the base or a ref
    upstream = list(dict.fromkeys([*trained_from, *(c for c in evaluate["checkpoints"] if c not in rl_ids)]))
    seeded["stages"][-1] = {**seeded["stages"][-1], "checkpoints": [*upstream, *rl_ids], "baseline": input_id}
    return seeded, rl_ids, input_id


def env_keys(spec: dict, env_ids: list[str]) -> dict[str, str]:
    """Each evaluated env's key in the results: its kind; a second env of a kind is `kind:id`."""
    keys: dict[str, str] = {}
    for env_id in env_ids:
        kind = spec["envs"][env_id]["kind"]
        keys[env_id] = kind if kind not in keys.values() else f"{kind}:{env_id}"
    return keys


def collect(spec: dict, metrics: dict, rl_ids: list[str], input_id: str) -> tuple[dict, dict]:
    """(envs, cod_by_position) of the results file from the evaluation's metrics."""
    envs, positions = {}, {}
    evaluate = next(stage for stage in spec["stages"] if stage["id"] == EVAL_ID)
    evaluated = [env_id for env_id in evaluate["envs"] if env_id in metrics[input_id]]  # the spec's order
    upstream = [c for c in evaluate["checkpoints"] if c not in rl_ids]  # sft, align (in that order): trained once
    for env_id, key in env_keys(spec, evaluated).items():
        row = {"n": metrics[input_id][env_id]["n"]}
        for checkpoint in upstream:
            row[checkpoint] = [metrics[checkpoint][env_id]["accuracy"]] * len(rl_ids)
        row["rl"] = [metrics[rl_id][env_id]["accuracy"] for rl_id in rl_ids]
        row["paired_se"] = [metrics[rl_id][env_id]["paired_se"] for rl_id in rl_ids]
        row["paired_gain"] = [metrics[rl_id][env_id]["paired_gain"] for rl_id in rl_ids]
        envs[key] = row
        if spec["envs"][env_id]["kind"] == "cod":
            names = sorted((k for k in metrics[rl_ids[0]][env_id] if k.startswith("mean_outcome_position_")),
                           key=lambda k: int(k.rsplit("_", 1)[1]))
            positions["rl"] = [round(statistics.mean(metrics[rl_id][env_id][name] for rl_id in rl_ids), 4)
                               for name in names]
            positions[input_id] = [metrics[input_id][env_id][name] for name in names]
    return envs, positions


def table(result: dict) -> str:
    """The README's agentic table: held-out greedy success per env before RL (each checkpoint trained
    once), after RL (mean and range over seeds), and each seed's gain over the RL input with its
    paired standard error."""
    rows = result["envs"]
    upstream = [key for key in next(iter(rows.values())) if key not in ("n", "rl", "paired_se", "paired_gain")]
    lines = [f"| env | held-out episodes | {' | '.join(upstream)} | rl (mean, min–max over seeds) | "
             f"rl − {result['config']['baseline']} per seed (± paired SE) |",
             "|---|---:|" + "---:|" * len(upstream) + "---:|---|"]
    for key, row in rows.items():
        rl = row["rl"]
        before = " | ".join(f"{100 * row[checkpoint][0]:.1f} %" for checkpoint in upstream)
        gains = ", ".join(f"{100 * g:+.1f} ± {100 * se:.1f}" for g, se in zip(row["paired_gain"], row["paired_se"]))
        lines.append(f"| {key} | {row['n']} | {before} | {100 * statistics.mean(rl):.1f} % "
                     f"({100 * min(rl):.1f}–{100 * max(rl):.1f}) | {gains} |")
    positions = result["cod_by_position"]
    if positions:
        lines += ["", "CoD success by position in the pack (greedy, held-out packs): "
                  + "; ".join(f"{label} " + " / ".join(f"{100 * v:.1f} %" for v in values)
                              for label, values in positions.items())]
    return "\n".join(lines)


def fresh_run_seconds(summary: dict, seconds: float) -> float:
    """The wall seconds of a run of the spec as it is, which must have found nothing in its store."""
    cached = [stage["id"] for stage in summary["stages"] if stage["state"] == "cached"]
    if cached:
        raise SystemExit(f"--fresh-run: the store already held {len(cached)} of the spec's stages "
                         f"({', '.join(cached[:3])}, ...); give an empty --store")
    return round(seconds, 1)


def timed_fresh_run(spec: dict, store: str | None) -> float:
    started = time.monotonic()
    summary = run_spec(spec, store)
    return fresh_run_seconds(summary, time.monotonic() - started)


def main(argv: list[str] | None = None) -> dict:
    go_offline()
    parser = seeded_parser("agentic_seeds", __doc__, "agentic.yaml", "agentic_seeds.json")
    parser.add_argument("--fresh-run", action="store_true",
                        help="first run the spec as it is on --store, which must be empty, timed "
                             "(config.fresh_run_seconds); the seeds then reuse what it made")
    args = parser.parse_args(argv)
    if args.table:
        return printed_table(args.out, table)
    original = yaml.safe_load(Path(args.spec).read_text())
    fresh = {"fresh_run_seconds": timed_fresh_run(original, args.store)} if args.fresh_run else {}
    spec, rl_ids, input_id = seeded_spec(original, args.seeds)
    summary = run_spec(spec, args.store)
    stages = {stage["id"]: stage for stage in summary["stages"]}
    envs, positions = collect(spec, stages[EVAL_ID]["metrics"], rl_ids, input_id)
    agentic = [row for key, row in envs.items() if key in ("terminal", "search", "openclaw", "rlm")]
    result = make_result(
        metric=f"held-out greedy success after rl, mean over {args.seeds} seeds and the agentic envs",
        unit="rate", ours=round(statistics.mean(statistics.mean(row["rl"]) for row in agentic), 4) if agentic else None,
        peer=None, peer_name=None, higher_is_better=True,
        config={"spec": Path(args.spec).name, "seeds": rl_ids, "baseline": input_id,
                "stage_seconds": {stage_id: stage["seconds"] for stage_id, stage in stages.items()},
                "total_seconds": round(sum(stage["seconds"] for stage in stages.values()), 1),
                # stages the store already held (a run of the same spec and code): their seconds are a cache lookup
                "cached": [stage_id for stage_id, stage in stages.items() if stage["state"] == "cached"],
                **fresh,
                "command": f"python -m bench.agentic_seeds --seeds {args.seeds}"
                           + (" --fresh-run" if args.fresh_run else "")
                           + (f" --store {args.store}" if args.store else "")})
    result.update(envs=envs, cod_by_position=positions)
    path = write_result(result, args.out)
    print(table(result))
    print(f"-> {path}")
    return result


if __name__ == "__main__":
    main()
