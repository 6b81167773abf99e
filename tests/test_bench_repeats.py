"""bench/repeats.py: waiting for a quiet machine, interleaved runs, medians with their spread (toy
clocks and loads, no timing)."""

import pytest

from bench import repeats


class FakeMachine:
    """A load average that reads from a list, and a clock that moves only when the bench sleeps."""

    def __init__(self, loads: list[float]):
        self.loads, self.now, self.slept = list(loads), 0.0, 0

    def load(self) -> float:
        return self.loads.pop(0) if len(self.loads) > 1 else self.loads[0]

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += 1

    def clock(self) -> float:
        return self.now


def wait(machine: FakeMachine, no_wait: bool = False) -> dict:
    return repeats.wait_for_quiet(no_wait, load=machine.load, sleep=machine.sleep, clock=machine.clock)


def test_a_bench_waits_until_the_load_falls_below_half_a_core():
    machine = FakeMachine([1.7, 0.9, 0.49])
    quiet = wait(machine)
    assert machine.slept == 2 and quiet == {"load_average_1m": 0.49, "waited_seconds": 10.0, "threshold": 0.5,
                                            "skipped": False}


def test_a_machine_that_stays_busy_is_refused_with_one_line(capsys):
    machine = FakeMachine([2.0])
    with pytest.raises(SystemExit) as exit_info:
        wait(machine)
    assert exit_info.value.code == 2 and machine.now == repeats.QUIET_WAIT_SECONDS
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "the machine stayed busy (1-minute load average 2.00, not below 0.5 within 180 s)" in err


def test_no_wait_starts_at_once_and_records_the_load():
    machine = FakeMachine([3.0])
    assert wait(machine, no_wait=True) == {"load_average_1m": 3.0, "waited_seconds": 0.0, "threshold": 0.5,
                                           "skipped": True}
    assert machine.slept == 0


def test_the_sides_run_in_turn():
    order = []
    results = repeats.interleaved({"ours": lambda: order.append("ours") or len(order),
                                   "peer": lambda: order.append("peer") or len(order)}, 3)
    assert order == ["ours", "peer"] * 3
    assert results == {"ours": [1, 3, 5], "peer": [2, 4, 6]}


def test_median_spread_and_paired_ratios():
    assert repeats.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "runs": [3.0, 1.0, 2.0]}
    assert repeats.median_index([3.0, 1.0, 2.0]) == 2
    assert repeats.median_index([4.0, 1.0]) == 1  # an even count: the lower middle run stands for the side
    assert repeats.paired_ratios([2.0, 3.0, 4.0], [1.0, 3.0, 2.0])["runs"] == [2.0, 1.0, 2.0]


def test_make_bench_names_one_benchmark_or_refuses_an_unknown_one(capsys):
    from bench.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["grpo_vs_trl", "gpro_vs_trl"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("bench: no benchmark 'gpro_vs_trl'; one of: sft_vs_trl, ")


def test_dpo_bench_refuses_an_unknown_pair_shape(capsys):
    from bench import dpo_vs_trl

    with pytest.raises(SystemExit) as exit_info:
        dpo_vs_trl.main(["--pairs", "equal,long", "--no-wait"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("bench.dpo_vs_trl: --pairs 'equal,long': comma-separated, each one of "
                                       "equal, looping\n")


def test_equal_length_pairs_have_as_many_tokens_on_both_sides():
    from bench.dpo_vs_trl import make_pairs
    from models.loading import load_tokenizer
    from models.presets import materialize

    tokenizer = load_tokenizer(materialize("tiny-llama"))
    pairs = make_pairs(tokenizer, 64, 0, 256, "equal")
    assert [len(c.input_ids) for c in pairs.chosen] == [len(r.input_ids) for r in pairs.rejected]
    assert all(t["chosen"] != t["rejected"] for t in pairs.texts)
    looping = make_pairs(tokenizer, 64, 0, 256, "looping")
    assert sum(len(r.input_ids) for r in looping.rejected) > sum(len(c.input_ids) for c in looping.chosen)


def test_the_readme_table_is_read_from_the_result_files(tmp_path):
    import json

    from bench.table import table

    result = {"metric": "train tokens/s", "unit": "tokens/s", "higher_is_better": True, "ours": 13706.3,
              "peer": 12033.7, "peer_name": "trl 1.16.0 SFTTrainer", "ratio": 1.139,
              "config": {"ratio_runs": {"median": 1.127, "min": 1.0516, "max": 1.2547, "runs": []},
                         "repeats": {"runs_per_side": 3}},
              "machine": {"date": "2026-12-02T08:52:00+00:00"}}
    (tmp_path / "sft_vs_trl.json").write_text(json.dumps(result))
    (tmp_path / "contracts.json").write_text(json.dumps(
        {**result, "metric": "contract validation throughput", "unit": "rows/s", "ours": 84002.3, "peer": None,
         "peer_name": None, "ratio": None, "config": {}}))
    lines = table(tmp_path).splitlines()
    assert lines[2] == ("| `sft_vs_trl` | train tokens/s | 13,706 | 12,034 trl 1.16.0 SFTTrainer | 1.14 (1.05–1.25) "
                        "| 3 | 2026-12-02 |")
    assert lines[3] == "| `contracts` | contract validation throughput | 84,002 rows/s | – | – | 1 | 2026-12-02 |"
