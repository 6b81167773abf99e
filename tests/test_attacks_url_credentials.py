"""Credentials in URLs (issue 58): a spec, a store or `eval --endpoint` whose URL holds them is refused
in one line naming the field; an error naming a URL built past those checks shows none of them.
Also safetensors only (a pickled checkpoint never loads) and serve-model off loopback only with a
key or `--insecure-no-auth`."""

import copy
import subprocess

import openai
import pytest
from conftest import POSTTRAIN, ROOT, free_port

from artifacts.store import Store, StoreError, first_line
from artifacts.urls import holds_credentials, scrub_urls
from flows.spec import SpecError, parse_spec

SECRET = "s3cr3t-value"
CREDENTIALS = "the URL holds credentials (user:password@ or a secret-looking query parameter such as api_key)"
API_KEY_ENV = "give the key through api_key_env"
MLFLOW = "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN, in the environment"
ENVIRONMENT = "give credentials through the environment or the cloud's credential chain"


def every_url_spec() -> dict:
    """A valid spec with a URL in every field that takes one (read without reading its sources)."""
    return {
        "name": "t",
        "store": "s3://bucket/posttrain",
        "storage_options": {"endpoint_url": "http://127.0.0.1:9000",
                            "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}},
        "defaults": {"mlflow_uri": "https://mlflow.example"},
        "envs": {"arith": {"kind": "arith", "digits": 2},
                 "sums": {"kind": "dataset", "source": "https://data.example/prompts.jsonl",
                          "eval_source": "https://data.example/held-out.jsonl",
                          "rewards": [{"function": "posttrain.rewards:answer_format"},
                                      {"judge": {"endpoint": "https://judge.example/v1", "model": "j"}}]}},
        "stages": [
            {"id": "rows", "kind": "dataset", "source": "https://data.example/chats.jsonl"},
            {"id": "warmup", "kind": "synthesize", "env": "arith", "n": 10,
             "teacher": {"endpoint": "https://teacher.example/v1", "model": "t"}},
            {"id": "sft", "kind": "sft", "data": "warmup", "max_steps": 2, "mlflow_uri": "https://mlflow.example"},
            {"id": "gen", "kind": "generate", "policy": "sft", "env": "arith", "n": 4,
             "rollout": {"backend": "server", "endpoint": "http://vllm.example:8000/v1", "model": "m"}},
            {"id": "eval", "kind": "evaluate", "checkpoints": ["sft"], "envs": ["arith"], "n": 4,
             "judge": {"endpoint": "https://judge.example/v1", "model": "j"}},
        ],
    }


# (field path, where its credentials go instead)
URL_FIELDS = [
    (("store",), ENVIRONMENT),
    (("storage_options", "endpoint_url"), ENVIRONMENT),
    (("storage_options", "client_kwargs", "endpoint_url"), ENVIRONMENT),
    (("defaults", "mlflow_uri"), MLFLOW),
    (("envs", "sums", "source"), ENVIRONMENT),
    (("envs", "sums", "eval_source"), ENVIRONMENT),
    (("envs", "sums", "rewards", 1, "judge", "endpoint"), API_KEY_ENV),
    (("stages", 0, "source"), ENVIRONMENT),
    (("stages", 1, "teacher", "endpoint"), API_KEY_ENV),
    (("stages", 2, "mlflow_uri"), MLFLOW),
    (("stages", 3, "rollout", "endpoint"), API_KEY_ENV),
    (("stages", 4, "judge", "endpoint"), API_KEY_ENV),
]


def dotted(path: tuple) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path).lstrip(".")


def with_user_info(url: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://user:{SECRET}@{rest}"


def with_query(name: str):
    return lambda url: f"{url}{'&' if '?' in url else '?'}{name}={SECRET}"


CREDENTIAL_FORMS = {"user-info": with_user_info, "api_key": with_query("api_key"), "token": with_query("token"),
                    "X-Amz-Signature": with_query("X-Amz-Signature"), "sig": with_query("sig"),
                    "apiKey": with_query("apiKey")}


def set_at(tree, path: tuple, change) -> None:
    for part in path[:-1]:
        tree = tree[part]
    tree[path[-1]] = change(tree[path[-1]])


def test_the_spec_with_every_url_field_is_valid_without_credentials():
    parse_spec(every_url_spec(), read_sources=False)


@pytest.mark.parametrize("form", sorted(CREDENTIAL_FORMS))
@pytest.mark.parametrize("path, hint", URL_FIELDS, ids=[dotted(path) for path, _ in URL_FIELDS])
def test_url_credentials_in_any_url_field_are_refused_naming_it(path, hint, form):
    spec = every_url_spec()
    set_at(spec, path, CREDENTIAL_FORMS[form])
    with pytest.raises(SpecError) as error:
        parse_spec(spec, read_sources=False)
    assert str(error.value) == f"{dotted(path)}: {CREDENTIALS}; {hint}"


def test_url_credentials_from_an_environment_variable_are_refused_without_showing_them(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_TEST_JUDGE_URL", f"https://judge.example/v1?key={SECRET}")
    spec = every_url_spec()
    spec["stages"][4]["judge"]["endpoint"] = "${POSTTRAIN_TEST_JUDGE_URL}"
    with pytest.raises(SpecError) as error:
        parse_spec(spec, read_sources=False)
    assert str(error.value) == f"stages[4].judge.endpoint: {CREDENTIALS}; {API_KEY_ENV}"


def test_url_credentials_refused_by_validate_in_one_line_exit_2(tmp_path, capsys):
    import yaml

    from flows.cli.main import main

    spec = copy.deepcopy(every_url_spec())
    spec["store"] = f"file://{tmp_path / 'store'}"
    del spec["storage_options"]
    spec["stages"][3]["rollout"]["endpoint"] = f"https://user:{SECRET}@vllm.example/v1"
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    assert main(["validate", str(tmp_path / "spec.yaml")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: stages[3].rollout.endpoint: {CREDENTIALS}; {API_KEY_ENV}\n"


@pytest.mark.parametrize("url", [
    "https://user:{s}@host/v1", "https://{s}@host/v1", "https://u:p@{s}@host/v1", "https://host/v1?api_key={s}",
    "https://host/v1?a=1&ACCESS_TOKEN={s}", "https://host/v1?client_secret={s}", "https://host/v1?password={s}",
    "https://host/f?X-Amz-Credential={s}", "https://host/f?X-Goog-Signature={s}", "https://host/f?sv=1&sig={s}",
    "https://host/v1?subscription-key={s}", "https://host/v1#access_token={s}", "https://host/v1?api%5Fkey={s}",
    "https://host/v1?apiKey={s}&model=m", "abfs://{s}@account.dfs.core.windows.net/data",
])
def test_url_credentials_rule_counts(url):
    url = url.format(s=SECRET)
    assert holds_credentials(url)
    assert SECRET not in scrub_urls(url)


@pytest.mark.parametrize("url", [
    "https://host/v1", "https://host:8000/v1?max_tokens=5", "hf://datasets/org/name@main/data.jsonl",
    "s3://bucket/path?endpoint_url=http://127.0.0.1:9000", "file:///tmp/a@b", "https://host/v1?api_key=",
    "not a url user:pw@host",
])
def test_url_credentials_rule_leaves_these(url):
    assert not holds_credentials(url)
    assert scrub_urls(url) == url


def test_url_credentials_are_scrubbed_from_messages():
    text = (f"https://user:{SECRET}@host/v1?api_key={SECRET}&model=m: cannot reach (see "
            f"s3://b/p?endpoint_url=http://ak:{SECRET}@minio:9000, https://h/f?X-Amz-Signature={SECRET})")
    assert scrub_urls(text) == ("https://***@host/v1?api_key=***&model=m: cannot reach (see "
                                "s3://b/p?endpoint_url=http://***@minio:9000, https://h/f?X-Amz-Signature=***)")
    assert scrub_urls(scrub_urls(text)) == scrub_urls(text)
    assert SECRET not in first_line(RuntimeError(text))
    assert SECRET not in str(StoreError(text))


def refused_url() -> str:
    """A URL holding credentials whose port refuses connections."""
    return f"http://user:{SECRET}@127.0.0.1:{free_port()}/v1?api_key={SECRET}"


def test_url_credentials_scrubbed_from_an_endpoint_error_of_a_refused_connection():
    from tasks.rollout.endpoint_policy import EndpointError, EndpointPolicy

    url = refused_url()
    policy = EndpointPolicy(url, "m", None, max_retries=0, timeout=5)  # built past the spec's check
    with pytest.raises(EndpointError) as error:
        policy.check_model()
    shown = url.replace(f"user:{SECRET}@", "***@").replace(f"api_key={SECRET}", "api_key=***")
    assert str(error.value).startswith(f"{shown}: cannot reach the endpoint"), str(error.value)
    assert SECRET not in str(error.value) and SECRET not in repr(error.value)


def test_url_credentials_scrubbed_from_server_check_and_weight_sync_errors(tmp_path):
    from tasks.rollout.endpoint_policy import EndpointError
    from tasks.rollout.server_policy import ServerPolicy
    from tasks.rollout.weight_sync import WeightSync

    policy = ServerPolicy(refused_url(), "m", None, timeout=5)
    with pytest.raises(EndpointError) as error:
        policy.check()
    assert "cannot reach the endpoint" in str(error.value) and SECRET not in str(error.value)
    (tmp_path / "v1").mkdir()
    with pytest.raises(EndpointError) as error:
        WeightSync(policy, tmp_path, "rl", lora=False).announce(1, tmp_path / "v1")
    assert "cannot reach the endpoint" in str(error.value) and SECRET not in str(error.value)


def test_url_credentials_refused_by_the_store(tmp_path):
    for uri, options, field in [(f"s3://bucket/p?X-Amz-Signature={SECRET}", {}, "store"),
                                (f"s3://AKIA:{SECRET}@bucket/p", {}, "store"),
                                ("s3://bucket/p", {"endpoint_url": f"http://ak:{SECRET}@127.0.0.1:9"},
                                 "storage_options.endpoint_url")]:
        with pytest.raises(StoreError) as error:
            Store(uri, options)
        assert str(error.value) == f"{field}: {CREDENTIALS}; {ENVIRONMENT}"


def test_url_credentials_refused_by_eval_endpoint(capsys):
    from flows.cli.main import main

    assert main(["eval", "--endpoint", f"https://host/v1?api_key={SECRET}", "--model", "m", "--spec", "x.yaml"]) == 2
    assert capsys.readouterr().err == f"error: --endpoint: {CREDENTIALS}; give the key through --api-key-env\n"


# -- weights load as safetensors only ------------------------------------------------------------

def pickled_weights(folder, name: str, marker) -> None:
    """`folder/name`: a pickle whose unpickling creates `marker` (any code could run there)."""
    import pickle

    class Planted:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (folder / name).write_bytes(pickle.dumps({"model.embed_tokens.weight": Planted()}))


def test_a_pickled_checkpoint_in_the_store_is_refused_unloaded(tmp_path):
    import shutil

    from models.config import ModelConfig
    from models.loading import PickledWeights, load_model
    from models.presets import materialize

    folder, marker = tmp_path / "ckpt", tmp_path / "MARKER"
    shutil.copytree(materialize("tiny-llama"), folder, ignore=shutil.ignore_patterns("*.safetensors*"))
    pickled_weights(folder, "pytorch_model.bin", marker)
    store = Store(f"file://{tmp_path / 'store'}")
    fetched = store.fetch(store.commit("t/sft", "checkpoint", folder, producer={}))
    with pytest.raises(PickledWeights) as error:
        load_model(fetched, ModelConfig())
    assert str(error.value) == (f"{fetched}: no model.safetensors or model.safetensors.index.json; weights load only "
                                "as safetensors, never from a pickle such as pytorch_model.bin")
    assert not marker.exists()


def test_a_pickled_adapter_is_refused_unloaded(tmp_path):
    import json

    from models.config import ModelConfig
    from models.loading import PickledWeights, load_model

    folder, marker = tmp_path / "adapter", tmp_path / "MARKER"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4,
                                                            "target_modules": ["q_proj"]}))
    pickled_weights(folder, "adapter_model.bin", marker)
    for reward_head in (False, True):
        with pytest.raises(PickledWeights, match=r"no adapter_model\.safetensors; weights load only as safetensors"):
            load_model(folder, ModelConfig(), reward_head=reward_head)
    assert not marker.exists()


# -- serve-model off loopback --------------------------------------------------------------------

NO_KEY = ("error: --host: 0.0.0.0 is reachable from other machines and no key is set; give one with --api-key-env "
          "VAR, or pass --insecure-no-auth if an authenticating proxy stands in front\n")


def test_serve_model_off_loopback_without_a_key_exits_2(capsys):
    from flows.cli.main import main

    assert main(["serve-model", "t/sft@0123456789abcdef", "--host", "0.0.0.0"]) == 2
    assert capsys.readouterr().err == NO_KEY


@pytest.mark.parametrize("host, api_key, allowed", [
    ("127.0.0.1", None, True), ("127.8.9.10", None, True), ("::1", None, True), ("[::1]", None, True),
    ("localhost", None, True), ("LOCALHOST.", None, True), ("0.0.0.0", None, False), ("::", None, False),
    ("10.0.0.5", None, False), ("my-host.example", None, False), ("", None, False), ("0.0.0.0", "key", True),
])
def test_serve_model_loopback_rule(host, api_key, allowed):
    from flows.cli.serve_model import ServeModelInputError, check_authenticated

    if allowed:
        check_authenticated(host, api_key, insecure_no_auth=False)
    else:
        with pytest.raises(ServeModelInputError, match=r"^--host: .* is reachable from other machines"):
            check_authenticated(host, api_key, insecure_no_auth=False)
    check_authenticated(host, None, insecure_no_auth=True)  # told so: always


def test_serve_model_off_loopback_starts_with_insecure_no_auth(tmp_path):
    import select

    from models.presets import materialize

    store = Store(f"file://{tmp_path / 'store'}")
    ref = str(store.commit("t/base", "checkpoint", materialize("tiny-llama"), producer={}))
    port = free_port()
    process = subprocess.Popen([POSTTRAIN, "serve-model", ref, "--store", store.uri, "--host", "0.0.0.0", "--port",
                                str(port), "--insecure-no-auth", "--device", "cpu"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([process.stdout], [], [], 120)
        line = process.stdout.readline().strip() if ready else ""
        assert line == f"serving {ref} on http://0.0.0.0:{port}/v1", (line, process.poll())
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert [model.id for model in client.models.list().data] == [ref]
    finally:
        process.terminate()
        process.wait(timeout=30)
