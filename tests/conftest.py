import contextlib
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
for key, value in {"HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                   "GX_ANALYTICS_ENABLED": "False", "TOKENIZERS_PARALLELISM": "false",
                   "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                   # a loaded 2-core machine can take longer than Prefect's 20 s to start its temporary server
                   "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}.items():
    os.environ[key] = value
# `make test` runs two pytest-xdist workers: each its own Prefect home (the temporary API's sqlite)
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
os.environ.setdefault("PREFECT_HOME", str(ROOT / ".posttrain" / f"test-prefect-home{'-' + WORKER if WORKER else ''}"))
Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)  # Prefect's sqlite needs the folder
os.environ.pop("PREFECT_API_URL", None)
POSTTRAIN = str(Path(sys.executable).with_name("posttrain"))


def share_the_cores() -> None:
    """Under xdist, each worker (and every process it starts) keeps to its own share of the cores:
    torch sizes its thread pool to the cores a process may use (as does tasks/runtime/core_share.py),
    and two workers each spinning threads on all cores run several times slower than one on each."""
    if not WORKER:
        return
    cores = sorted(os.sched_getaffinity(0))
    workers, index = int(os.environ["PYTEST_XDIST_WORKER_COUNT"]), int(WORKER.removeprefix("gw"))
    if len(cores) >= workers:
        os.sched_setaffinity(0, cores[index::workers])


share_the_cores()

# Tests that read one session fixture run on one worker (so it is built once); the others go by
# module, so module fixtures are built once too (`--dist loadgroup`).
ONE_WORKER_FOR = {"base_url": "served-model", "s3_run": "s3-run", "judge_url": "judge", "score_judge_url": "judge"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        shared = [group for fixture, group in ONE_WORKER_FOR.items() if fixture in item.fixturenames]
        item.add_marker(pytest.mark.xdist_group(shared[0] if shared else item.module.__name__))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serving(server, port: int):
    """A uvicorn.Server run in a background thread until the block ends; yields its base URL (/v1)."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the server did not start"
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 API (moto's server) on 127.0.0.1, with a bucket; credentials only via env."""
    from moto.server import ThreadedMotoServer

    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing-secret",
                      AWS_DEFAULT_REGION="us-east-1")
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="posttrain-test")
    yield endpoint
    server.stop()


@pytest.fixture(scope="session")
def judge_url():
    """A yes/no judge model (tests/tiny_sft.py: judge_folder) served by models.serving on 127.0.0.1 as `judge`."""
    from test_serve_model import running_server
    from tiny_sft import judge_folder

    with running_server(judge_folder("yes_no"), "judge") as url:
        yield url


@pytest.fixture(scope="session")
def score_judge_url():
    """A judge model answering scores (tests/tiny_sft.py: judge_folder), served as `judge`."""
    from test_serve_model import running_server
    from tiny_sft import judge_folder

    with running_server(judge_folder("score"), "judge") as url:
        yield url


@pytest.fixture(scope="session")
def base_url():
    """The SFT'd tiny-llama of test_serve_model behind models.serving (uvicorn, 127.0.0.1): one
    server for the session's serving, endpoint-policy and teacher tests; yields its base URL."""
    from test_serve_model import running_server, trained_checkpoint

    with running_server(trained_checkpoint()) as url:
        yield url


@pytest.fixture(scope="session")
def prefect_api_server(tmp_path_factory):
    """One real `prefect server start` on 127.0.0.1 for the whole session, started on first use:
    a `posttrain run` against a running server starts in ~3 s instead of the ~12 s a temporary
    (ephemeral) API takes to come up. Its web UI is on too, for the browser test of the report
    artifacts (tests/e2e/test_report_ui.py)."""
    from e2e.prefect_server import prefect_server

    with prefect_server(tmp_path_factory.mktemp("shared-prefect"), ui=True) as server:
        yield server


@pytest.fixture
def shared_prefect_api(prefect_api_server, monkeypatch):
    """This test's subprocesses (`posttrain run`, ...) use the shared server. (This process's own
    Prefect settings were fixed at import: in-process flows keep the ephemeral API.)"""
    for key, value in prefect_api_server.items():
        monkeypatch.setenv(key, value)
    return prefect_api_server
