"""Every e2e test runs its `posttrain` commands against the shared real Prefect server
(tests/conftest.py: shared_prefect_api). Tests of ephemeral mode itself unset PREFECT_API_URL
for their runs (helpers.EPHEMERAL); tests of triggers and workers start servers of their own."""

from types import SimpleNamespace

import pytest

from tests.e2e.helpers import posttrain, summary, tiny_spec, write


@pytest.fixture(autouse=True)
def _against_the_shared_server(shared_prefect_api):
    yield


@pytest.fixture(scope="session")
def s3_run(tmp_path_factory, s3_endpoint, prefect_api_server):
    """The tiny pipeline on an s3:// store (moto), its endpoint from `${S3_ENDPOINT_URL}`, run once
    against the shared server for the tests that read it (the store and lineage in test_pipeline,
    the report artifacts in a browser in test_report_ui)."""
    tmp_path = tmp_path_factory.mktemp("s3-run")
    spec = write(tmp_path, tiny_spec("file://unused", storage_options={"endpoint_url": "${S3_ENDPOINT_URL}"}))
    env = {**prefect_api_server, "S3_ENDPOINT_URL": s3_endpoint}
    result = posttrain("run", spec, "--store", "s3://posttrain-test/e2e", "--summary-json", tmp_path / "run.json",
                       env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return SimpleNamespace(result=result, summary=summary(tmp_path / "run.json"), env=env,
                           store="s3://posttrain-test/e2e", endpoint=s3_endpoint)
