"""Each seeded defect fails its suite with a message naming the expectation and the offending ids."""

import json
import math

import numpy as np
import pandas as pd
import pytest

from data_contracts.config import ContractConfig, ContractParams
from data_contracts.suites import mask_totals
from data_contracts.validate import data_docs_html, validate
from flows.cli.main import main


def sft_rows(n=6):
    return pd.DataFrame({"id": [f"s{i}" for i in range(n)], "prompt": ["what is 1+1?"] * n,
                         "completion": ["The final answer is 2."] * n, "total_tokens": [40] * n})


def rollout_rows(groups=3, size=4):
    n = groups * size
    return pd.DataFrame({"id": [f"r{i}" for i in range(n)], "prompt_id": [f"p{i // size}" for i in range(n)],
                         "completion": ["The final answer is 2."] * n, "finish_reason": ["stop"] * n,
                         "reward": [0.5] * n, "total_tokens": [50] * n, "loss_mask": [[0, 1, 1]] * n,
                         "env_mask": [[0, 0, 0]] * n})


def pair_rows(n=4):
    return pd.DataFrame({"id": [f"q{i}" for i in range(n)], "prompt": ["what is 1+1?"] * n,
                         "chosen": ["2"] * n, "rejected": ["3"] * n, "chosen_score": [1.0] * n,
                         "rejected_score": [0.0] * n})


def eval_rows(n=4):
    return pd.DataFrame({"checkpoint": ["sft"] * n, "env": ["arith"] * n, "mode": ["greedy"] * n,
                         "task_id": [f"t{i}" for i in range(n)], "completion": ["x"] * n,
                         "finish_reason": ["stop"] * n, "completion_tokens": [3] * n})


ROLLOUTS = ContractParams(kind="rollouts", reward_range=(0.0, 1.0), group_size=4, context_length=64,
                          max_truncated_fraction=0.25)
SFT = ContractParams(kind="sft", context_length=64)
PAIRS = ContractParams(kind="preference", reward_range=(0.0, 1.0))
EVAL = ContractParams(kind="eval")


def failed(frame, params):
    result = validate(frame, params)
    assert not result.success
    return result.message()


def test_clean_datasets_pass():
    for frame, params in ((sft_rows(), SFT), (rollout_rows(), ROLLOUTS), (pair_rows(), PAIRS), (eval_rows(), EVAL)):
        result = validate(frame, params)
        assert result.success, result.message()
        assert result.summary()["expectations"] >= 5


def seeded(frame, column, index, value):
    frame = frame.copy()
    frame[column] = frame[column].astype(object)
    frame.at[index, column] = value
    return frame


@pytest.mark.parametrize("kind,frame,params", [("sft", sft_rows(), SFT), ("rollouts", rollout_rows(), ROLLOUTS)])
def test_null_empty_and_duplicate(kind, frame, params):
    assert "expect_column_values_to_not_be_null(completion): 1 rows, e.g. " in failed(
        seeded(frame, "completion", 2, None), params)
    message = failed(seeded(frame, "completion", 3, "   "), params)
    assert "expect_column_values_to_not_match_regex(completion): 1 rows, e.g. " + frame["id"][3] in message
    duplicated = seeded(frame, "id", 1, frame["id"][0])
    assert f"expect_column_values_to_be_unique(id): 2 rows, e.g. {frame['id'][0]}" in failed(duplicated, params)


def test_missing_column():
    assert "expect_column_to_exist(completion)" in failed(sft_rows().drop(columns=["completion"]), SFT)


def test_token_length_over_the_context():
    assert "expect_column_values_to_be_between(total_tokens): 1 rows, e.g. s4" in failed(
        seeded(sft_rows(), "total_tokens", 4, 65), SFT)
    assert "expect_column_values_to_be_between(total_tokens): 1 rows, e.g. r0" in failed(
        seeded(rollout_rows(), "total_tokens", 0, 1000), ROLLOUTS)


def test_truncated_share_above_the_spec():
    frame = rollout_rows()
    frame.loc[:3, "finish_reason"] = "length"  # 4 of 12 > 25 %
    assert "expect_column_values_to_be_in_set(finish_reason): 4 rows, e.g. r0, r1, r2, r3" in failed(frame, ROLLOUTS)
    frame.loc[:3, "finish_reason"] = "stop"
    frame.loc[:2, "finish_reason"] = "length"  # 3 of 12 = 25 %: allowed
    assert validate(frame, ROLLOUTS).success


def test_blank_share_allowed_by_the_spec():
    """A sampled completion that stops at once is blank; `max_blank_fraction` lets a share of them pass."""
    frame = seeded(seeded(rollout_rows(), "completion", 2, ""), "completion", 7, " ")  # 2 of 12
    assert "expect_column_values_to_not_match_regex(completion): 2 rows, e.g. r2, r7" in failed(frame, ROLLOUTS)
    assert validate(frame, ROLLOUTS.overridden(ContractConfig(max_blank_fraction=0.2))).success
    assert "expect_column_values_to_not_match_regex(completion): 2 rows" in failed(
        frame, ROLLOUTS.overridden(ContractConfig(max_blank_fraction=0.1)))


@pytest.mark.parametrize("bad", [math.inf, -0.5, 1.5, math.nan])
def test_rewards_non_finite_or_out_of_range(bad):
    message = failed(seeded(rollout_rows(), "reward", 5, bad), ROLLOUTS)
    assert "(reward): 1 rows, e.g. r5" in message


def test_group_size_differs_from_the_spec():
    frame = rollout_rows().drop(index=11).reset_index(drop=True)  # group p2 has 3, not 4
    assert "expect_column_values_to_be_in_set(group_size): 3 rows, e.g. r8, r9, r10" in failed(frame, ROLLOUTS)


def test_masks():
    no_completion = seeded(rollout_rows(), "loss_mask", 2, [0, 0, 0])
    assert "expect_column_values_to_be_between(trained_tokens): 1 rows, e.g. r2" in failed(no_completion, ROLLOUTS)
    env_trained = seeded(rollout_rows(), "env_mask", 6, [0, 1, 0])
    assert "expect_column_values_to_be_in_set(env_tokens_trained): 1 rows, e.g. r6" in failed(env_trained, ROLLOUTS)


def test_masks_as_read_back_from_parquet(tmp_path):
    """The gate reads masks back as numpy arrays: the same defects fail the same way."""
    frame = seeded(seeded(rollout_rows(), "loss_mask", 2, [0, 0, 0]), "env_mask", 6, [0, 1, 0])
    frame.to_parquet(tmp_path / "data.parquet", index=False)
    message = failed(pd.read_parquet(tmp_path / "data.parquet"), ROLLOUTS)
    assert "expect_column_values_to_be_between(trained_tokens): 1 rows, e.g. r2" in message
    assert "expect_column_values_to_be_in_set(env_tokens_trained): 1 rows, e.g. r6" in message


def test_masks_that_are_not_numbers_fail_their_rows():
    frame = seeded(rollout_rows(), "loss_mask", 4, ["x", 1])
    assert "expect_column_values_to_be_between(trained_tokens): 1 rows, e.g. r4" in failed(frame, ROLLOUTS)


def test_mask_totals_vectorised_equal_the_row_by_row_sums():
    def totals(*masks):
        trained, env_trained = mask_totals(*masks)
        return trained.tolist(), None if env_trained is None else env_trained.tolist()

    loss = pd.Series([[0, 1, 1], None, [], [True, True], np.array([1, 1, 0])], dtype=object)
    env = pd.Series([[0, 0, 1], [1], [], [False, True], np.array([1, 0, 0])], dtype=object)
    assert totals(loss) == ([2, 0, 0, 2, 2], None)
    assert totals(loss, env) == ([2, 0, 0, 2, 2], [1, 0, 0, 1, 1])
    arrays = pd.Series([np.array([0, 1, 1]), None, np.array([1, 1])], dtype=object)
    assert totals(arrays, pd.Series([np.array([1, 1, 0]), None, np.array([0, 1])], dtype=object)) == (
        [2, 0, 2], [1, 0, 1])
    ragged = pd.Series([[1, 1, 1], [1]], dtype=object)  # env mask shorter than the loss mask: over the shorter
    assert totals(ragged, pd.Series([[0, 1], [1, 1]], dtype=object)) == ([3, 1], [1, 1])
    assert totals(pd.Series([["x"], [1]], dtype=object)) == ([-1, 1], None)
    empty = pd.Series([np.array([], dtype=np.int64), None, np.array([], dtype=np.int64)], dtype=object)
    assert totals(empty, empty) == ([0, 0, 0], [0, 0, 0])  # no mask values at all
    trailing = pd.Series([np.array([1, 1]), np.array([], dtype=np.int64)], dtype=object)
    assert totals(trailing) == ([2, 0], None)  # an empty last row after the values end


def test_blank_text_is_what_pythons_whitespace_class_says():
    """BLANK spells out Python's `\\s` so pandas can run it on Arrow; both engines must agree with `re`."""
    import re

    from data_contracts.suites import BLANK

    spaces = [chr(code) for code in range(0x110000) if re.fullmatch(r"\s", chr(code))]
    assert [c for c in map(chr, range(0x110000)) if re.search(BLANK, c)] == spaces
    texts = ["", " ", "\n\t", "".join(spaces), " a ", "a", "x\n", "\n\u3000", "\u200b", "\x00"]
    expected = [re.fullmatch(r"\s*", text) is not None for text in texts]
    for dtype in ("str", object):
        column = pd.Series(texts, dtype=dtype)
        assert column.str.contains(BLANK).tolist() == expected, dtype


def test_preference_pairs():
    same = seeded(pair_rows(), "rejected", 1, "2")
    assert "expect_column_values_to_be_in_set(chosen_equals_rejected): 1 rows, e.g. q1" in failed(same, PAIRS)
    worse = seeded(pair_rows(), "chosen_score", 2, -0.0)
    worse.at[2, "rejected_score"] = 0.5
    assert "expect_column_pair_values_a_to_be_greater_than_b: 1 rows, e.g. q2" in failed(worse, PAIRS)
    assert "(chosen): 1 rows, e.g. q3" in failed(seeded(pair_rows(), "chosen", 3, ""), PAIRS)


def test_eval_results_duplicates_and_finish_reason():
    duplicated = seeded(eval_rows(), "task_id", 1, "t0")
    assert "expect_compound_columns_to_be_unique: 2 rows, e.g. t0, t0" in failed(duplicated, EVAL)
    assert "(finish_reason): 1 rows, e.g. t3" in failed(seeded(eval_rows(), "finish_reason", 3, "oops"), EVAL)


def test_params_come_from_the_spec_overrides():
    params = ROLLOUTS.overridden(ContractConfig(max_truncated_fraction=0.5, reward_range=(-1, 2), mode="warn"))
    assert params.max_truncated_fraction == 0.5 and params.reward_range == (-1, 2) and params.mode == "warn"
    assert params.group_size == 4 and params.context_length == 64
    with pytest.raises(ValueError, match="low <= high"):
        ContractConfig(reward_range=(1, 0))


def test_data_docs_page_names_the_failed_expectation():
    html = data_docs_html(validate(seeded(sft_rows(), "completion", 0, " "), SFT))
    assert "<html" in html.lower() and "match" in html


def test_contracts_check_cli(tmp_path, capsys):
    good, bad = tmp_path / "good.parquet", tmp_path / "bad.parquet"
    sft_rows().to_parquet(good)
    seeded(sft_rows(), "completion", 1, "").to_parquet(bad)
    assert main(["contracts", "check", str(good), "--kind", "sft"]) == 0
    assert "passed" in capsys.readouterr().out
    assert main(["contracts", "check", str(bad), "--kind", "sft"]) == 1
    assert "expect_column_values_to_not_match_regex(completion): 1 rows, e.g. s1" in capsys.readouterr().out
    assert main(["contracts", "check", str(tmp_path / "none.parquet"), "--kind", "sft"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'none.parquet'}: no such file"
    (tmp_path / "text.parquet").write_text("not parquet")
    assert main(["contracts", "check", str(tmp_path / "text.parquet"), "--kind", "sft"]) == 2
    assert "cannot read as Parquet" in capsys.readouterr().err


DEFECTS = {
    "sft empty completion": (lambda: seeded(sft_rows(), "completion", 1, " "), SFT, "s1"),
    "sft duplicate id": (lambda: seeded(sft_rows(), "id", 2, "s0"), SFT, "s0"),
    "sft over context": (lambda: seeded(sft_rows(), "total_tokens", 3, 999), SFT, "s3"),
    "rollouts null": (lambda: seeded(rollout_rows(), "completion", 4, None), ROLLOUTS, "r4"),
    "rollouts reward": (lambda: seeded(rollout_rows(), "reward", 5, math.inf), ROLLOUTS, "r5"),
    "rollouts group size": (lambda: rollout_rows().drop(index=0).reset_index(drop=True), ROLLOUTS, "r1"),
    "rollouts mask": (lambda: seeded(rollout_rows(), "loss_mask", 7, [0, 0, 0]), ROLLOUTS, "r7"),
    "rollouts env tokens": (lambda: seeded(rollout_rows(), "env_mask", 8, [1, 1, 0]), ROLLOUTS, "r8"),
    "pairs identical": (lambda: seeded(pair_rows(), "rejected", 0, "2"), PAIRS, "q0"),
    "pairs out of range": (lambda: seeded(pair_rows(), "chosen_score", 1, 7.0), PAIRS, "q1"),
    "eval duplicate": (lambda: seeded(eval_rows(), "task_id", 2, "t1"), EVAL, "t1"),
}


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_each_defect_is_quarantined_not_committed(defect, tmp_path):
    from artifacts.store import Store
    from models.config import ModelConfig
    from tasks.common.context import StageContext, StageOutput
    from tasks.common.contract_gate import ContractViolation, check
    from tasks.common.datasets import write_rows

    make_frame, params, offending_id = DEFECTS[defect]
    store = Store(str(tmp_path / "store"))
    ctx = StageContext(store=store, pipeline="p", run_id="run-1", stage_id="gen", cache_key="k", model=ModelConfig(),
                       envs={}, inputs={}, workdir=tmp_path / "work")
    local = tmp_path / "out"
    write_rows(make_frame().to_dict("records"), local)
    with pytest.raises(ContractViolation) as failure:
        check(ctx, StageOutput("dataset", local, {}, params), None)
    assert offending_id in str(failure.value) and "expect_" in str(failure.value)
    quarantined = tmp_path / "store" / "quarantine" / "run-1" / "gen"
    assert (quarantined / "data.parquet").exists() and (quarantined / "contract.html").exists()
    assert not (tmp_path / "store" / "artifacts").exists()


def test_a_passing_dataset_has_its_details_when_asked():
    """A pass asks GX only whether each expectation holds; Data Docs of a passing dataset ask for more."""
    quick, detailed = validate(sft_rows(), SFT), validate(sft_rows(), SFT, detail=True)
    assert quick.success and detailed.success and quick.evaluated == detailed.evaluated
    assert any("observed_value" in (check["result"] or {}) for check in detailed.gx_result["results"])
    assert not any(check["result"] for check in quick.gx_result["results"])
    assert "expect_table_row_count_to_be_between" in json.dumps(detailed.gx_result)
