"""The benchmark script runs on a tiny setting and writes a well-formed DESIGN §10 result (no timing checks)."""

import json

import pytest

from bench.common import RESULT_KEYS


def test_sft_vs_trl_writes_a_well_formed_result(tmp_path):
    from bench import sft_vs_trl

    out = tmp_path / "r.json"
    # two runs a side, interleaved; no waiting for a quiet machine (the tests load it)
    returned = sft_vs_trl.main(["--steps", "4", "--batch-size", "4", "--runs", "2", "--no-wait", "--out", str(out)])
    result = json.loads(out.read_text())

    assert result == returned
    assert tuple(result) == RESULT_KEYS
    assert result["metric"] == "train tokens/s" and result["unit"] == "tokens/s"
    assert result["higher_is_better"] is True
    assert result["peer_name"].startswith("trl ") and result["peer_name"].endswith(" SFTTrainer")
    assert isinstance(result["ours"], float) and result["ours"] > 0
    assert isinstance(result["peer"], float) and result["peer"] > 0
    assert result["ratio"] == result["ours"] / result["peer"]
    assert isinstance(result["config"], dict) and isinstance(result["machine"], dict)
    for key in ("cpu_count", "torch_threads", "torch_version", "platform", "date"):
        assert key in result["machine"]

    config = result["config"]
    assert config["settings"]["steps"] == 4 and config["settings"]["batch_size"] == 4
    for side in ("ours", "peer"):
        assert config[side]["timed_tokens"] > 0
        assert isinstance(config[side]["final_loss"], float)
    peer_args = config["peer"]["trl_args"]
    assert peer_args["bf16"] is False and peer_args["gradient_checkpointing"] is False
    assert config["peer"]["resolved"]["completion_only_loss"] is True
    # Same batches on both sides: the same token ids, and so the same token counts
    assert config["peer"]["token_ids_identical_to_ours"] is True
    assert config["ours"]["timed_tokens"] == config["peer"]["timed_tokens"]
    assert config["peer"]["resolved"]["loss_type"] == "nll" == config["peer"]["resolved_config"]["loss_type"]
    # the headline is each side's median over its runs, with every run kept
    assert config["repeats"]["runs_per_side"] == 2 and config["repeats"]["quiet"]["skipped"] is True
    for side in ("ours", "peer"):
        runs = config[side]["tokens_per_second_runs"]
        assert len(runs["runs"]) == 2 and runs["min"] <= result[side] == runs["median"] <= runs["max"]
    assert len(config["ratio_runs"]["runs"]) == 2


def test_overhead_writes_a_well_formed_result(tmp_path, shared_prefect_api):
    from bench import overhead
    from tests.e2e.helpers import tiny_spec, write

    spec = write(tmp_path, tiny_spec("file://unused"))
    result = overhead.main(["--spec", str(spec), "--runs", "1", "--no-wait", "--out", str(tmp_path / "o.json")])
    assert json.loads((tmp_path / "o.json").read_text()) == result
    assert tuple(result) == RESULT_KEYS and result["unit"] == "%" and result["higher_is_better"] is False
    assert result["peer"] is None and result["ratio"] is None
    config = result["config"]
    assert set(config["stages"]) == {"warmup", "sft", "final-eval"}
    assert 0 < config["compute_seconds"] < config["wall_seconds"]
    assert result["ours"] == config["overhead_percent"] == pytest.approx(
        (config["wall_seconds"] - config["compute_seconds"]) / config["wall_seconds"] * 100, abs=0.05)
    # the overhead in its parts: around the flow, around each stage, and between stages
    assert sum(config["parts_seconds"].values()) + config["compute_seconds"] == pytest.approx(config["wall_seconds"],
                                                                                              abs=0.05)


def test_overhead_counts_inline_evaluations_as_compute_not_overhead():
    from bench.overhead import timing

    summary = {"seconds": 90.0,
               "stages": [{"id": "sft", "seconds": 52.0, "compute_seconds": 50.0, "outputs": {"checkpoint": "t/sft@1"}},
                          {"id": "rl", "seconds": 23.0, "compute_seconds": 20.0, "outputs": {"checkpoint": "t/rl@2"}}],
               "evaluations": [{"checkpoint": "t/rl.step-5@3", "state": "completed", "compute_seconds": 6.0},
                               {"checkpoint": "t/rl@2", "state": "completed", "compute_seconds": 6.0}]}
    result = timing(100.0, summary)
    assert result["compute_seconds"] == 82.0 and result["overhead_percent"] == 18.0
    assert result["evaluations_compute_seconds"] == {"t/rl.step-5@3": 6.0, "t/rl@2": 6.0}
    assert result["stages"]["rl"]["outputs"] == {"checkpoint": "t/rl@2"}
    # 10 s around the flow, 5 s around the stages' functions, 3 s of the flow's own (evaluation flows included)
    assert result["parts_seconds"] == {"fixed": 10.0, "per_stage": 5.0, "flow_between_stages": 3.0}


def test_contracts_bench_writes_a_well_formed_result(tmp_path):
    from bench import contracts

    result = contracts.main(["--rows", "2000", "--runs", "2", "--no-wait", "--out", str(tmp_path / "c.json")])
    assert json.loads((tmp_path / "c.json").read_text()) == result
    assert tuple(result) == RESULT_KEYS and result["unit"] == "rows/s" and result["ours"] > 0
    assert result["config"]["rows"] == 2000 and result["config"]["expectations"] >= 10
    assert len(result["config"]["rows_per_second_runs"]["runs"]) == 2


def test_dpo_vs_trl_writes_a_well_formed_result(tmp_path):
    from bench import dpo_vs_trl

    out = tmp_path / "d.json"
    result = dpo_vs_trl.main(["--steps", "5", "--batch-size", "4", "--pairs", "equal,looping", "--runs", "1",
                              "--no-wait", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert tuple(result) == RESULT_KEYS and result["unit"] == "tokens/s"
    assert result["peer_name"].startswith("trl ") and result["peer_name"].endswith(" DPOTrainer")
    assert result["ours"] > 0 and result["peer"] > 0 and result["ratio"] == result["ours"] / result["peer"]
    config = result["config"]
    peer_args = config["peer"]["trl_args"]
    assert peer_args["precompute_ref_log_probs"] is True and peer_args["loss_type"] == ["sigmoid"]
    assert peer_args["bf16"] is False and peer_args["gradient_checkpointing"] is False
    # the same pairs, token for token, and the same reference log-probs on both sides
    assert config["peer"]["token_ids_identical_to_ours"] is True
    assert config["peer"]["reference_logps_match_ours"] is True
    assert config["ours"]["timed_tokens"] == config["peer"]["timed_tokens"] > 0
    # the headline pairs are equal in length; the looping ones (the older data) stay as a second case
    assert config["data"]["shape"] == "equal"
    assert config["data"]["mean_rejected_tokens"] == config["data"]["mean_chosen_tokens"]
    looping = config["cases"]["looping"]
    assert looping["data"]["mean_rejected_tokens"] > looping["data"]["mean_chosen_tokens"]
    assert looping["ratio"] == round(looping["ours_median"] / looping["peer_median"], 4)
    assert looping["ours_median"] == looping["ours"]["tokens_per_second_runs"]["median"]
    assert looping["peer"]["token_ids_identical_to_ours"] is True


def test_scale_writes_a_well_formed_result(tmp_path):
    from bench import scale

    out = tmp_path / "s.json"
    result = scale.main(["--tiny", "--in-process", "--rows", "2", "--seq-len", "24", "--prompt-len", "8",
                         "--new-tokens", "3", "--threads", "1", "--no-wait", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert tuple(result)[:len(RESULT_KEYS)] == RESULT_KEYS
    assert result["unit"] == "GB" and result["higher_is_better"] is False
    assert result["peer"] is None and result["ratio"] is None
    assert result["metric"] == "lfm2-350m LoRA rl step peak RSS"
    assert set(result["models"]) == {"lfm2-350m", "qwen3-0.6b"}
    for name, rows in result["models"].items():
        assert set(rows) == {"sft", "preference", "rl", "generate"}
        for row in rows.values():
            assert row["peak_rss_gb"] > 0 and row["seconds"] > 0 and row["tokens_per_second"] > 0
        assert rows["sft"]["tokens"] == 2 * 24 and rows["preference"]["tokens"] == 2 * 2 * 24
        assert rows["rl"]["tokens"] == 2 * 24 and rows["rl"]["trained_tokens"] == 2 * 16
        assert rows["generate"]["tokens"] == 2 * 3  # no end token: every prompt decodes the whole budget
        assert result["config"]["models"][name]["lora_modules"] > 0
    assert result["ours"] == result["models"]["lfm2-350m"]["rl"]["peak_rss_gb"]
    assert result["aim"]["rl_peak_rss_gb_below"] == 6.0 and isinstance(result["aim"]["met"], bool)
    assert result["aim"]["at_aim_settings"] is False  # tiny configs, rows in one process


def test_serve_batching_writes_a_well_formed_result(tmp_path):
    from bench import serve_batching

    out = tmp_path / "serve_batching.json"
    result = serve_batching.main(["--runs", "1", "--requests", "4", "--clients", "2", "--no-wait", "--out", str(out)])
    assert json.loads(out.read_text()) == result and tuple(result) == RESULT_KEYS
    config = result["config"]
    assert [r["tokens"] for r in config["runs"]["sequential"]] == [r["tokens"] for r in config["runs"]["concurrent"]]
    assert result["ratio"] == result["ours"] / result["peer"] and config["ratio_runs"]["median"] > 0
