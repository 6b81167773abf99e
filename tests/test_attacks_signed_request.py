"""Signed stage requests (issue 58, part 2): whoever can create a flow run of `post-train-stage` on the
Prefect API hands a worker code (written and imported there) and `${VAR}` placeholders (filled from
its environment). With POSTTRAIN_REQUEST_KEY the orchestrator signs each request (HMAC-SHA256 over
the request, its placeholders and its digest) and a worker holding the key refuses an unsigned or
mis-signed one in one line, before it writes any code or reads any placeholder's variable. A
worker without the key runs every request, as before."""

from __future__ import annotations

import copy
import json

import pytest

KEY = "0123456789abcdef" * 4
SPEC = """
name: signed
store: ${POSTTRAIN_TEST_STORE}
envs: {arith: {kind: arith}}
defaults: {retries: 0, retry_delay_seconds: 0}
stages: [{id: w, kind: synthesize, env: arith, n: 4}]
"""
MISSING = ("request_signature: missing; this worker holds POSTTRAIN_REQUEST_KEY and runs only stage requests signed "
           "with it (set the same key where the pipeline runs)")
MISMATCH = ("request_signature: does not match the request; it was changed after it was signed, or signed with "
            "another POSTTRAIN_REQUEST_KEY than this worker's")


@pytest.fixture
def signed(tmp_path, monkeypatch):
    """The flow-run parameters of a synthesize stage (its store from `${POSTTRAIN_TEST_STORE}`), as
    the Prefect API hands them to a worker, signed with KEY; and the marker file planted code would write."""
    from flows.spec import parse_spec_text
    from flows.stage_requests import stage_parameters, stage_request

    monkeypatch.setenv("POSTTRAIN_TEST_STORE", f"file://{tmp_path / 'store'}")
    monkeypatch.setenv("POSTTRAIN_REQUEST_KEY", KEY)
    spec = parse_spec_text(SPEC)
    request = stage_request(spec, spec.stage("w"), {}, store=spec.store_location().open().location,
                            run_id="signed-1", spec_hash=None)
    parameters = json.loads(json.dumps(stage_parameters(spec, request)))
    assert parameters["placeholders"] and parameters["request"]["store"]["uri"] == "${POSTTRAIN_TEST_STORE}"
    return parameters, tmp_path / "planted-ran"


@pytest.fixture
def watched(monkeypatch):
    """What the worker does with a request it accepts, watched: filling its placeholders (reading the
    variables they name) and running it (where its code is written and imported)."""
    import flows.stage_flow as stage_flow

    used = []
    monkeypatch.setattr(stage_flow, "fill_placeholders", lambda *args: used.append("filled"))
    monkeypatch.setattr(stage_flow, "run_stage", None)  # calling it would fail the test too
    return used


def planted(parameters: dict, marker) -> dict:
    """The request with a module of the attacker's that writes `marker` when imported."""
    parameters = copy.deepcopy(parameters)
    parameters["request"]["code"] = {"planted.py": f"open({str(marker)!r}, 'w').close()\n"}
    return parameters


def refused(parameters: dict, message: str, used: list, marker) -> None:
    from flows.request_signing import RequestNotSigned
    from flows.stage_flow import stage_flow

    with pytest.raises(RequestNotSigned) as refusal:
        stage_flow.fn(**parameters)
    assert str(refusal.value) == message and "\n" not in message
    assert used == [] and not marker.exists()


def test_signed_request_unsigned_is_refused(signed, watched):
    parameters, marker = signed
    unsigned = planted(parameters, marker)
    del unsigned["request_signature"]
    refused(unsigned, MISSING, watched, marker)
    refused({**unsigned, "request_signature": ""}, MISSING, watched, marker)


def test_signed_request_with_a_field_changed_after_signing_is_refused(signed, watched):
    parameters, marker = signed
    refused(planted(parameters, marker), MISMATCH, watched, marker)
    changed = copy.deepcopy(parameters)
    changed["request"]["stage"]["n"] = 5
    refused(changed, MISMATCH, watched, marker)
    refused({**parameters, "request_digest": "0" * 64}, MISMATCH, watched, marker)


def test_signed_request_with_changed_placeholders_is_refused(signed, watched, monkeypatch):
    parameters, marker = signed
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", "s3cr3t-worker-value")
    changed = copy.deepcopy(parameters)
    changed["request"]["run_id"] = "${POSTTRAIN_TEST_SECRET}"
    changed["placeholders"].append({"path": ["run_id"], "names": ["POSTTRAIN_TEST_SECRET"]})
    refused(changed, MISMATCH, watched, marker)
    renamed = copy.deepcopy(parameters)
    renamed["placeholders"][0]["names"] = ["POSTTRAIN_TEST_SECRET"]
    refused(renamed, MISMATCH, watched, marker)
    refused({**parameters, "placeholders": None}, MISMATCH, watched, marker)


def test_signed_request_with_another_key_is_refused(signed, watched, monkeypatch):
    parameters, marker = signed
    monkeypatch.setenv("POSTTRAIN_REQUEST_KEY", "f" * 64)
    refused(parameters, MISMATCH, watched, marker)


def test_signed_request_is_signed_by_the_orchestrator_only_with_a_key(signed, monkeypatch):
    from flows.request_signing import RequestNotSigned, check_signature, sign
    from flows.spec import parse_spec_text
    from flows.stage_requests import stage_parameters, stage_request

    parameters, _ = signed
    assert parameters["request_signature"] == sign(KEY.encode(), parameters["request"], parameters["placeholders"],
                                                    parameters["request_digest"])
    check_signature(parameters["request"], parameters["placeholders"], parameters["request_digest"],
                    parameters["request_signature"])
    monkeypatch.delenv("POSTTRAIN_REQUEST_KEY")
    spec = parse_spec_text(SPEC)
    request = stage_request(spec, spec.stage("w"), {}, store=spec.store_location().open().location,
                            run_id="signed-1", spec_hash=None)
    assert "request_signature" not in stage_parameters(spec, request)
    check_signature(parameters["request"], [], None, None)  # a worker without a key: as before
    monkeypatch.setenv("POSTTRAIN_REQUEST_KEY", "short")
    with pytest.raises(RequestNotSigned, match=r"^POSTTRAIN_REQUEST_KEY: at least 32 characters, this one has 5 "):
        stage_parameters(spec, request)


def test_signed_request_runs_through_the_worker_entry(signed, tmp_path):
    """The stage's flow, as a worker runs it: a correctly signed request is filled and runs (its
    dataset committed to the store its placeholder names); an unsigned one fails the flow run in one line."""
    from artifacts.store import Store
    from flows.stage_flow import stage_flow
    from flows.stage_requests import state_error

    parameters, marker = signed
    unsigned = planted(parameters, marker)
    del unsigned["request_signature"]
    state = stage_flow(**unsigned, return_state=True)
    assert state.is_failed() and state_error(state) == MISSING and not marker.exists()
    outputs = stage_flow(**parameters)
    assert Store(f"file://{tmp_path / 'store'}").manifest(outputs["dataset"])["kind"] == "dataset"
