"""Every e2e test runs its `posttrain` commands against the shared real Prefect server
(tests/conftest.py: shared_prefect_api). Tests of ephemeral mode itself unset PREFECT_API_URL
for their runs (helpers.EPHEMERAL); tests of triggers and workers start servers of their own."""

import pytest


@pytest.fixture(autouse=True)
def _against_the_shared_server(shared_prefect_api):
    yield
