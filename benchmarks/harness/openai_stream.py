"""One streamed OpenAI-API request read as the benchmarks read it: each choice event's arrival time, its text, the
finish reason and the usage the server sent (``stream_options.include_usage``). bench_generate, bench_chunked_prefill
and bench_served_overhead read their servers' streams through it."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Streamed:
    sent: float  # time.perf_counter() when the request was posted
    times: tuple[float, ...]  # perf_counter() at each choice event (an event may carry several tokens)
    pieces: tuple[str, ...]  # each choice event's text
    finish_reason: str | None
    usage: dict | None  # the last usage the server sent, if any

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def chunks(self) -> int:
        return len(self.times)

    @property
    def ttft(self) -> float | None:
        return self.times[0] - self.sent if self.times else None

    def usage_of(self, key: str) -> int | None:
        return (self.usage or {}).get(key)


async def stream_completion(session, url: str, body: dict, path: str = "/v1/completions",
                            on_event: Callable[[float, str], None] | None = None) -> Streamed:
    """POST ``body`` (``"stream": True``) to ``url + path`` on an aiohttp ``session`` and read its server-sent events
    to ``[DONE]``; a status other than 200 fails with the server's answer. ``on_event(time, text)`` is called at each
    choice event as it arrives (what a reader cancelled before the end has seen)."""
    sent = time.perf_counter()
    times: list[float] = []
    pieces: list[str] = []
    finish, usage = None, None
    async with session.post(f"{url}{path}", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            for choice in event.get("choices") or []:
                times.append(time.perf_counter())
                pieces.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
                if on_event is not None:
                    on_event(times[-1], pieces[-1])
                finish = choice.get("finish_reason") or finish
            usage = event.get("usage") or usage
    return Streamed(sent, tuple(times), tuple(pieces), finish, usage)
