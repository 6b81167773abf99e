"""Secrets (issue 20, item 5, in part): an API key goes only to the endpoint whose config names its
variable; OPENAI_API_KEY is never sent to whatever URL a spec or an event gives."""

import pytest

from tasks.config import Judge
from tasks.rollout.endpoint_policy import EndpointPolicy


def test_openai_api_key_is_not_sent_to_an_endpoint_that_does_not_name_it(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-the-users-own")
    policy = EndpointPolicy("http://127.0.0.1:9/v1", "m", tokenizer=None)
    assert policy.client.api_key == "none"
    judge = Judge(endpoint="http://judge.example/v1", model="j", api_key_env="OPENAI_API_KEY")
    assert EndpointPolicy.of(judge, None, "judge").client.api_key == "sk-the-users-own"  # named: sent


def test_eval_endpoint_with_an_unset_key_variable_is_one_line(tmp_path, capsys):
    from flows.cli.main import main

    spec = tmp_path / "spec.yaml"
    spec.write_text("name: t\nenvs: {arith: {kind: arith}}\nstages: [{id: w, kind: synthesize, env: arith, n: 2}]\n")
    code = main(["eval", "--endpoint", "http://127.0.0.1:9/v1", "--model", "m", "--spec", str(spec),
                 "--api-key-env", "POSTTRAIN_NO_SUCH_KEY"])
    assert code == 2
    assert capsys.readouterr().err == "error: --api-key-env: environment variable POSTTRAIN_NO_SUCH_KEY is not set\n"


SPEC_WITH_VARIABLES = """
name: t
store: ${POSTTRAIN_TEST_STORE}
model: {base: "${POSTTRAIN_TEST_BASE}"}
storage_options: {endpoint_url: "${POSTTRAIN_TEST_S3}"}
envs: {arith: {kind: arith, digits: "${POSTTRAIN_TEST_DIGITS}"}}
stages:
  - {id: w, kind: synthesize, env: arith, n: 2}
  - {id: s, kind: sft, data: w, max_steps: 1}
  - id: e
    kind: evaluate
    checkpoints: [s]
    envs: [arith]
    judge: {endpoint: "https://judge.example/t/${POSTTRAIN_TEST_TOKEN}/v1", model: j}
"""


def test_values_from_the_environment_travel_to_a_worker_as_placeholders(tmp_path, monkeypatch):
    """A stage submitted to a worker carries `${VAR}`, never a value the orchestrator's environment
    filled in, wherever it went (a field, a normalised URI, the base model's identity); the
    worker's own environment fills it back, and a worker whose environment differs refuses."""
    import copy
    import json

    from flows.spec import parse_spec_text
    from flows.stage_flow import filled_request
    from flows.stage_requests import stage_parameters, stage_request

    values = {"POSTTRAIN_TEST_STORE": f"file://{tmp_path}/store/", "POSTTRAIN_TEST_S3": "http://127.0.0.1:9/s3-secret",
              "POSTTRAIN_TEST_DIGITS": "2", "POSTTRAIN_TEST_TOKEN": "tok-s3cr3t", "POSTTRAIN_TEST_BASE": "tiny-llama"}
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    spec = parse_spec_text(SPEC_WITH_VARIABLES)
    stage = spec.stage("e")
    request = stage_request(spec, stage, {"s": "t/s@v1"}, store=spec.store_location().open().location, run_id="t-1",
                            spec_hash=None)
    assert request.stage.judge.endpoint == "https://judge.example/t/tok-s3cr3t/v1"
    sft = stage_request(spec, spec.stage("s"), {"w": "t/w@v1"}, store=request.store, run_id="t-1", spec_hash=None)
    assert sft.producer.base_model.startswith("preset:tiny-llama")  # derived from a filled value
    parameters = json.loads(json.dumps(stage_parameters(spec, request)))  # what the Prefect API stores
    text = json.dumps([parameters, stage_parameters(spec, sft)])
    for name, value in values.items():
        if len(value) >= 8:
            assert value.rstrip("/") not in text, name
    assert parameters["request"]["stage"]["judge"]["endpoint"] == "https://judge.example/t/${POSTTRAIN_TEST_TOKEN}/v1"
    assert parameters["request"]["store"]["uri"] == "${POSTTRAIN_TEST_STORE%/}"  # normalised: no trailing slash
    assert parameters["request"]["store"]["options"] == {"endpoint_url": "${POSTTRAIN_TEST_S3}"}
    assert parameters["request"]["envs"]["arith"]["digits"] == 2  # short values are no secret: left alone
    monkeypatch.delenv("POSTTRAIN_TEST_TOKEN")  # the worker's environment
    with pytest.raises(ValueError, match=r"^stage\.judge\.endpoint: environment variable POSTTRAIN_TEST_TOKEN is not set$"):
        filled_request(copy.deepcopy(parameters["request"]), parameters["placeholders"], parameters["request_digest"])
    with pytest.raises(ValueError, match=r"^placeholders: this worker's environment gives .*POSTTRAIN_TEST_TOKEN.* "
                                         r"other values than the orchestrator's"):
        monkeypatch.setenv("POSTTRAIN_TEST_TOKEN", "another-token")
        filled_request(copy.deepcopy(parameters["request"]), parameters["placeholders"], parameters["request_digest"])
    monkeypatch.setenv("POSTTRAIN_TEST_TOKEN", "tok-s3cr3t")
    assert filled_request(parameters["request"], parameters["placeholders"], parameters["request_digest"]) == request


def test_a_reward_modules_own_placeholders_are_not_filled_on_the_worker():
    from flows.placeholders import fill_placeholders, with_placeholders

    payload = {"code": {"r.py": "CMD = 'echo ${HOME} s3cr3t-value'"}, "url": "http://h/s3cr3t-value"}
    masked, placed = with_placeholders(payload, {"TOKEN": "s3cr3t-value", "SHORT": "h"})
    assert masked == {"code": {"r.py": "CMD = 'echo ${HOME} ${TOKEN}'"}, "url": "http://h/${TOKEN}"}
    filled = fill_placeholders(masked, placed, {"TOKEN": "s3cr3t-value", "HOME": "/root"})
    assert filled == {"code": {"r.py": "CMD = 'echo ${HOME} s3cr3t-value'"}, "url": "http://h/s3cr3t-value"}
