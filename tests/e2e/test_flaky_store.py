"""`posttrain run` against an S3 store behind a flaky endpoint (tests/flaky_s3.py in front of moto's
server): every artifact file's first PUT answered 503, every manifest's and claim's first PUT
stored but its answer lost past the read timeout. The run completes, and `posttrain verify`
accepts what it committed."""

import pytest

from flaky_s3 import HOLD_AFTER_FORWARD, SLOW_DOWN, Fault, FlakyS3Proxy
from artifacts.store import Store
from tests.e2e.helpers import posttrain, summary, tiny_spec, write

STORE = "s3://posttrain-test/flaky-e2e"
READ_TIMEOUT_S = 2


@pytest.fixture
def flaky(s3_endpoint):
    with FlakyS3Proxy(s3_endpoint) as proxy:
        yield proxy


def test_flaky_store_run_completes_and_verifies(flaky, tmp_path):
    # botocore retries nothing itself: every fault reaches the store's own retries
    client = {"read_timeout": READ_TIMEOUT_S, "connect_timeout": READ_TIMEOUT_S, "retries": {"max_attempts": 0}}
    spec = tiny_spec(STORE, sft={"max_steps": 4}, storage_options={"endpoint_url": "${FLAKY_S3_URL}",
                                                                  "config_kwargs": client})
    spec["stages"] = [stage for stage in spec["stages"] if stage["id"] in ("warmup", "sft")]
    flaky.inject(
        Fault(HOLD_AFTER_FORWARD, path=r"/artifacts/.*/MANIFEST\.json$|/claims/", times=1, hold_s=READ_TIMEOUT_S + 1),
        Fault(SLOW_DOWN, path=r"/artifacts/", times=1, code="ServiceUnavailable"),
    )

    result = posttrain("run", write(tmp_path, spec), "--summary-json", tmp_path / "run.json",
                       env={"FLAKY_S3_URL": flaky.endpoint})

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = summary(tmp_path / "run.json")
    assert run["state"] == "completed" and {stage["state"] for stage in run["stages"]} == {"completed"}
    held, refused = flaky.done(HOLD_AFTER_FORWARD), flaky.done(SLOW_DOWN)
    flaky.clear()
    refs = [ref for stage in run["stages"] for ref in stage["outputs"].values()]
    assert any(ref.startswith("tiny/sft@") for ref in refs)
    store = Store(STORE, {"endpoint_url": flaky.endpoint})
    for ref in refs:  # every file of every output was refused once, every manifest's answer lost once
        folder = store.version_path(store.resolve(ref))
        assert f"/{folder}/MANIFEST.json" in held
        assert all(f"/{folder}/{entry['path']}" in refused for entry in store.manifest(ref)["files"])
        verified = posttrain("verify", ref, "--store", STORE, env={"AWS_ENDPOINT_URL_S3": flaky.endpoint})
        assert verified.returncode == 0 and verified.stdout.startswith(f"{ref}: ok"), verified.stdout + verified.stderr
    assert any("/claims/" in path for path in held)
