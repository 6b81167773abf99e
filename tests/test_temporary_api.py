"""flows/temporary_api.py: the temporary Prefect API server `posttrain run` and `eval` start
themselves in ephemeral mode comes up, serves as this process's Prefect API without counting as
a named server, and stops; a server that cannot start is a one-line error, not a hang."""

import os

import httpx
import pytest

from flows import temporary_api
from flows.temporary_api import TemporaryApi, ephemeral


@pytest.fixture
def restored_settings(monkeypatch):
    """The process's Prefect settings as they were, whatever the test sets."""
    from prefect.context import refresh_global_settings_context

    for name in ("PREFECT_API_URL", "PREFECT_UI_URL", temporary_api.TEMPORARY_API_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    yield
    for name in ("PREFECT_API_URL", "PREFECT_UI_URL", temporary_api.TEMPORARY_API_VARIABLE):
        os.environ.pop(name, None)
    monkeypatch.undo()
    refresh_global_settings_context()


def test_it_serves_as_the_api_yet_the_run_stays_ephemeral(restored_settings):
    from prefect.settings import PREFECT_API_URL

    server = TemporaryApi()
    try:
        url = server.use(timeout=120)
        assert PREFECT_API_URL.value() == url == f"http://127.0.0.1:{server.port}/api"
        assert httpx.get(f"{url}/health").status_code == 200
        assert ephemeral()  # no server was named: inline evaluation, no triggers
        os.environ["PREFECT_API_URL"] = "http://127.0.0.1:4200/api"  # one the user names
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()
        assert not ephemeral()
    finally:
        server.stop()
    assert server.process.poll() is not None


def test_a_server_that_exits_is_one_line_not_a_hang(restored_settings, monkeypatch):
    import subprocess
    import sys

    monkeypatch.setattr(temporary_api, "_spawn", lambda port: subprocess.Popen([sys.executable, "-c", "exit(1)"]))
    server = TemporaryApi()
    with pytest.raises(RuntimeError, match=r"on 127\.0\.0\.1:\d+ exited with status 1 before it answered"):
        server.use(timeout=30)
