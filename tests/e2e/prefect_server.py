"""A real `prefect server start` on 127.0.0.1 (free port, its own PREFECT_HOME) for tests of
triggers, served deployments and workers, and small REST helpers against it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
from conftest import free_port

PREFECT = str(Path(sys.executable).with_name("prefect"))


class PrefectServer:
    """`prefect server start` on 127.0.0.1: one port and one PREFECT_HOME (its database) for its life,
    so it can be stopped and started again as a restarted server would be."""

    def __init__(self, home: Path, ui: bool = False):
        self.home, self.ui, self.port = home, ui, free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.process: subprocess.Popen | None = None
        home.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        env = {**os.environ, "PREFECT_HOME": str(self.home), "PREFECT_UI_ENABLED": str(self.ui).lower(),
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        if self.ui:  # the UI's pages call this API (else they call port 4200)
            env.update(PREFECT_UI_API_URL=self.api, PREFECT_SERVER_API_PORT=str(self.port))
        env.pop("PREFECT_API_URL", None)
        with open(self.home / "server.log", "a") as log:
            self.process = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port",
                                             str(self.port)], stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        wait_until(lambda: answers(f"{self.api}/health"), 180,
                   lambda: f"server not up: {(self.home / 'server.log').read_text()[-2000:]}")

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)
            self.process = None

    @property
    def env(self) -> dict:
        """What points a client at it; runners and workers poll fast so a test does not wait on their
        default 10-15 s intervals."""
        return {"PREFECT_API_URL": self.api, "PREFECT_HOME": str(self.home), "PREFECT_RUNNER_POLL_FREQUENCY": "2",
                "PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_WORKER_PREFETCH_SECONDS": "5",
                **({"PREFECT_UI_URL": f"http://127.0.0.1:{self.port}"} if self.ui else {})}


@contextmanager
def prefect_server(home: Path, ui: bool = False):
    """Yields the env vars that point a client at the server (PREFECT_API_URL, PREFECT_HOME; with
    `ui`, PREFECT_UI_URL: where its web UI is, a few seconds more to start)."""
    server = PrefectServer(home, ui)
    server.start()
    try:
        yield server.env
    finally:
        server.stop()


RETRIED = {429, 502, 503}  # what Prefect's own client retries: a busy server (sqlite locked) answers 503


def rest(method: str, url: str, *, json=None, timeout: float = 10, attempts: int = 6) -> httpx.Response:
    """One REST call to a Prefect server, retried with back-off where Prefect's client would."""
    for attempt in range(attempts):
        response = httpx.request(method, url, json=json, timeout=timeout)
        if response.status_code not in RETRIED or attempt == attempts - 1:
            return response
        time.sleep(0.5 * 2 ** attempt)


def answers(url: str) -> bool:
    """Whether `url` answers 200 (a server is up)."""
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until(condition, timeout: float, message, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, message() if callable(message) else message
        time.sleep(interval)


def flow_runs(api: str, flow_name: str) -> list[dict]:
    body = {"flows": {"name": {"any_": [flow_name]}}, "limit": 200}
    return rest("POST", f"{api}/flow_runs/filter", json=body).json()


def deployment(api: str, flow_name: str, name: str) -> dict | None:
    response = rest("GET", f"{api}/deployments/name/{flow_name}/{name}")
    return response.json() if response.status_code == 200 else None


def events(api: str, name: str) -> list[dict]:
    body = {"filter": {"event": {"name": [name]}, "occurred": {"since": "2000-01-01T00:00:00Z"}}, "limit": 50}
    return rest("POST", f"{api}/events/filter", json=body).json()["events"]


def automations(api: str) -> list[dict]:
    return rest("POST", f"{api}/automations/filter", json={}).json()


def latest_artifact(api: str, key: str) -> dict | None:
    response = rest("GET", f"{api}/artifacts/{key}/latest")
    return response.json() if response.status_code == 200 else None


def children(pid: int) -> list[int]:
    """Live child processes of `pid` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children, theirs, ...)."""
    found, parents = set(), [pid]
    while parents:
        kids = children(parents.pop())
        found.update(kids)
        parents += kids
    return found


def flow_run_named(api: str, name: str) -> dict:
    """The one flow run called `name` (a pipeline run's id)."""
    [flow_run] = rest("POST", f"{api}/flow_runs/filter", json={"flow_runs": {"name": {"any_": [name]}}}).json()
    return flow_run


def stop_when_idle(process: subprocess.Popen, timeout: float = 60) -> str:
    """Stop a runner or worker once its flow-run processes have exited (or after `timeout`). A
    flow run reports Completed before its process exits, and a runner stopped in between
    cancels the run with force: Completed would turn Cancelled."""
    deadline = time.monotonic() + timeout
    while children(process.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    return stop(process)


def stop(process: subprocess.Popen) -> str:
    """SIGTERM a started CLI (its process group); returns what it printed."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.stdout.read() if process.stdout else ""
