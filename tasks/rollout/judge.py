"""A judge rubric: a model behind an OpenAI-compatible endpoint grades each evaluated answer.

The judge sees the task's prompt, its reference answer and the policy's transcript and answers
yes or no. Its verdict goes beside the verifiable one: rows get `judge` (1.0 yes, 0.0 no, NaN
when the judge answered neither: counted, never a silent 0), and the metrics `judge_accuracy`
(share judged correct), `judge_agreement` (share where the judge and the env's check agree) and
`judge_unparsed`. Where an env has no programmatic check, the judge is the grade; where it has
one, the agreement says how far the judge can be trusted.
"""

from __future__ import annotations

import math
import re
from concurrent.futures import ThreadPoolExecutor

from models.sampling import SamplingParams

JUDGE_PROMPT = ("You grade answers to tasks.\n\nTask:\n{prompt}\n\nReference answer: {answer}\n\n"
                "Response:\n{completion}\n\nIs the response's final answer correct? Reply yes or no.")
_FIRST_WORD = re.compile(r"[a-z]+")


def judge_prompt(row: dict) -> str:
    return JUDGE_PROMPT.format(prompt=row["prompt"], answer=row["answer"], completion=row["completion"])


def verdict(text: str) -> float:
    """1.0 for a reply starting with yes, 0.0 for no, NaN for anything else."""
    word = _FIRST_WORD.search(text.strip().lower())
    return {"yes": 1.0, "no": 0.0}.get(word.group(0) if word else "", math.nan)


def judge_rows(rows: list[dict], judge, tokenizer, max_workers: int = 4) -> None:
    """Ask the judge about every row (greedy, `judge.max_tokens`); sets each row's `judge`."""
    from tasks.rollout.endpoint_policy import EndpointPolicy

    policy = EndpointPolicy.of(judge, tokenizer, "judge")
    params = SamplingParams(judge.max_tokens)
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        replies = list(pool.map(lambda row: policy.complete(judge_prompt(row), params), rows))
    for row, reply in zip(rows, replies):
        row["judge"] = verdict(reply)


def judge_metrics(rows: list[dict]) -> dict:
    """The judge's summary over rows that it graded (empty when no judge was asked)."""
    graded = [row for row in rows if "judge" in row]
    if not graded:
        return {}
    parsed = [row for row in graded if not math.isnan(row["judge"])]
    return {"judge_accuracy": sum(row["judge"] for row in parsed) / len(parsed) if parsed else math.nan,
            "judge_agreement": sum(row["judge"] == float(row["correct"]) for row in parsed) / len(parsed)
            if parsed else math.nan,
            "judge_unparsed": len(graded) - len(parsed)}
