"""One run at a time per stage cache key: a create-only claim in the store.

Two runs of one spec (two schedules, a rerun while the first still runs, a retry on another
worker) would otherwise train the same stage twice, sharing and clearing one scratch folder
(`scratch/<cache key>/`). The first to create `claims/<cache key>/<n>.json` runs the stage; the
others wait for its cache entry and take its result, or take over once its claim is released
without a result (it failed) or is stale (its process is gone, or its heartbeat stopped).
A takeover creates claim n+1 (create-only too), so two waiters never both win. One narrow race
is left: a holder presumed dead (no heartbeat from another host) that was only slow may still
finish and release while the waiter that took over runs; both then commit the same content
(commits are idempotent), and the scratch folder is shared only in that case.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable

from artifacts.store import AlreadyExists, Store, StoreError
from tasks.runtime.processes import alive, start_time

HEARTBEAT_SECONDS = 15.0
STALE_SECONDS = 120.0  # a holder on another host is presumed dead after this long without a heartbeat
POLL_SECONDS = 1.0


class ClaimTimeout(Exception):
    """Another run held the stage for longer than this one may wait; str() names it."""


class Claim:
    """Held by this process, which beats its heartbeat from a thread (waiting for GPU slots
    included) until `release()`."""

    def __init__(self, store: Store, path: str, body: dict):
        self.store, self.path, self.body = store, path, body
        self.released, self.writing = threading.Event(), threading.Lock()
        threading.Thread(target=self._beat, daemon=True, name=f"claim {path}").start()

    def _beat(self) -> None:
        while not self.released.wait(HEARTBEAT_SECONDS):
            with self.writing:  # never after release: a beat must not write a removed claim back
                if self.released.is_set():
                    return
                self.body["heartbeat"] = time.time()
                try:
                    self.store.write_json(self.path, self.body)
                except (OSError, StoreError) as exc:  # a store hiccup: the next beat tries again
                    warnings.warn(f"claim {self.path}: heartbeat not written: {exc}", stacklevel=1)

    def release(self) -> None:
        with self.writing:
            self.released.set()
            self.store.remove(self.path)


def claim_path(store: Store, key: str, generation: int = 0) -> str:
    return store.path("claims", key, f"{generation}.json") if generation else store.path("claims", key)


def claim_stage(store: Store, key: str, run_id: str, wait_seconds: float,
                cached: Callable[[], dict | None]) -> Claim | dict:
    """A claim on the stage for this process, or the result (`cached()`) of the run that held it."""
    deadline = time.monotonic() + wait_seconds
    while True:
        result = cached()
        if result is not None:
            return result
        generation, holder = current_claim(store, key)
        if holder is None or holder["run_id"] == run_id or stale(holder):
            body = own_claim(run_id)
            try:
                store.create_only(claim_path(store, key, generation + 1), json.dumps(body).encode())
                return Claim(store, claim_path(store, key, generation + 1), body)
            except AlreadyExists:
                continue  # another waiter won this generation: look again
        if time.monotonic() > deadline:
            raise ClaimTimeout(f"run {holder['run_id']} (pid {holder['pid']} on {holder['host']}) has been running "
                               f"this stage for longer than this one may wait ({wait_seconds:g}s); "
                               f"{claim_path(store, key)} holds its claim")
        time.sleep(POLL_SECONDS)


def current_claim(store: Store, key: str) -> tuple[int, dict | None]:
    """The newest claim's generation and body; (n, None) when none is held (a half-written or
    unreadable claim counts as held by nobody, at its generation)."""
    generations = [int(name[:-5]) for name in store.listdir(claim_path(store, key))
                   if name.endswith(".json") and name[:-5].isdigit()]
    if not generations:
        return 0, None
    newest = max(generations)
    try:
        body = store.read_json(claim_path(store, key, newest))
    except (OSError, ValueError, StoreError):  # unreadable, or released since it was listed
        return newest, None
    valid = isinstance(body, dict) and {"run_id", "host", "pid", "started", "heartbeat"} <= body.keys()
    return newest, body if valid else None


def own_claim(run_id: str) -> dict:
    pid = os.getpid()
    return {"run_id": run_id, "host": socket.gethostname(), "pid": pid, "started": start_time(pid),
            "pids": pid_space(), "heartbeat": time.time()}


def pid_space() -> str:
    """Which pids a process sees: its boot and its pid namespace. Containers sharing a host name
    (host networking) see different pids; only within one space does a pid name a process."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def stale(holder: dict) -> bool:
    """The holder's process is gone (in this pid space: checked directly) or stopped beating."""
    here = pid_space()
    if here and holder.get("pids") == here and holder["host"] == socket.gethostname() \
            and isinstance(holder["pid"], int):
        return not alive(holder["pid"]) or start_time(holder["pid"]) != holder["started"]
    return time.time() - float(holder["heartbeat"]) > STALE_SECONDS
