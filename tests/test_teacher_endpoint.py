"""`synthesize` with `teacher: {endpoint, model}`: the SFT rows come from a model served by
serve-model (what the local model decodes greedily, single- and multi-turn), and a bad teacher in
a spec is one line naming the field."""

import copy

import pytest
from conftest import free_port
from test_serve_model import ARITH, CALC, NAME, local_model, trained_checkpoint

from models.sampling import SamplingParams
from tasks.config import EndpointTeacher
from tasks.kinds import STAGE_CONFIG
from tasks.rollout.endpoint_policy import EndpointError
from tasks.rollout.episodes import LocalPolicy, roll_out
from tasks.stages.synthesize import SynthesizeStage


def synthesize(tmp_path, env_id: str, env_config, teacher: dict, n: int) -> tuple[list[dict], dict]:
    """The synthesize stage run as the runner runs it; its rows and metrics."""
    from artifacts.store import Store
    from models.config import ModelConfig
    from tasks.common.context import StageContext
    from tasks.common.datasets import read_rows
    from tasks.stages.synthesize import run

    stage = STAGE_CONFIG.validate_python({"id": "warmup", "kind": "synthesize", "env": env_id, "n": n,
                                          "teacher": teacher})
    ctx = StageContext(store=Store(f"file://{tmp_path / 'store'}"), pipeline="t", run_id="r", stage_id="warmup",
                       cache_key="k", model=ModelConfig(base=str(trained_checkpoint())), envs={env_id: env_config},
                       inputs={}, workdir=tmp_path / "w", announce_path=tmp_path / "messages.jsonl")
    output = run(stage, ctx)["dataset"]
    rows = [{key: value.tolist() if hasattr(value, "tolist") else value for key, value in row.items()}
            for row in read_rows(output.local_dir)]  # token columns come back as arrays
    return rows, output.metrics


def test_single_turn_rows_are_the_endpoint_models_greedy_answers(tmp_path, base_url):
    model, tokenizer = local_model()
    rows, metrics = synthesize(tmp_path, "arith", ARITH.config, {"endpoint": base_url, "model": NAME,
                                                                 "max_tokens": 64}, 16)
    tasks = ARITH.tasks("train", 16, 0)
    local = roll_out(LocalPolicy(model, tokenizer), tokenizer, ARITH, tasks, SamplingParams(64))
    assert [row["id"] for row in rows] == [task.id for task in tasks]
    assert [row["completion"] for row in rows] == [t.text for t in local]
    assert any(row["completion"] != ARITH.reference_completion(task) for row, task in zip(rows, tasks))  # no oracle
    assert metrics["teacher_accuracy"] == sum(ARITH.is_correct(t.text, t.task) for t in local) / len(tasks)


def test_multi_turn_rows_are_the_endpoint_models_episodes(tmp_path, base_url):
    from tasks.stages.synthesize import trajectory_rows

    model, tokenizer = local_model()
    rows, metrics = synthesize(tmp_path, "calc", CALC.config, {"endpoint": base_url, "model": NAME,
                                                               "max_tokens": 48}, 8)
    local = roll_out(LocalPolicy(model, tokenizer), tokenizer, CALC, CALC.tasks("train", 8, 0), SamplingParams(48))
    expected, solved = trajectory_rows(CALC, "calc", local, tokenizer)
    assert rows == expected  # the same ids, loss masks and transcripts
    assert any(row["loss_mask"].count(0) > len(local[0].prompt_ids) for row in rows)  # tool results masked
    assert metrics["teacher_accuracy"] == solved / 8
    progress = [m["progress"] for m in told(tmp_path) if "progress" in m]  # what the orchestrator hears
    assert progress[-1]["step"] == progress[-1]["total"] == 8
    assert any(m.get("log", "").startswith("[warmup] step 8/8") for m in told(tmp_path))


def told(tmp_path) -> list[dict]:
    import json

    return [json.loads(line) for line in (tmp_path / "messages.jsonl").read_text().splitlines()]


def test_an_unreachable_teacher_fails_the_stage_with_one_line(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(EndpointError) as error:
        synthesize(tmp_path, "arith", ARITH.config, {"endpoint": url, "model": NAME}, 2)
    assert str(error.value).startswith(f"{url}: cannot reach the endpoint (") and "\n" not in str(error.value)


def test_the_api_key_comes_from_the_environment_variable_the_spec_names(monkeypatch):
    from tasks.stages.synthesize import teacher_policy

    _, tokenizer = local_model()
    teacher = EndpointTeacher(endpoint="http://127.0.0.1:1/v1", model=NAME, api_key_env="POSTTRAIN_TEST_TEACHER_KEY")
    monkeypatch.delenv("POSTTRAIN_TEST_TEACHER_KEY", raising=False)
    with pytest.raises(ValueError, match="environment variable POSTTRAIN_TEST_TEACHER_KEY is not set"):
        teacher_policy(teacher, tokenizer)
    monkeypatch.setenv("POSTTRAIN_TEST_TEACHER_KEY", "sk-test")
    assert teacher_policy(teacher, tokenizer).client.api_key == "sk-test"


SPEC = {"name": "t", "store": "file:///tmp/posttrain-never-written", "envs": {"arith": {"kind": "arith"}},
        "stages": [{"id": "warmup", "kind": "synthesize", "env": "arith", "n": 10}]}
ENDPOINT = {"endpoint": "http://127.0.0.1:8000/v1", "model": NAME}
BAD_TEACHERS = {
    "missing model": ({"endpoint": ENDPOINT["endpoint"]}, "stages[0].teacher.model: missing"),
    "missing endpoint": ({"model": NAME}, "stages[0].teacher.endpoint: missing"),
    "endpoint not a URL": ({**ENDPOINT, "endpoint": "localhost:8000/v1"},
                           "stages[0].teacher.endpoint: String should match pattern '^https?://\\S+$' "
                           "(got 'localhost:8000/v1')"),
    "a key in the spec": ({**ENDPOINT, "api_key": "sk-x"}, "stages[0].teacher.api_key: unknown key"),
    "bad max_tokens": ({**ENDPOINT, "max_tokens": 0},
                       "stages[0].teacher.max_tokens: Input should be greater than 0 (got 0)"),
    "negative temperature": ({**ENDPOINT, "temperature": -1},
                             "stages[0].teacher.temperature: Input should be greater than or equal to 0 (got -1)"),
    "unknown teacher": ("gpt", "stages[0].teacher: expected 'oracle' or an endpoint teacher (a mapping with "
                               "endpoint and model) (got 'gpt')"),
}


@pytest.mark.parametrize("case", BAD_TEACHERS)
def test_a_bad_teacher_is_one_line_naming_the_field(case):
    from flows.spec import SpecError, parse_spec

    teacher, message = BAD_TEACHERS[case]
    spec = copy.deepcopy(SPEC)
    spec["stages"][0]["teacher"] = teacher
    with pytest.raises(SpecError) as error:
        parse_spec(spec)
    assert str(error.value) == message


def test_a_teacher_spec_round_trips_one_to_one():
    from flows.spec import parse_spec

    spec = copy.deepcopy(SPEC)
    spec["stages"][0]["teacher"] = {**ENDPOINT, "api_key_env": "TEACHER_KEY"}
    stage = parse_spec(spec).stages[0]
    assert isinstance(stage, SynthesizeStage) and stage.teacher == EndpointTeacher(**ENDPOINT, api_key_env="TEACHER_KEY")
    assert stage.params()["teacher"] == {**ENDPOINT, "max_tokens": 256, "temperature": 0, "api_key_env": "TEACHER_KEY"}
    assert parse_spec(SPEC).stages[0].teacher == "oracle"
