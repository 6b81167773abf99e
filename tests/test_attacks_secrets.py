"""Secrets (issue 20, item 5, in part): an API key goes only to the endpoint whose config names its
variable; OPENAI_API_KEY is never sent to whatever URL a spec or an event gives."""

from tasks.common.endpoint_policy import EndpointPolicy
from tasks.config import Judge


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
