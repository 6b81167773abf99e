"""The e2e tests share one real `prefect server start` on 127.0.0.1: a `posttrain run` against a
running server starts in ~3 s instead of the ~12 s a temporary (ephemeral) API takes to come up.
Tests of ephemeral mode itself unset PREFECT_API_URL for their runs (helpers.EPHEMERAL); tests of
triggers and workers start servers of their own."""

import os

import pytest

from e2e.prefect_server import prefect_server


@pytest.fixture(scope="package", autouse=True)
def shared_prefect_server(tmp_path_factory):
    with prefect_server(tmp_path_factory.mktemp("shared-prefect")) as server:
        saved = {key: os.environ.get(key) for key in server}
        os.environ.update(server)
        yield server
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
