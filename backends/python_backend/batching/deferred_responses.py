"""Send a window's responses just after ``execute()`` returns, so that Triton's batcher never sleeps on them.

Why: with a queue policy (``max_queue_size``, a queue timeout or priorities) Triton's dynamic batcher
(2.51, and core's main) is woken by a new request only while an instance is parked waiting for work,
and an instance that finishes parks again without waking it (``RateLimiter::DequeuePayload``). When
``execute()`` returns the responses, every client's next request arrives while the instance is still
finishing, wakes no one, and waits out the batcher's fixed 500 ms idle wait (benchmarks/RESULTS.md,
"Overload"). Returning first (``None``: a Python model may answer through each request's response
sender) and sending the responses from this thread a moment later means the next requests arrive after
the instance is parked again, and wake the batcher as they should.

Used when the configuration sets a queue policy (``settings.has_queue_policy``; model parameter
``respond_after_return`` = auto | true | false): without one Triton prefetches payloads, the wake-up is not
lost, and returning the responses from ``execute()`` is the faster path (one message for the window).

One daemon thread per instance; windows are sent in the order they were handed over, each request's
response exactly once with the final flag. :meth:`ResponseDispatcher.close` sends what is left first.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Sequence

# send(sender, response): the Python backend's ``sender.send(response, flags=COMPLETE_FINAL)``.
Send = Callable[[Any, Any], None]
Log = Callable[[str], None]
_STOP = object()


class ResponseDispatcher:
    """A thread that sends windows of responses through their requests' response senders."""

    def __init__(self, send: Send, log_error: Log = lambda _m: None) -> None:
        self._send = send
        self._log_error = log_error
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="mf-responses", daemon=True)
        self._thread.start()
        self.sent = 0
        self.failed = 0

    def dispatch(self, senders: Sequence[Any], responses: Sequence[Any]) -> None:
        """Queue one window: ``responses[i]`` goes to ``senders[i]``."""
        if len(senders) != len(responses):
            raise ValueError(f"{len(responses)} responses for {len(senders)} requests")
        self._queue.put((tuple(senders), tuple(responses)))

    def _run(self) -> None:
        while True:
            window = self._queue.get()
            if window is _STOP:
                return
            for sender, response in zip(*window):
                try:
                    self._send(sender, response)
                    self.sent += 1
                except Exception as exc:  # one failed send must not keep the window's other clients waiting
                    self.failed += 1
                    self._log_error(f"model-factory backend: a response could not be sent: {exc}")

    def close(self, timeout_s: float = 30.0) -> None:
        """Send every queued window, then stop the thread."""
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
