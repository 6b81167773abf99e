"""A learned reward's effect on the rows' own check, over RL seeds: pipelines/learned-rewards.yaml
with its rl stage repeated per seed (`rl` is seed 0, then `rl-seed1`, ...; sft, the generation of
the policy's own mistakes and the reward model run once, shared) and one evaluate stage over `sft`
and every seed, so each seed's gain on the held-out check (the reward at weight 0 that trains
nothing) is paired with sft on the same prompts. The same run holds the contrast: a reward model
trained on the user's preference pairs (examples/preferences.jsonl) instead of the policy's own
samples, optimized harder (`rl-contrast`: 60 steps at 5e-5, no KL). Writes
bench/results/learned_rewards.json:

    {"seeds": [{"seed", "gain", "paired_se", "sampled_gain", "sampled_paired_se", "accuracy", ..}, ..],
     "contrast": {"gain", "paired_se", ..}, "config": {"sft": {"accuracy", "mean_reward", ..}, ..}}

(gains in points) beside the usual bench fields. `--table` prints docs/LEARNED_REWARDS.md's table.

    python -m bench.learned_rewards [--spec pipelines/learned-rewards.yaml] [--seeds 3] [--store URI]
        [--contrast-pairs ../examples/preferences.jsonl] [--table]
"""

from __future__ import annotations

import statistics
from pathlib import Path

import yaml

from bench.common import go_offline, make_result, write_result
from bench.rl_seeds import EVAL_ID, printed_table, run_spec, seeded_parser, seeded_spec

CONTRAST = "rl-contrast"
CONTRAST_RL = {"learning_rate": 5e-5, "steps": 60, "beta": 0.0}  # pushed, and nothing holds it near sft
# the rows' check decides `accuracy`; the learned reward is the env's only weighted term, so the
# mean reward of the greedy completions is the reward model's mean score
CHECK_KEYS = ("accuracy", "sampled_accuracy", "doom_loop_rate", "mean_reward")


def with_contrast(spec: dict, pairs_source: str) -> dict:
    """The seeded spec plus the contrast: a reward model on the preference dataset at `pairs_source`
    (relative to the spec's folder, as its sources are), its own env over the same rows (holding out
    what the spec's env holds out) and an rl stage pushed on it, evaluated with the seeds."""
    stages = {stage["id"]: stage for stage in spec["stages"]}
    rl = next(stage for stage in spec["stages"] if stage["kind"] == "rl")
    reward_model = next(stage for stage in spec["stages"] if stage["kind"] == "reward_model")
    [env_id] = rl["envs"]
    env = spec["envs"][env_id]
    learned = [reward for reward in env["rewards"] if reward.get("reward_model") == reward_model["id"]]
    rewards = [reward if reward not in learned else {**reward, "reward_model": f"{reward_model['id']}-pairs"}
               for reward in env["rewards"]]
    pairs_rm = {key: value for key, value in reward_model.items() if key != "rollout_pairs"}
    added = [{"id": "contrast-pairs", "kind": "dataset", "source": pairs_source},
             {**pairs_rm, "id": f"{reward_model['id']}-pairs", "data": "contrast-pairs"},
             {**rl, "id": CONTRAST, "envs": {f"{env_id}-pairs": 1.0}, **CONTRAST_RL}]
    evaluate = stages[EVAL_ID]
    evaluate = {**evaluate, "checkpoints": [*evaluate["checkpoints"], CONTRAST]}
    return {**spec, "envs": {**spec["envs"], f"{env_id}-pairs": {**env, "held_out_as": env_id, "rewards": rewards}},
            "stages": [*(s for s in spec["stages"] if s["id"] != EVAL_ID), *added, evaluate]}


def seed_row(seed: int, metrics: dict) -> dict:
    return {"seed": seed, "gain": round(100 * metrics["paired_gain"], 2),
            "paired_se": round(100 * metrics["paired_se"], 2),
            "sampled_gain": round(100 * metrics["sampled_paired_gain"], 2),
            "sampled_paired_se": round(100 * metrics["sampled_paired_se"], 2),
            **{key: metrics[key] for key in CHECK_KEYS}}


def table(result: dict) -> str:
    """docs/LEARNED_REWARDS.md's table: sft and each seed on the held-out check, greedy and sampled,
    the reward model's score, and each seed's gains with their paired standard errors, in points."""
    config = result["config"]
    sft = config["sft"]
    lines = ["| checkpoint | correct (the rows' check) | sampled (T=0.7) | `rm`'s score | "
             "gain ± paired SE | sampled gain ± paired SE |", "|---|---:|---:|---:|---:|---:|",
             f"| `{config['input_id']}` | {100 * sft['accuracy']:.1f} % | {100 * sft['sampled_accuracy']:.1f} % | "
             f"{sft['mean_reward']:.3f} | | |"]
    labelled = [(f"`{rl_id}` (seed {seed['seed']})", seed) for rl_id, seed in zip(config["rl_ids"], result["seeds"])]
    labelled.append((f"`{CONTRAST}`: reward model of the preference pairs, pushed, no KL", result["contrast"]))
    for label, row in labelled:
        lines.append(f"| {label} | {100 * row['accuracy']:.1f} % | {100 * row['sampled_accuracy']:.1f} % | "
                     f"{row['mean_reward']:.3f} | {row['gain']:+.1f} ± {row['paired_se']:.1f} | "
                     f"{row['sampled_gain']:+.1f} ± {row['sampled_paired_se']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    go_offline()
    parser = seeded_parser("learned_rewards", __doc__, "learned-rewards.yaml", "learned_rewards.json")
    parser.add_argument("--contrast-pairs", default="../examples/preferences.jsonl",
                        help="the contrast reward model's preference data, relative to the spec's folder")
    args = parser.parse_args(argv)
    if args.table:
        return printed_table(args.out, table)
    spec, rl_ids, input_id = seeded_spec(yaml.safe_load(Path(args.spec).read_text()), args.seeds)
    spec = with_contrast(spec, args.contrast_pairs)
    summary = run_spec(spec, args.store, spec_dir=Path(args.spec).resolve().parent)
    stages = {stage["id"]: stage for stage in summary["stages"]}
    evaluation = stages[EVAL_ID]["metrics"]
    env = next(iter(evaluation[input_id]))
    seeds = [seed_row(seed, evaluation[rl_id][env]) for seed, rl_id in enumerate(rl_ids)]
    reward_model = next(s for s in spec["stages"] if s["kind"] == "reward_model")["id"]
    result = make_result(
        metric=f"held-out check gain of rl over {input_id} under a learned reward (mean over {args.seeds} seeds)",
        unit="points", ours=round(statistics.mean(s["gain"] for s in seeds), 2), peer=None, peer_name=None,
        config={"spec": Path(args.spec).name, "env": env, "eval_n": evaluation[input_id][env]["n"],
                "input_id": input_id, "rl_ids": rl_ids,
                "sft": {k: evaluation[input_id][env][k] for k in CHECK_KEYS},
                "reward_model_eval_accuracy": stages[reward_model]["metrics"]["eval_accuracy"],
                "contrast_reward_model_eval_accuracy": stages[f"{reward_model}-pairs"]["metrics"]["eval_accuracy"],
                "contrast_rl": CONTRAST_RL,
                "stage_seconds": {s["id"]: s["seconds"] for s in summary["stages"]},
                "command": f"python -m bench.learned_rewards --seeds {args.seeds}"
                           + (f" --store {args.store}" if args.store else "")})
    result["seeds"] = seeds
    result["contrast"] = seed_row(0, evaluation[CONTRAST][env])
    path = write_result(result, args.out)
    gains = ", ".join(f"{seed['gain']:+.1f} ± {seed['paired_se']:.1f}" for seed in seeds)
    print(f"check gain over {input_id}: {gains} points -> {path}")
    return result


if __name__ == "__main__":
    main()
