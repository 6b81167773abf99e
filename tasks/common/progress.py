"""A terminal progress line for a stage's loop (training steps, generation and evaluation batches),
also handed to a callback (the orchestrator's live progress: StageContext.report_progress).

On a terminal the line is redrawn in place every step; anywhere else (CI, a stage's child
process piped into the parent's log) a full line is printed every `log_every` steps and on the
last, so logs stay short.
"""

from __future__ import annotations

import sys
import time

BAR_WIDTH = 20


class Progress:
    """Progress of steps `start + 1 .. total`; a resumed stage passes the step it resumed from."""

    def __init__(self, total: int, start: int, label: str, stream=None, log_every: int = 25,
                 clock=time.monotonic, on_update=None):
        self.total, self.start, self.label = max(1, total), start, label
        # called at every update with {step, total, eta_seconds, metrics, line}; `line` is the full
        # line every `log_every` steps and on the last (what a log keeps), else None
        self.on_update = on_update
        self.stream = stream if stream is not None else sys.stdout
        self.log_every = max(1, log_every)
        self.clock = clock
        self.began = clock()
        self.redraw = _is_tty(self.stream)
        self.drawn_width = 0  # width of the line on screen (TTY), to blank out what a shorter line leaves

    def update(self, step: int, **metrics: float) -> None:
        """Report that `step` steps are done (1-based), with the metrics to show beside the bar."""
        line = self.line(step, metrics)
        if self.redraw:
            self.stream.write("\r" + line.ljust(self.drawn_width) + ("\n" if step >= self.total else ""))
            self.drawn_width = 0 if step >= self.total else len(line)
        elif step % self.log_every == 0 or step >= self.total:
            self.stream.write(line + "\n")
        self.stream.flush()
        if self.on_update is not None:
            eta = self.eta_seconds(step)
            logged = step % self.log_every == 0 or step >= self.total
            self.on_update({"step": step, "total": self.total, "eta_seconds": None if eta is None else round(eta, 1),
                            "metrics": {name: value for name, value in metrics.items()
                                        if isinstance(value, (int, float)) and not isinstance(value, bool)},
                            "line": line if logged else None})

    def close(self) -> None:
        """End a redrawn line that the last step did not end (a loop left early)."""
        if self.redraw and self.drawn_width:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn_width = 0

    def line(self, step: int, metrics: dict) -> str:
        share = min(1.0, max(0.0, step / self.total))
        filled = round(share * BAR_WIDTH)
        parts = [f"[{self.label}] step {step}/{self.total} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] "
                 f"{share:4.0%}"]
        parts += [f"{name} {format_metric(value)}" for name, value in metrics.items()]
        return " ".join(parts) + " | " + self.speed_and_eta(step)

    def seconds_per_step(self, step: int) -> float | None:
        # Only steps done in this process count: a resumed stage's earlier steps took no time here.
        done_here = step - self.start
        elapsed = self.clock() - self.began
        return elapsed / done_here if done_here > 0 and elapsed > 0 else None

    def eta_seconds(self, step: int) -> float | None:
        per_step = self.seconds_per_step(step)
        return None if per_step is None else per_step * max(0, self.total - step)

    def speed_and_eta(self, step: int) -> str:
        per_step = self.seconds_per_step(step)
        if per_step is None:
            return "ETA ?"
        speed = f"{per_step:.1f} s/it" if per_step >= 1 else f"{1 / per_step:.1f} it/s"
        return f"{speed} ETA {format_duration(self.eta_seconds(step))}"


def step_and_eta(progress: dict) -> str:
    """`step 40/120 (33%), ETA 1m05s` of a progress report {step, total, eta_seconds} (read back from
    a store, so any field may be missing or odd)."""
    step, total, eta = progress.get("step"), progress.get("total"), progress.get("eta_seconds")
    line = f"step {step}/{total}" + (f" ({step / total:.0%})" if isinstance(step, int) and total else "")
    return line + (f", ETA {format_duration(eta)}" if isinstance(eta, (int, float)) else "")


def format_duration(seconds: float) -> str:
    """45s, 2m10s, 1h02m."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_metric(value) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3f}"


def _is_tty(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False
