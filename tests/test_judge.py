"""The judge rubric: verdict parsing, its metrics, and an evaluation graded by a judge model served
by models.serving on 127.0.0.1 (conftest's `judge_url`: tiny-llama taught the yes/no format on judge prompts)."""

import math

import pytest

from envs.arith import ArithEnv, ArithEnvConfig
from tasks.config import Judge
from tasks.rollout.judge import judge_metrics, verdict
from tasks.stages.evaluate import EvaluateStage

ARITH = ArithEnv(ArithEnvConfig(kind="arith", digits=1))


@pytest.mark.parametrize("reply, expected", [("yes", 1.0), ("Yes.", 1.0), (" YES, it is 42", 1.0), ("no", 0.0),
                                             ("No: 41 is wrong", 0.0), ("maybe", math.nan), ("", math.nan)])
def test_verdict_reads_the_first_word_and_never_guesses(reply, expected):
    assert verdict(reply) == expected or (math.isnan(expected) and math.isnan(verdict(reply)))


def test_judge_metrics_count_agreement_on_parsed_verdicts_only():
    rows = [{"judge": 1.0, "correct": True}, {"judge": 1.0, "correct": False}, {"judge": 0.0, "correct": False},
            {"judge": math.nan, "correct": True}]
    assert judge_metrics(rows) == {"judge_accuracy": 2 / 3, "judge_agreement": 2 / 3, "judge_unparsed": 1}
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
    assert all(row["judge"] in (0.0, 1.0) for row in rows)  # the judge answered in its format every time
    assert metrics["judge_unparsed"] == 0
    assert metrics["judge_accuracy"] == round(sum(row["judge"] for row in rows) / len(rows), 4)
    assert metrics["judge_agreement"] == round(sum(row["judge"] == row["correct"] for row in rows) / len(rows), 4)


def test_an_unreachable_judge_is_one_line():
    from conftest import free_port

    from models.loading import load_tokenizer
    from models.presets import materialize
    from tasks.rollout.endpoint_policy import EndpointError
    from tasks.rollout.judge import judge_rows

    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(EndpointError) as error:
        judge_rows([{"prompt": "p", "answer": "1", "completion": "c"}], Judge(endpoint=url, model="judge"),
                   load_tokenizer(materialize("tiny-llama")))
    assert str(error.value).startswith(f"{url}: cannot reach the endpoint") and "\n" not in str(error.value)
