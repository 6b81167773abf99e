"""A store writer (issue 58, part 1): a spec read back from the store (`specs/<hash>.yaml`, what an
evaluation of a checkpoint reads) must hash to its name, and fills only the variables, names only
the API keys and reaches only the endpoint hosts the worker's environment allows
(POSTTRAIN_ALLOWED_VARIABLES, POSTTRAIN_ALLOWED_ENDPOINTS). Each refusal is one line, before any
request: a real listener on 127.0.0.1 receives nothing. The spec a run's author gave is not checked."""

from __future__ import annotations

import http.server
import json
import threading

import pytest
import yaml

from artifacts.store import Store

SECRET = "s3cr3t-worker-value"
SPEC = {"name": "t", "model": {"base": "tiny-llama"}, "envs": {"arith": {"kind": "arith"}},
        "stages": [{"id": "w", "kind": "synthesize", "env": "arith", "n": 2},
                   {"id": "s", "kind": "sft", "data": "w", "max_steps": 1}]}


class Recorder(http.server.BaseHTTPRequestHandler):
    """Records every request (path and Authorization header); answers a model list for /v1/models."""

    def do_GET(self):  # noqa: N802 (http.server's naming)
        self.server.received.append((self.command, self.path, self.headers.get("Authorization")))
        body = json.dumps({"object": "list", "data": [{"id": "j", "object": "model", "created": 0,
                                                        "owned_by": "test"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def listener():
    """A real HTTP server on 127.0.0.1; yields it (`.received`: the requests, `.port`)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    server.received, server.port = [], server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def worker_env(monkeypatch):
    """The worker's environment: a secret, nothing allowed."""
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", SECRET)
    for name in ("POSTTRAIN_ALLOWED_VARIABLES", "POSTTRAIN_ALLOWED_ENDPOINTS"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def kept_checkpoint(tmp_path, spec_text: str, name: str = "t/s"):
    """A store with `spec_text` kept as a run keeps it and a checkpoint whose producer names it; (store, ref)."""
    from flows.post_train import save_spec

    store = Store(f"file://{tmp_path / 'store'}")
    folder = tmp_path / "weights"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text("{}")
    spec_hash = save_spec(store, spec_text)
    return store, store.commit(name, "checkpoint", folder, producer={"spec": spec_hash}), spec_hash


def judge(port: int, endpoint_suffix: str = "?k=${POSTTRAIN_TEST_SECRET}", api_key_env="POSTTRAIN_TEST_SECRET") -> str:
    return ("evaluation:\n  judge: {endpoint: \"http://127.0.0.1:%d/v1%s\", model: j, api_key_env: %s}\n"
            % (port, endpoint_suffix, api_key_env))


def tampered(tmp_path, port: int):
    """The attack: a judge appended to a kept spec, the secret in its URL and as its key."""
    store, ref, spec_hash = kept_checkpoint(tmp_path, yaml.safe_dump(SPEC))
    path = tmp_path / "store" / "specs" / f"{spec_hash}.yaml"
    path.write_text(path.read_text() + judge(port))
    return store, ref, spec_hash


def test_store_writer_tampered_spec_is_refused_by_posttrain_eval(tmp_path, worker_env, listener, capsys):
    from flows.cli.main import main

    store, ref, spec_hash = tampered(tmp_path, listener.port)
    assert main(["eval", str(ref), "--store", store.uri]) == 2
    assert capsys.readouterr().err == (f"error: specs/{spec_hash}.yaml (the spec of {ref}): its text does not hash "
                                       "to its name (changed in the store after a run kept it): refused\n")
    assert listener.received == []


def test_store_writer_spec_of_its_own_is_refused_by_the_evaluation_flow(tmp_path, worker_env, listener):
    """A whole spec of the writer's own, kept under its true hash (so it passes the hash check), with the
    secret in the judge's URL and as its key: refused in one line, nothing sent."""
    from flows.evaluate import evaluate
    from flows.stage_requests import state_error

    store, ref, spec_hash = kept_checkpoint(tmp_path, yaml.safe_dump(SPEC) + judge(listener.port))
    state = evaluate(checkpoint_ref=str(ref), store=store.uri, return_state=True)
    assert state.is_failed()
    assert state_error(state) == (f"specs/{spec_hash}.yaml (the spec of {ref}): evaluation.judge.endpoint: variable "
                                  "POSTTRAIN_TEST_SECRET is not in POSTTRAIN_ALLOWED_VARIABLES (a spec read from the "
                                  "store takes only the variables this worker allows)")
    assert listener.received == []
    assert SECRET not in state_error(state)


@pytest.mark.parametrize("variables, endpoints, suffix, field, message", [
    # the key variable alone, no placeholder in the URL
    ("", "127.0.0.1", "", "evaluation.judge.api_key_env",
     "variable POSTTRAIN_TEST_SECRET is not in POSTTRAIN_ALLOWED_VARIABLES (a spec read from the store takes only "
     "the variables this worker allows)"),
    # the key allowed, the host not
    ("POSTTRAIN_TEST_SECRET", "judge.internal 127.0.0.1:1", "", "evaluation.judge.endpoint",
     "host 127.0.0.1:{port} is not in POSTTRAIN_ALLOWED_ENDPOINTS (a spec read from the store talks only to the "
     "endpoints this worker allows)"),
    # user info in the authority: which host a client asks is not plain
    ("POSTTRAIN_TEST_SECRET", "127.0.0.1", "@127.0.0.2", "evaluation.judge.endpoint",
     "not an http(s) URL with a plain host[:port] (a spec read from the store talks only to the endpoints this "
     "worker allows)"),
])
def test_store_writer_key_and_host_are_checked_against_the_workers_lists(tmp_path, worker_env, listener, capsys,
                                                                        variables, endpoints, suffix, field, message):
    from flows.cli.main import main

    worker_env.setenv("POSTTRAIN_ALLOWED_VARIABLES", variables)
    worker_env.setenv("POSTTRAIN_ALLOWED_ENDPOINTS", endpoints)
    text = yaml.safe_dump(SPEC) + judge(listener.port, "", "POSTTRAIN_TEST_SECRET")
    if suffix:
        text = text.replace(f"127.0.0.1:{listener.port}", f"u@127.0.0.1:{listener.port}")
    store, ref, spec_hash = kept_checkpoint(tmp_path, text)
    assert main(["eval", str(ref), "--store", store.uri]) == 2
    assert capsys.readouterr().err == \
        f"error: specs/{spec_hash}.yaml (the spec of {ref}): {field}: {message.format(port=listener.port)}\n"
    assert listener.received == []


def test_store_writer_allowed_variable_and_endpoint_still_work(tmp_path, worker_env, listener):
    """What the worker allows is filled and reached: the judge's URL and key, sent to the listener;
    one variable short of it, the same spec is refused."""
    from flows.evaluate import EvaluationInputError, plan_evaluation
    from tasks.rollout.endpoint_policy import EndpointPolicy

    worker_env.setenv("POSTTRAIN_TEST_TEAM", "team-blue-42")
    worker_env.setenv("POSTTRAIN_ALLOWED_VARIABLES", "POSTTRAIN_TEST_SECRET")
    worker_env.setenv("POSTTRAIN_ALLOWED_ENDPOINTS", f"judge.internal:8000 127.0.0.1:{listener.port}")
    store, ref, _ = kept_checkpoint(tmp_path, yaml.safe_dump(SPEC) + judge(listener.port, "?team=${POSTTRAIN_TEST_TEAM}"))
    with pytest.raises(EvaluationInputError, match=r"evaluation\.judge\.endpoint: variable POSTTRAIN_TEST_TEAM is not in "):
        plan_evaluation(str(ref), store)
    worker_env.setenv("POSTTRAIN_ALLOWED_VARIABLES", "POSTTRAIN_TEST_TEAM,POSTTRAIN_TEST_SECRET")
    plan = plan_evaluation(str(ref), store)
    configured = plan.request.stage.judge
    assert configured.endpoint == f"http://127.0.0.1:{listener.port}/v1?team=team-blue-42"
    EndpointPolicy.of(configured, None, "judge").check_model()
    assert [(method, auth) for method, _, auth in listener.received] == [("GET", f"Bearer {SECRET}")]


def test_store_writer_cannot_touch_the_authors_own_spec_path(tmp_path, worker_env, listener):
    """The spec a run's author gave this process (`posttrain run`, then its inline evaluations) is
    trusted: read back from the store with the very same text, it is filled from the whole
    environment. The same text that no author gave here is a store writer's: refused."""
    from flows.spec import SpecError, checkpoint_spec, parse_spec_text

    text = yaml.safe_dump({**SPEC, "name": "authored"}) + judge(listener.port)
    store, ref, _ = kept_checkpoint(tmp_path, text, "authored/s")
    with pytest.raises(SpecError, match=r"evaluation\.judge\.endpoint: variable POSTTRAIN_TEST_SECRET is not in "):
        checkpoint_spec(store, store.manifest(ref))
    parse_spec_text(text)  # the author's, as `posttrain run` parses it
    spec = checkpoint_spec(store, store.manifest(ref))
    assert spec.evaluation.judge.endpoint.endswith(f"?k={SECRET}")
    assert listener.received == []


def test_store_writer_endpoint_entries():
    from flows.worker_allows import NotAllowed, WorkerAllows

    allows = WorkerAllows.from_environ({"POSTTRAIN_ALLOWED_ENDPOINTS": "*.example.com:443, judge.internal [::1]:8000"})
    for url in ("https://a.example.com/v1", "http://judge.internal:9/v1", "http://JUDGE.internal/v1",
                "http://[::1]:8000/v1"):
        allows.check_endpoint(("e",), url)
    for url in ("https://example.com/v1", "http://a.example.com/v1", "https://evil-example.com/v1",
                "http://judge.internal.evil.com/v1", "http://[::1]:8001/v1", "http://evil.com\\@judge.internal/v1",
                "ftp://judge.internal/", "judge.internal:80"):
        with pytest.raises(NotAllowed):
            allows.check_endpoint(("e",), url)
    with pytest.raises(NotAllowed, match=r"^POSTTRAIN_ALLOWED_ENDPOINTS: 'http://judge' is not host\[:port\]"):
        WorkerAllows.from_environ({"POSTTRAIN_ALLOWED_ENDPOINTS": "http://judge"})
