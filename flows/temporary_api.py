"""Prefect's temporary API server (ephemeral mode: PREFECT_API_URL unset), started by the command
the moment it knows it needs one.

Left to itself, Prefect starts this server on the flow's first API call, after importing its
server package in the calling process only to build the server's command line (~3 s of CPU on
this 2-core machine, in the critical path). Started here instead, at the top of `posttrain run`
or `eval`, as the same uvicorn command Prefect runs (prefect.server.api.server's
SubprocessASGIServer, with its environment), it comes up while the spec is read and the stages'
imports load, and this process never imports the server package. Once it answers, this process
(and the stages it starts) use it as PREFECT_API_URL; `ephemeral()` still says no server was
named. It stops when the command ends; flows/cli/reaper.py kills it if the command is killed.
"""

from __future__ import annotations

import atexit
import os
import random
import socket
import subprocess
import sys
import time

TEMPORARY_API_VARIABLE = "POSTTRAIN_TEMPORARY_API"  # the API URL below, when it is ours
PORTS = range(8000, 9000)
PORT_IN_USE = 3  # uvicorn's exit status when it cannot bind
POLL_SECONDS = 0.1
STOP_SECONDS = 5


def ephemeral() -> bool:
    """No Prefect server named: the command runs against a temporary API, nobody serves triggers."""
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    return api is None or api == os.environ.get(TEMPORARY_API_VARIABLE)


class TemporaryApi:
    """The server process, from `start` until `stop`."""

    def __init__(self):
        self.port = _free_port()
        self.process = _spawn(self.port)
        atexit.register(self.stop)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def use(self, timeout: float) -> str:
        """Wait until the server answers, then make it this process's Prefect API; returns its URL."""
        import httpx

        deadline = time.monotonic() + timeout
        with httpx.Client() as client:
            while time.monotonic() < deadline:
                if self.process.poll() == PORT_IN_USE:  # taken since we looked: another port
                    self.port = _free_port()
                    self.process = _spawn(self.port)
                elif self.process.poll() is not None:
                    break
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return self._used()
                except httpx.TransportError:
                    pass
                time.sleep(POLL_SECONDS)
        code = self.process.poll()
        if code is not None:
            raise RuntimeError(f"Prefect's temporary API server on 127.0.0.1:{self.port} exited with status "
                               f"{code} before it answered")
        raise RuntimeError(f"Prefect's temporary API server did not answer on 127.0.0.1:{self.port} within "
                           f"{timeout:.0f} s")

    def _used(self) -> str:
        from prefect.context import refresh_global_settings_context

        os.environ["PREFECT_API_URL"] = os.environ[TEMPORARY_API_VARIABLE] = self.url
        os.environ["PREFECT_UI_URL"] = ""  # it serves no UI: no "View at" links to it
        refresh_global_settings_context()
        return self.url

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _spawn(port: int) -> subprocess.Popen:
    """Prefect's own command and environment for its temporary server (UI off, ephemeral)."""
    import prefect

    server_env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
         "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port), "--log-level",
         "error", "--lifespan", "on"],
        env={**os.environ, **server_env})


def _free_port() -> int:
    for _ in range(20):
        port = random.choice(PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port for Prefect's temporary API server in {PORTS.start}-{PORTS.stop - 1}")
