"""Progress of long build steps, told through the stage's ``progress`` callback (one line each).

Stages report through a plain ``Callable[[str], None]``; the CLI decides how a line looks. Two helpers
keep long steps from going silent:

* :class:`Steps` says ``label: i/n`` at roughly every tenth of a counted loop (calibration batches,
  the sensitivity search's nodes);
* :func:`heartbeat` says ``label: still running (N s)`` every few seconds while one opaque call runs
  (a TensorRT engine build).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

Progress = Callable[[str], None]


class Steps:
    """Counts ``total`` steps and reports about ``reports`` times (always the last step)."""

    def __init__(self, say: Progress, label: str, total: int, reports: int = 10) -> None:
        self.say = say
        self.label = label
        self.total = max(int(total), 0)
        self.every = max(1, -(-self.total // max(reports, 1)))
        self.done = 0
        self.started = time.perf_counter()

    def step(self, n: int = 1) -> None:
        before = self.done
        self.done = min(self.total, self.done + n)
        if self.done == self.total or self.done // self.every > before // self.every:
            self.say(f"{self.label}: {self.done}/{self.total} ({time.perf_counter() - self.started:.1f} s)")


@contextlib.contextmanager
def heartbeat(say: Progress, label: str, every: float = 10.0) -> Iterator[None]:
    """While the block runs, say ``label: still running (N s)`` every ``every`` seconds."""
    stop = threading.Event()
    started = time.perf_counter()

    def beat() -> None:
        while not stop.wait(every):
            say(f"{label}: still running ({time.perf_counter() - started:.0f} s)")

    thread = threading.Thread(target=beat, name="progress-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
