"""Soak: a served model at fixed concurrency for a long time, with the server's resources sampled.

Requests are drawn (seeded) from real text and sent alternately as ``text`` and as token ids, one
sequence each, at a fixed number in flight, over gRPC. Every ``sample_s`` seconds the resident memory
(RSS), open file descriptors and threads of ``tritonserver`` and of each Python-backend stub are read
with psutil; latencies are kept per minute. :func:`judge` says what a soak must show: no error, no
stub restarted, memory growth after warm-up within a bound, descriptors and threads flat.

Nothing here starts a server: ``benchmarks/soak.py`` and the CI test start one and hand its pid here.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from model_factory.measure.bench import Payload, is_rejection, percentile
from model_factory.errors import FactoryError, require


@dataclass(frozen=True)
class ProcessSample:
    """One reading of one process."""

    rss_kib: int
    fds: int
    threads: int


@dataclass(frozen=True)
class Sample:
    """One reading of the server and its stubs, ``at`` seconds into the run."""

    at: float
    server: ProcessSample
    stubs: tuple[ProcessSample, ...]
    stub_pids: tuple[int, ...]


@dataclass(frozen=True)
class MinuteStats:
    """Latencies of the requests answered in one minute of the run."""

    minute: int
    requests: int
    errors: int
    p50_ms: float
    p99_ms: float


@dataclass
class SoakReport:
    """What a soak saw (see :func:`judge` for the verdict)."""

    seconds: float
    requests: int
    errors: int
    rejected: int
    error_messages: list[str]
    samples: list[Sample]
    minutes: list[MinuteStats]
    sent_text: int = 0
    sent_ids: int = 0
    latencies_ms: list[float] = field(default_factory=list, repr=False)

    @property
    def p50_ms(self) -> float:
        return percentile(self.latencies_ms, 50)

    @property
    def p99_ms(self) -> float:
        return percentile(self.latencies_ms, 99)


def read_process(pid: int) -> ProcessSample:
    """RSS (KiB), open descriptors and threads of ``pid`` (psutil; OSError when it is gone)."""
    import psutil

    try:
        p = psutil.Process(pid)
        with p.oneshot():
            return ProcessSample(p.memory_info().rss // 1024, p.num_fds(), p.num_threads())
    except psutil.Error as exc:
        raise OSError(f"cannot read process {pid}: {exc}") from exc


def sample(server_pid: int, repository: Path, at: float) -> Sample:
    """Read the server and every live stub of ``repository``."""
    from model_factory.serving.supervise import stub_processes

    stubs = stub_processes(server_pid, repository)
    readings = []
    pids = []
    for stub in stubs:
        try:
            readings.append(read_process(stub.pid))
            pids.append(stub.pid)
        except OSError:  # died between the listing and the read: the next sample shows it
            continue
    return Sample(at, read_process(server_pid), tuple(readings), tuple(pids))


def run_soak(url: str, model: str, payloads: Sequence[Payload], server_pid: int, repository: Path, *,
             concurrency: int = 8, seconds: float | None = None, requests: int | None = None,
             sample_s: float = 10.0, output: str = "embedding", timeout_s: float = 60.0,
             reject_pause_s: float = 0.0, send: str = "mixed") -> SoakReport:
    """Load ``model`` at ``url`` (gRPC) with ``payloads`` cycled, for ``seconds`` or ``requests``.

    ``send="mixed"``: even-numbered requests go as ``text``, odd ones as token ids (the payloads must be
    tokenized). Triton batches only requests with the same input names, so a mixed stream runs almost
    every request alone; ``send="ids"`` (or ``"text"``) sends one kind, which Triton batches.
    ``reject_pause_s``: a client whose request was rejected (full queue) waits this long before its
    next one, as a client that retried on another replica would be away from this one.
    """
    if (seconds is None) == (requests is None):
        raise FactoryError("give the soak a duration or a number of requests, not both")
    if send not in ("mixed", "ids", "text"):
        raise FactoryError(f"send={send!r}: use mixed, ids or text")
    if not payloads or any(p.input_ids is None for p in payloads):
        raise FactoryError("the soak needs tokenized payloads (it sends text and token ids)")
    grpc = require("tritonclient.grpc.aio", "client")

    def sends_text(i: int) -> bool:
        return send == "text" or (send == "mixed" and i % 2 == 0)

    def inputs(i: int) -> list[Any]:
        p = payloads[i % len(payloads)]
        if sends_text(i):
            t = grpc.InferInput("text", [1, 1], "BYTES")
            t.set_data_from_numpy(np.array([[p.text.encode("utf-8")]], dtype=np.object_))
            return [t]
        out = []
        for name, arr in (("input_ids", p.input_ids), ("attention_mask", p.attention_mask)):
            t = grpc.InferInput(name, [1, int(arr.shape[0])], "INT64")
            t.set_data_from_numpy(np.ascontiguousarray(arr[None, :], dtype=np.int64))
            out.append(t)
        return out

    prepared = [inputs(i) for i in range(2 * len(payloads))]
    outputs = [grpc.InferRequestedOutput(output)]
    done: list[tuple[float, float, bool]] = []  # (answered at, latency s, ok)
    messages: list[str] = []
    counts = {"rejected": 0, "text": 0, "ids": 0}
    samples: list[Sample] = []

    async def session() -> float:
        client = grpc.InferenceServerClient(url)
        start = time.monotonic()
        next_i = iter(range(10 ** 12))
        stop = asyncio.Event()

        def finished() -> bool:
            if seconds is not None:
                return time.monotonic() - start >= seconds
            return len(done) + counts["rejected"] >= requests  # type: ignore[operator]

        async def worker() -> None:
            while not stop.is_set():
                i = next(next_i)
                if requests is not None and i >= requests:
                    return
                counts["text" if sends_text(i) else "ids"] += 1
                t0 = time.monotonic()
                try:
                    # Texts are cut to the model's limit as the ids are (benchmarks/texts.txt has lines over it):
                    # the request says so, since the server refuses a long text by default (docs/inputs.md).
                    params = {"long_inputs": "truncate"} if sends_text(i) else None
                    await client.infer(model, prepared[i % len(prepared)], outputs=outputs, client_timeout=timeout_s,
                                       parameters=params)
                    done.append((time.monotonic() - start, time.monotonic() - t0, True))
                except Exception as exc:  # counted: a soak must show none
                    if is_rejection(exc):
                        counts["rejected"] += 1
                        if reject_pause_s:
                            await asyncio.sleep(reject_pause_s)
                    else:
                        done.append((time.monotonic() - start, time.monotonic() - t0, False))
                        if len(messages) < 5:
                            messages.append(f"{type(exc).__name__}: {exc}"[:300])
                if finished():
                    stop.set()

        async def sampler() -> None:
            while not stop.is_set():
                samples.append(await asyncio.to_thread(sample, server_pid, repository, time.monotonic() - start))
                try:
                    await asyncio.wait_for(stop.wait(), sample_s)
                except asyncio.TimeoutError:
                    pass
            samples.append(await asyncio.to_thread(sample, server_pid, repository, time.monotonic() - start))

        try:
            await asyncio.gather(sampler(), *(worker() for _ in range(concurrency)))
        finally:
            await client.close()
        return time.monotonic() - start

    elapsed = asyncio.run(session())
    minutes = []
    for m in range(int(elapsed // 60) + 1):
        in_minute = [d for d in done if m * 60 <= d[0] < (m + 1) * 60]
        ok_ms = [d[1] * 1e3 for d in in_minute if d[2]]
        if in_minute:
            minutes.append(MinuteStats(m + 1, len(in_minute), sum(not d[2] for d in in_minute),
                                       percentile(ok_ms, 50), percentile(ok_ms, 99)))
    return SoakReport(elapsed, len(done) + counts["rejected"], sum(not d[2] for d in done), counts["rejected"],
                      messages, samples, minutes, counts["text"], counts["ids"],
                      [d[1] * 1e3 for d in done if d[2]])


@dataclass(frozen=True)
class Verdict:
    """The soak's checks: each a name, whether it passed, and the figures behind it."""

    checks: tuple[tuple[str, bool, str], ...]

    @property
    def ok(self) -> bool:
        return all(passed for _, passed, _ in self.checks)


def judge(report: SoakReport, warmup_s: float, max_rss_growth: float = 0.05, fd_slack: int = 0,
          thread_slack: int = 0) -> Verdict:
    """Zero errors; no stub restarted; RSS of the server and the stubs after ``warmup_s`` within
    ``max_rss_growth`` (last sample over the first one after warm-up); descriptors and threads as at
    the end of warm-up (within the slack)."""
    checks = [("errors", report.errors == 0, f"{report.errors} of {report.requests}"
               + (f"; first: {report.error_messages[0]}" if report.error_messages else ""))]
    pids = {s.stub_pids for s in report.samples}
    checks.append(("stub restarts", len(pids) <= 1, f"stub pids seen: {sorted(pids)}"))
    after = [s for s in report.samples if s.at >= warmup_s] or report.samples[-1:]
    first, last = after[0], report.samples[-1]

    def growth(a: int, b: int) -> float:
        return (b - a) / a if a else 0.0

    rss_server = growth(first.server.rss_kib, last.server.rss_kib)
    rss_stub = growth(sum(s.rss_kib for s in first.stubs), sum(s.rss_kib for s in last.stubs))
    checks.append(("server RSS growth", rss_server <= max_rss_growth,
                   f"{first.server.rss_kib / 1024:.0f} -> {last.server.rss_kib / 1024:.0f} MiB ({rss_server:+.1%})"))
    checks.append(("stub RSS growth", rss_stub <= max_rss_growth,
                   f"{sum(s.rss_kib for s in first.stubs) / 1024:.0f} -> "
                   f"{sum(s.rss_kib for s in last.stubs) / 1024:.0f} MiB ({rss_stub:+.1%})"))
    for what, get, slack in (("descriptors", lambda p: p.fds, fd_slack), ("threads", lambda p: p.threads,
                                                                        thread_slack)):
        a = (get(first.server), tuple(get(s) for s in first.stubs))
        b = (get(last.server), tuple(get(s) for s in last.stubs))
        flat = abs(b[0] - a[0]) <= slack and len(a[1]) == len(b[1]) and \
            all(abs(x - y) <= slack for x, y in zip(a[1], b[1]))
        checks.append((f"{what} flat", flat, f"server {a[0]} -> {b[0]}, stubs {list(a[1])} -> {list(b[1])}"))
    return Verdict(tuple(checks))
