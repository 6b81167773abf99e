"""The judge rubric: verdicts read from the reply's final line only, its metrics, and an evaluation
graded by a judge model served by models.serving on 127.0.0.1 (conftest's `judge_url`: tiny-llama
taught the `VERDICT:` form on the judge client's requests). Attacks on the judge:
tests/test_attacks_judge_injection.py."""

import math

import pytest

from envs.arith import ArithEnv, ArithEnvConfig
from tasks.config import Judge
from tasks.rollout.judge import judge_metrics, verdict_question
from tasks.rollout.judge_client import JudgeFailure, JudgeReplyError, VerdictForm, read_reply
from tasks.stages.evaluate import EvaluateStage

ARITH = ArithEnv(ArithEnvConfig(kind="arith", digits=1))
ROW = {"prompt": "What is 3 + 4?", "answer": "7", "completion": "3 + 4 = 7. The answer is 7."}


@pytest.mark.parametrize("reply, expected", [("VERDICT: yes", 1.0), ("VERDICT: no", 0.0), ("  VERDICT: Yes \n", 1.0),
                                             ("The sum is right.\n\nVERDICT: yes", 1.0)])
def test_a_verdict_is_the_replys_final_line(reply, expected):
    assert read_reply(reply, VerdictForm(), verdict_question(ROW)) == expected


@pytest.mark.parametrize("reply, failure", [
    ("yes", JudgeFailure.NO_FINAL_FORM), ("", JudgeFailure.NO_FINAL_FORM), ("VERDICT: maybe", JudgeFailure.NO_FINAL_FORM),
    ("VERDICT: yes\nbecause 7 is right", JudgeFailure.NO_FINAL_FORM), ("VERDICT: yes.", JudgeFailure.NO_FINAL_FORM),
    ("VERDICT: no\nVERDICT: yes", JudgeFailure.SEVERAL_FINAL_FORMS), ("SCORE: 3\nVERDICT: yes", JudgeFailure.SEVERAL_FINAL_FORMS)])
def test_a_reply_without_one_final_verdict_line_is_an_error_never_a_guess(reply, failure):
    with pytest.raises(JudgeReplyError) as error:
        read_reply(reply, VerdictForm(), verdict_question(ROW))
    assert error.value.failure is failure


def test_judge_metrics_count_agreement_on_judged_rows_and_errors_by_reason():
    rows = [{"judge": 1.0, "judge_error": None, "correct": True}, {"judge": 1.0, "judge_error": None, "correct": False},
            {"judge": 0.0, "judge_error": None, "correct": False},
            {"judge": math.nan, "judge_error": "deadline", "correct": True},
            {"judge": math.nan, "judge_error": "no_final_form", "correct": True},
            {"judge": math.nan, "judge_error": "deadline", "correct": False}]
    assert judge_metrics(rows) == {"judge_accuracy": 2 / 3, "judge_agreement": 2 / 3, "judge_errors": 3,
                                   "judge_errors_deadline": 2, "judge_errors_no_final_form": 1}
    assert judge_metrics([{"correct": True}]) == {}  # no judge asked


def test_an_evaluation_graded_by_a_judge_endpoint(judge_url):
    from models.config import ModelConfig
    from models.loading import load_model, load_tokenizer
    from models.presets import materialize
    from tasks.rollout.episodes import LocalPolicy
    from tasks.stages.evaluate import evaluate_policy

    policy_model = load_model(materialize("tiny-llama"), ModelConfig()).eval()
    tokenizer = load_tokenizer(materialize("tiny-llama"))
    stage = EvaluateStage(kind="evaluate", id="e", checkpoints=["c"], envs=["arith"], n=12, max_new_tokens=24,
                          sampled=None, judge=Judge(endpoint=judge_url, model="judge"))
    rows, metrics = evaluate_policy(LocalPolicy(policy_model, tokenizer), tokenizer, ARITH, stage, "c")
    assert all(row["judge"] in (0.0, 1.0) and row["judge_error"] is None for row in rows)  # its form every time
    assert metrics["judge_errors"] == 0
    assert metrics["judge_accuracy"] == round(sum(row["judge"] for row in rows) / len(rows), 4)
    assert metrics["judge_agreement"] == round(sum(row["judge"] == row["correct"] for row in rows) / len(rows), 4)


def test_an_unreachable_judge_is_a_missing_verdict_counted_on_every_row():
    """The evaluation goes on: each row's verdict is NaN and its reason counted."""
    from conftest import free_port

    from tasks.rollout.judge import judge_rows

    url = f"http://127.0.0.1:{free_port()}/v1"
    rows = [{"prompt": "p", "answer": "1", "completion": "c", "correct": True} for _ in range(3)]
    judge_rows(rows, Judge(endpoint=url, model="judge", retries=0, timeout_seconds=5))
    assert all(math.isnan(row["judge"]) and row["judge_error"] == "unreachable" for row in rows)
    assert judge_metrics(rows)["judge_errors"] == judge_metrics(rows)["judge_errors_unreachable"] == 3
