"""A judge rubric: a model behind an OpenAI-compatible endpoint grades each evaluated answer.

The judge sees the task's prompt, its reference answer and the policy's transcript (fenced: it is
data, tasks/rollout/judge_client.py) and ends its reply with `VERDICT: yes` or `VERDICT: no`. Its
verdict goes beside the verifiable one: rows get `judge` (1.0 yes, 0.0 no, NaN when the request
failed or the reply held no verdict) and `judge_error` (that failure's reason, else None), and the
metrics `judge_accuracy` (share judged correct), `judge_agreement` (share where the judge and the
env's check agree), `judge_errors` and `judge_errors_<reason>`. A failed request is that row's
missing verdict, counted: it never fails the evaluation. Where an env has no programmatic check,
the judge is the grade; where it has one, the agreement says how far the judge can be trusted.
"""

from __future__ import annotations

import math
from collections import Counter

from tasks.config import Judge
from tasks.rollout.judge_client import JudgeClient, JudgeError, JudgeFailure, Question, VerdictForm, error_metrics

JUDGE_PROMPT = ("You grade answers to tasks.\n\nTask:\n{prompt}\n\nReference answer: {answer}\n\n"
                "Response:\n{completion}\n\nIs the response's final answer correct?")


def verdict_question(row: dict) -> Question:
    """What the judge is asked about an evaluated row (what the test judge models are taught on)."""
    return Question.of(JUDGE_PROMPT, VerdictForm(), row["prompt"], row["completion"], row["answer"])


def judge_rows(rows: list[dict], judge: Judge) -> None:
    """Ask the judge about every row (`judge.max_workers` at a time); sets each row's `judge` and
    `judge_error`."""
    client = JudgeClient.of(judge, VerdictForm(), JUDGE_PROMPT, "judge")
    try:
        verdicts = client.judge_all([(row["prompt"], row["completion"], row["answer"]) for row in rows])
    finally:
        client.close()
    for row, verdict in zip(rows, verdicts):
        failed = isinstance(verdict, JudgeError)
        row["judge"] = math.nan if failed else verdict
        row["judge_error"] = verdict.failure.value if failed else None


def judge_metrics(rows: list[dict]) -> dict:
    """The judge's summary over rows that it graded (empty when no judge was asked)."""
    graded = [row for row in rows if "judge" in row]
    if not graded:
        return {}
    judged = [row for row in graded if row["judge_error"] is None]
    failures = Counter(JudgeFailure(row["judge_error"]) for row in graded if row["judge_error"] is not None)
    return {"judge_accuracy": sum(row["judge"] for row in judged) / len(judged) if judged else math.nan,
            "judge_agreement": sum(row["judge"] == float(row["correct"]) for row in judged) / len(judged)
            if judged else math.nan,
            **error_metrics(failures)}
