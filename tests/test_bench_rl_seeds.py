"""bench/rl_seeds.py on a tiny spec: one rl stage per seed, one evaluation over all of them."""

import json

import pytest
import yaml

from bench.common import RESULT_KEYS
from tests.e2e.helpers import tiny_spec


def test_rl_seeds_writes_the_gain_of_every_seed(tmp_path, shared_prefect_api):
    from bench import rl_seeds

    spec = tiny_spec(f"file://{tmp_path / 'store'}")
    spec["stages"].insert(2, {"id": "rl", "kind": "rl", "policy": "sft", "envs": {"arith": 1.0}, "steps": 2,
                              "prompts_per_step": 2, "group_size": 2, "max_tokens": 8})
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "rl_seeds.json"
    result = rl_seeds.main(["--spec", str(path), "--seeds", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == result and tuple(result) == RESULT_KEYS
    config = result["config"]
    assert list(config["seeds"]) == ["rl", "rl-seed1"] and len(config["gain_points"]) == 2
    assert result["unit"] == "points" and result["peer"] is None and result["ratio"] is None
    gains = [100 * (m["accuracy"] - config["input"]["accuracy"]) for m in config["seeds"].values()]
    assert result["ours"] == pytest.approx(sum(gains) / 2, abs=0.01) and config["eval_n"] == 16
    for seed in config["seeds"].values():  # each seed paired with the input on the same tasks
        assert seed["paired_gain"] == pytest.approx(seed["accuracy"] - config["input"]["accuracy"], abs=1e-3)
        assert seed["sampled_paired_gain"] == pytest.approx(
            seed["sampled_accuracy"] - config["input"]["sampled_accuracy"], abs=1e-3)
        assert seed["paired_se"] >= 0 and seed["sampled_paired_se"] >= 0
    printed = rl_seeds.table(result).splitlines()
    assert printed[2].startswith("| `sft` (the input) | ") and printed[3].startswith("| `rl` | ") and len(printed) == 5
    seed = config["seeds"]["rl-seed1"]
    assert printed[4].endswith(f"| {100 * seed['paired_gain']:+.1f} ± {100 * seed['paired_se']:.1f} | "
                               f"{100 * seed['sampled_paired_gain']:+.1f} ± {100 * seed['sampled_paired_se']:.1f} |")


def test_rl_async_writes_both_sides_and_the_staleness(tmp_path, shared_prefect_api):
    from bench import rl_async

    spec = tiny_spec(f"file://{tmp_path / 'store'}")
    spec["stages"].insert(2, {"id": "rl", "kind": "rl", "policy": "sft", "envs": {"arith": 1.0}, "steps": 3,
                              "prompts_per_step": 2, "group_size": 2, "max_tokens": 8})
    spec["evaluation"] = {"on_new_checkpoint": True, "stages": ["rl"]}  # as the quickstart's: names the rl stage
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "rl_async.json"
    result = rl_async.main(["--spec", str(path), "--runs", "1", "--no-wait", "--out", str(out)])
    assert json.loads(out.read_text()) == result and tuple(result) == RESULT_KEYS
    runs = result["config"]["runs"]
    assert runs["lockstep"][0]["staleness_histogram"] == {"0": 12}  # 3 steps of 4 episodes
    assert runs["asynchronous"][0]["staleness_histogram"] == {"0": 4, "1": 8}  # ahead by one after the first
    assert result["ratio"] == pytest.approx(result["peer"] / result["ours"], rel=1e-3)
    assert all(r["held_out_n"] == 16 and r["steps"] == 3 for side in runs.values() for r in side)


def test_agentic_seeds_evaluates_what_the_rl_input_was_trained_from():
    from bench import agentic_seeds

    spec = {"stages": [{"id": "sft", "kind": "sft"}, {"id": "align", "kind": "preference", "policy": "sft"},
                       {"id": "rl", "kind": "rl", "policy": "align"},
                       {"id": "final-eval", "kind": "evaluate", "checkpoints": ["align", "rl"], "baseline": "align"}]}
    seeded, rl_ids, input_id = agentic_seeds.seeded_spec(spec, 3)
    assert rl_ids == ["rl", "rl-seed1", "rl-seed2"] and input_id == "align"
    assert seeded["stages"][-1]["checkpoints"] == ["sft", "align", *rl_ids] and seeded["stages"][-1]["baseline"] == "align"


def test_agentic_seeds_writes_every_seed_against_the_rl_input_and_prints_the_table(tmp_path, shared_prefect_api,
                                                                                   capsys):
    from bench import agentic_seeds

    spec = tiny_spec(f"file://{tmp_path / 'store'}")
    spec["envs"]["packs"] = {"kind": "cod", "pack_size": 2, "eval_pack_size": 2}
    spec["stages"].insert(2, {"id": "rl", "kind": "rl", "policy": "sft", "envs": {"arith": 1.0}, "steps": 2,
                              "prompts_per_step": 2, "group_size": 2, "max_tokens": 8})
    spec["stages"][-1].update(checkpoints=["sft", "rl"], envs=["packs", "arith"], n=8, sampled=None)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "agentic_seeds.json"
    result = agentic_seeds.main(["--spec", str(path), "--seeds", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == result and tuple(result)[:len(RESULT_KEYS)] == RESULT_KEYS
    assert list(result["envs"]) == ["cod", "arith"]  # the evaluation's order, whatever order its metrics come in
    assert result["config"]["seeds"] == ["rl", "rl-seed1"] and result["config"]["cached"] == []
    for row in result["envs"].values():
        assert row["n"] == 8 and set(row) == {"n", "sft", "rl", "paired_se", "paired_gain"}
        assert len(row["rl"]) == len(row["paired_se"]) == 2 and row["sft"][0] == row["sft"][1]
        assert all(0 <= rate <= 1 for rate in row["rl"]) and all(se >= 0 for se in row["paired_se"])
        assert [round(rl - row["sft"][0], 4) for rl in row["rl"]] == row["paired_gain"]
    positions = result["cod_by_position"]
    assert len(positions["rl"]) == len(positions["sft"]) == 2  # the eval packs' positions
    capsys.readouterr()
    agentic_seeds.main(["--out", str(out), "--table"])
    printed = capsys.readouterr().out
    assert printed.startswith("| env | held-out episodes | sft |") and "| cod | 8 |" in printed


def test_learned_rewards_rows_and_table_from_an_evaluations_metrics():
    """bench/learned_rewards.py's results rows (gains in points, paired with sft) and its docs table."""
    from bench import learned_rewards

    metrics = {"accuracy": 0.8, "sampled_accuracy": 0.6, "doom_loop_rate": 0.0, "mean_reward": 0.71,
               "paired_gain": 0.0889, "paired_se": 0.0321, "sampled_paired_gain": 0.1, "sampled_paired_se": 0.05}
    row = learned_rewards.seed_row(2, metrics)
    assert row == {"seed": 2, "gain": 8.89, "paired_se": 3.21, "sampled_gain": 10.0, "sampled_paired_se": 5.0,
                   "accuracy": 0.8, "sampled_accuracy": 0.6, "doom_loop_rate": 0.0, "mean_reward": 0.71}
    result = {"seeds": [row], "contrast": {**row, "gain": -20.0}, "config": {
        "input_id": "sft", "rl_ids": ["rl-seed2"],
        "sft": {"accuracy": 0.7111, "sampled_accuracy": 0.5, "doom_loop_rate": 0.0, "mean_reward": 0.6}}}
    assert learned_rewards.table(result).splitlines()[2:] == [
        "| `sft` | 71.1 % | 50.0 % | 0.600 | | |",
        "| `rl-seed2` (seed 2) | 80.0 % | 60.0 % | 0.710 | +8.9 ± 3.2 | +10.0 ± 5.0 |",
        "| `rl-contrast`: reward model of the preference pairs, pushed, no KL | 80.0 % | 60.0 % | 0.710 | "
        "-20.0 ± 3.2 | +10.0 ± 5.0 |"]


def test_learned_rewards_contrast_trains_on_the_preference_pairs_and_holds_out_the_same_prompts():
    """The contrast's reward model reads the user's pairs (no rollouts), its env holds out what the
    shipped env holds out, and its rl stage is pushed without a KL, evaluated with the seeds."""
    from bench import learned_rewards
    from bench.rl_seeds import EVAL_ID, seeded_spec
    from conftest import ROOT

    shipped = yaml.safe_load((ROOT / "pipelines" / "learned-rewards.yaml").read_text())
    spec = learned_rewards.with_contrast(seeded_spec(shipped, 2)[0], "../examples/preferences.jsonl")
    stages = {stage["id"]: stage for stage in spec["stages"]}
    assert stages["rm-pairs"]["data"] == "contrast-pairs" and "rollout_pairs" not in stages["rm-pairs"]
    assert stages["contrast-pairs"]["source"] == "../examples/preferences.jsonl"
    env = spec["envs"]["sums-pairs"]
    assert env["held_out_as"] == "sums" and {"reward_model": "rm-pairs", "weight": 1.0} in env["rewards"]
    assert stages["rl-contrast"]["envs"] == {"sums-pairs": 1.0} and stages["rl-contrast"]["beta"] == 0.0
    assert stages[EVAL_ID]["checkpoints"] == ["sft", "rl", "rl-seed1", "rl-contrast"]
    assert spec["stages"][-1]["id"] == EVAL_ID


def test_agentic_fresh_run_seconds_only_from_a_run_that_found_nothing_cached():
    from bench import agentic_seeds

    fresh = {"stages": [{"id": "warm-term", "state": "completed"}, {"id": "rl", "state": "completed"}]}
    assert agentic_seeds.fresh_run_seconds(fresh, 1415.67) == 1415.7
    reused = {"stages": [{"id": "warm-term", "state": "cached"}, {"id": "rl", "state": "completed"}]}
    with pytest.raises(SystemExit, match="--fresh-run: the store already held 1 of the spec's stages "
                                         r"\(warm-term, ...\); give an empty --store"):
        agentic_seeds.fresh_run_seconds(reused, 12.0)
