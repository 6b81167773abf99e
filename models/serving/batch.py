"""`posttrain serve-model`'s batching: requests that wait together decode together.

One engine thread takes the requests queued for it: all that arrived while it was decoding the
previous batch, or, when it was idle, those that arrive within `window` seconds of the one before
(at most WINDOWS windows after the first). Jobs
with the same sampling parameters and adapter decode as one batch of the engine
(models/sampling.generate_tokens; the Decoder shares a prompt's prefill between its rows, so the
`n` samples of a request cost one prompt). Every row samples from its own seed, so what a request
gets does not depend on the requests it shares a batch with.

A job is claimed by the engine or abandoned by its request, whichever comes first: a request that
waited past its queue deadline, or whose client went away, is never decoded, and one abandoned
while it decodes leaves the batch at the next step.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from models.sampling import Generation, SamplingParams

WAITING, DECODING, ABANDONED, DONE = "waiting", "decoding", "abandoned", "done"
WINDOWS = 4  # an idle engine waits at most this many windows for a batch to fill


@dataclass(eq=False)
class Job:
    """One request's rows: its prompts (a request's `n` copies of each), their seeds, its adapter."""

    prompts: list[list[int]]
    params: SamplingParams
    seeds: list[int]
    adapter: str | None = None  # a runtime LoRA adapter's name; None: the served weights
    copies: int = 1  # rows per prompt (a request's `n`, or 1 when greedy: its choices are one)
    state: str = WAITING
    generations: list[Generation] = field(default_factory=list)
    error: BaseException | None = None
    notify: object = None  # called (on the engine thread) once the job is finished
    # a streamed job: each row's (token, log-prob, alternatives) so far, and what to call when they grow
    drawn: list[list[tuple]] | None = None
    progress: object = None
    finished: threading.Event = field(default_factory=threading.Event)
    started: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def claim(self) -> bool:
        """The engine takes the job, unless its request gave up on it first."""
        with self._lock:
            if self.state != WAITING:
                return False
            self.state = DECODING
        self.started.set()
        if self.progress is not None:
            self.progress()
        return True

    def abandon(self) -> bool:
        """The request gives up; True when the engine had not started it (it never will)."""
        with self._lock:
            was_waiting = self.state == WAITING
            if self.state in (WAITING, DECODING):
                self.state = ABANDONED
        return was_waiting

    def finish(self, generations: list[Generation] | None = None, error: BaseException | None = None) -> None:
        with self._lock:
            if self.state == DECODING:
                self.state = DONE
        self.generations, self.error = generations or [], error
        self.finished.set()
        if self.notify is not None:
            self.notify()


def batch_key(job: Job) -> tuple:
    return job.params, job.adapter


class Batcher:
    """The engine thread. `decode(prompts, params, seeds, adapter, abandoned, on_step)` runs one batch
    and returns a Generation per prompt (`on_step` feeds streamed jobs their tokens as they are drawn,
    None when no job of the batch streams); `batches` keeps the (requests, rows) of the last ones."""

    def __init__(self, decode, window: float = 0.01, max_rows: int = 256):
        self.decode, self.window, self.max_rows = decode, window, max_rows
        self.jobs: queue.Queue = queue.Queue()
        self.batches: deque[tuple[int, int]] = deque(maxlen=1024)
        self.engine = threading.Lock()  # held while a batch decodes
        self.waiting = 0  # jobs submitted and not yet decoding (or dropped)
        self.dropped = 0  # jobs their requests gave up on before the engine took them
        self.cut = 0  # jobs their requests gave up on while they decoded (their rows left the batch)
        self._count = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="serve-model-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> Job:
        with self._count:
            self.waiting += 1
        self.jobs.put(job)
        return job

    def queued(self) -> int:
        """Jobs waiting for the engine."""
        return self.waiting

    def close(self) -> None:
        self.jobs.put(None)

    def _run(self) -> None:
        while True:
            first = self.jobs.get()
            if first is None:
                return
            pending = [first]
            latest = time.monotonic() + WINDOWS * self.window
            deadline = min(time.monotonic() + self.window, latest)
            while (left := deadline - time.monotonic()) > 0:
                try:
                    pending.append(self.jobs.get(timeout=left))
                except queue.Empty:
                    break
                deadline = min(time.monotonic() + self.window, latest)  # clients answered together come back together
            with self.engine:  # what arrived while the engine was held joins this round
                while True:
                    try:
                        pending.append(self.jobs.get_nowait())
                    except queue.Empty:
                        break
                if None in pending:
                    return
                for group in groups(pending, self.max_rows):
                    self._decode(group)

    def _decode(self, group: list[Job]) -> None:
        jobs = [job for job in group if job.claim()]
        with self._count:
            self.waiting -= len(group)
            self.dropped += len(group) - len(jobs)
        if not jobs:
            return
        prompts = [p for job in jobs for p in job.prompts]
        owner = [k for k, job in enumerate(jobs) for _ in job.prompts]
        self.batches.append((len(jobs), len(prompts)))

        def abandoned() -> set[int]:
            return {row for row, k in enumerate(owner) if jobs[k].state == ABANDONED}

        streamed = [job for job in jobs if job.drawn is not None]
        offsets = [sum(len(j.prompts) for j in jobs[:k]) for k in range(len(jobs))]

        def on_step(rows: list[int], tokens: list[int], logprobs: list[float], tops) -> None:
            touched = set()
            for i, row in enumerate(rows):
                job = jobs[owner[row]]
                if job.drawn is not None:
                    job.drawn[row - offsets[owner[row]]].append((tokens[i], logprobs[i], tops[i] if tops else None))
                    touched.add(owner[row])
            for k in touched:
                jobs[k].progress()

        try:
            generations = self.decode(prompts, jobs[0].params, [s for job in jobs for s in job.seeds],
                                      jobs[0].adapter, abandoned, on_step if streamed else None)
        except Exception as exc:  # noqa: BLE001 - every waiting request hears of it
            for job in jobs:
                job.finish(error=exc)
            return
        self.cut += sum(job.state == ABANDONED for job in jobs)
        start = 0
        for job in jobs:
            job.finish(generations[start:start + len(job.prompts)])
            start += len(job.prompts)


def groups(jobs: list[Job], max_rows: int) -> list[list[Job]]:
    """Jobs by sampling parameters and adapter, in arrival order, each group at most `max_rows`
    rows (a bigger job is a group of its own)."""
    by_key: dict[tuple, list[list[Job]]] = {}
    for job in jobs:
        runs = by_key.setdefault(batch_key(job), [[]])
        if runs[-1] and sum(len(j.prompts) for j in runs[-1]) + len(job.prompts) > max_rows:
            runs.append([])
        runs[-1].append(job)
    return [run for runs in by_key.values() for run in runs]
