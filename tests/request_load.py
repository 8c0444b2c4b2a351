"""Clients sending requests back to back until stopped, every outcome kept: the load of the rollout tests.

A test subclasses :class:`RequestLoad` with :meth:`~RequestLoad.request` (one call, returning ``(outcome, detail)``:
``"ok"`` or what went wrong, and what the answer says, such as the model version that served it) and, where its client
keeps a connection, :meth:`~RequestLoad.connect` / :meth:`~RequestLoad.disconnect`. Each result is
``(sent, answered, outcome, detail)``; an exception is a failed result, never a lost one.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class RequestLoad:
    """``clients`` threads calling :meth:`request` in a loop; ``with`` starts them and waits for ``warm`` results."""

    def __init__(self, url: str, clients: int = 3, *, warm: int = 6, join_s: float = 120.0) -> None:
        self.url, self.results, self.stop = url, [], threading.Event()
        self.warm, self.join_s = warm, join_s
        self.threads = [threading.Thread(target=self._loop, args=(i,)) for i in range(clients)]

    def connect(self, i: int) -> Any:
        return None

    def disconnect(self, client: Any) -> None:
        return None

    def request(self, client: Any, i: int, n: int) -> tuple[str, Any]:
        raise NotImplementedError

    def _loop(self, i: int) -> None:
        client = self.connect(i)
        n = 0
        try:
            while not self.stop.is_set():
                sent = time.monotonic()
                try:
                    outcome, detail = self.request(client, i, n)
                except Exception as exc:  # noqa: BLE001 - every failure is counted
                    outcome, detail = f"{type(exc).__name__}: {exc}", None
                self.results.append((sent, time.monotonic(), outcome, detail))
                n += 1
        finally:
            self.disconnect(client)

    def __enter__(self) -> "RequestLoad":
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(self.results) < self.warm and time.monotonic() < deadline:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=self.join_s)

    def failed(self) -> list:
        return [r for r in self.results if r[2] != "ok"]
