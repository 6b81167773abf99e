"""The GRPO benchmark runs on a tiny setting and writes a well-formed DESIGN §10 result (no timing checks)."""

import json

from bench.common import RESULT_KEYS, TRAIN_WARMUP_STEPS


def test_grpo_vs_trl_writes_a_well_formed_result(tmp_path):
    from bench import grpo_vs_trl

    steps = TRAIN_WARMUP_STEPS + 1
    out = tmp_path / "g.json"
    result = grpo_vs_trl.main(["--steps", str(steps), "--max-tokens", "8", "--sft-steps", "2", "--runs", "1",
                               "--peer-decoding", "static", "--no-wait", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert tuple(result) == RESULT_KEYS and result["unit"] == "tokens/s" and result["higher_is_better"] is True
    assert result["peer_name"].startswith("trl ") and result["peer_name"].endswith(" GRPOTrainer")
    assert result["ours"] > 0 and result["peer"] > 0 and result["ratio"] == result["ours"] / result["peer"]
    assert isinstance(result["machine"], dict) and "torch_threads" in result["machine"]

    config = result["config"]
    assert config["settings"]["steps"] == steps and config["settings"]["max_tokens"] == 8
    assert config["settings"]["sft_steps"] == 2 and config["start"].startswith("tiny-llama after 2 SFT steps")
    assert config["completions_per_step"] == 64
    for side in ("ours", "peer"):
        figures = config[side]
        assert figures["steps"] == steps and len(figures["reward_curve"]) == steps
        assert all(0.0 <= r <= 1.2 for r in figures["reward_curve"])
        assert len(figures["step_tokens"]) == steps and figures["completion_tokens"] == sum(figures["step_tokens"])
        assert 0 < figures["mean_completion_tokens"] <= 8  # at most max_tokens per completion
        assert 0 < figures["timed_tokens"] < figures["completion_tokens"]
        assert figures["end_to_end"]["completion_tokens_per_second"] > 0
        assert {"reward_first_quarter", "reward_last_quarter"} <= set(figures)
        # the headline is end to end; each step's time split into rollout and update
        assert result[side] == figures["end_to_end_runs"]["median"] \
            == figures["end_to_end"]["completion_tokens_per_second"]
        assert len(figures["rollout_seconds"]) == len(figures["update_seconds"]) == steps
        assert all(seconds > 0 for seconds in figures["rollout_seconds"] + figures["update_seconds"])
        assert figures["seconds_per_step"]["rollout"] > 0 and figures["seconds_per_step"]["update"] > 0
    stage, peer_args = config["ours"]["stage"], config["peer"]["trl_args"]
    assert stage["loss_aggregation"] == peer_args["loss_type"] == "dapo" and stage["beta"] == peer_args["beta"] == 0
    assert stage["group_size"] == peer_args["num_generations"] == 8
    assert stage["max_tokens"] == peer_args["max_completion_length"] == 8
    assert peer_args["bf16"] is False and peer_args["gradient_checkpointing"] is False
    assert peer_args["use_vllm"] is False and peer_args["shuffle_dataset"] is False
    assert config["peer"]["resolved"]["steps_per_generation"] == 1  # one optimizer step per generation batch
    assert config["peer"]["prompt_ids_identical_to_ours"] is True
    assert config["peer"]["reward_and_length_match_trl_log"] is True
    assert config["peer"]["resolved_config"]["num_generations"] == 8 and config["repeats"]["runs_per_side"] == 1
    # TRL's decoding setting as asked (auto would try each on a short run and keep the fastest)
    assert config["peer_decoding"]["chosen"] == "static" == config["peer"]["resolved_config"]["cache_implementation"]
