"""Whether each live generate request's client went away, asked off the engine loop.

``request.is_cancelled()`` is a round trip to the Triton process. Asked from the engine loop for every running
sequence (at most every 50 ms), it held that loop 8% of its time at 32 streams (py-spy of the stub, 2026-12-04):
time in which no step ran. A :class:`CancelWatch` thread asks every watched request instead, every
``interval_s``, and keeps the answer in a :class:`CancelFlag`; the scheduler's ``is_cancelled`` reads the flag.
A cancelled stream is therefore seen within ``interval_s`` and freed at the next step, as before.

A flag is watched from :meth:`CancelWatch.watch` until :meth:`CancelFlag.close` or until it reads cancelled.
``close`` must come before the request's final response is handed over: once Triton has that response it frees
the request, and asking a freed request whether it was cancelled crashes the server (SIGSEGV in
``TRITONBACKEND_ResponseFactoryIsCancelled``: seen when the watcher asked a request the response thread had just
answered). So each question is asked under the flag's lock, and ``close`` takes that lock: it waits for a question
in flight, and none is asked after it. A question that fails counts as "not cancelled" (logged once per request):
the sequence runs to its end, as it would with nobody asking.
"""

from __future__ import annotations

import threading
from typing import Callable

Log = Callable[[str], None]


class CancelFlag:
    """One request's "was it cancelled", as the watcher last heard it; call it to read."""

    __slots__ = ("_ask", "_watch", "_lock", "open", "cancelled", "failed")

    def __init__(self, ask: Callable[[], bool], watch: "CancelWatch") -> None:
        self._ask = ask
        self._watch = watch
        self._lock = threading.Lock()
        self.open = True
        self.cancelled = False
        self.failed = False

    def __call__(self) -> bool:
        return self.cancelled

    def ask(self) -> bool:
        """Ask the request now (the watcher's question): False once closed, without asking."""
        with self._lock:
            return bool(self._ask()) if self.open else False

    def close(self) -> None:
        """Stop asking, before the request's final response is handed over: returns once no question is in flight,
        and none is asked after."""
        with self._lock:
            self.open = False
        self._watch._forget(self)


class CancelWatch:
    """A daemon thread that asks each watched request whether it was cancelled, every ``interval_s``."""

    def __init__(self, interval_s: float = 0.05, log_error: Log = lambda _m: None) -> None:
        self.interval_s = float(interval_s)
        self._log_error = log_error
        self._lock = threading.Lock()
        self._live: dict[int, CancelFlag] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mf-cancel-watch", daemon=True)
        self._thread.start()

    def watch(self, ask: Callable[[], bool]) -> CancelFlag:
        flag = CancelFlag(ask, self)
        with self._lock:
            self._live[id(flag)] = flag
        return flag

    def watched(self) -> int:
        with self._lock:
            return len(self._live)

    def _forget(self, flag: CancelFlag) -> None:
        with self._lock:
            self._live.pop(id(flag), None)

    def poll(self) -> None:
        """Ask every watched request once (the thread's round; tests call it directly)."""
        with self._lock:
            flags = list(self._live.values())
        for flag in flags:
            try:
                cancelled = flag.ask()
            except Exception as exc:  # noqa: BLE001 - a failed question must not stop the others
                if not flag.failed:
                    flag.failed = True
                    self._log_error(f"model-factory backend: is_cancelled() failed: {type(exc).__name__}: {exc}")
                continue
            if cancelled:
                flag.cancelled = True
                self._forget(flag)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
