"""Benchmark a served text-generation model: token streams at fixed concurrency, over Triton's generate_stream.

Each request is one stream: ``POST /v2/models/M/generate_stream`` (server-sent events, one ``data:`` line per
token; ``docs/generation.md``) with a prompt drawn (seeded) from a text file, greedy, and exactly
``max_tokens`` output tokens (``min_tokens`` = ``max_tokens``, ``ignore_eos``), as LLM benchmarks fix the
output length (aiperf's ``--extra-inputs ignore_eos:true``). The same load generator as the encoders'
(:func:`model_factory.measure.bench.drive`) keeps ``concurrency`` streams in flight and counts a stream the
server refused at once (waiting queue full: "server busy ... retry after N s") apart from one that failed.

Measured at the client, per concurrency (:class:`model_factory.measure.sweep.GenerationPoint`):

* output tokens/s: the tokens of the streams that finished, over the wall time of the run;
* time to first token (TTFT): from sending the request to the first event that carries a token;
* inter-token latency (ITL): per stream, from its first token to its last over the tokens after the first
  (aiperf's and genai-perf's definition), percentiles over the streams. Not the single intervals: a client
  sees tokens in bursts (several SSE events in one read; measured on the tiny Llama at 1 stream: the
  pooled intervals' median was 0.03 ms while a decode step took milliseconds), so those would measure the
  delivery, not the decoding. The backend's own ``model_factory_inter_token_latency_seconds`` histogram
  has the single intervals as the engine makes them (``docs/metrics.md``).

aiohttp (from the ``client`` extra's tritonclient[http], or ``serve``) is imported where a run starts.
Nothing here starts a server.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from model_factory.errors import FactoryError, require
from model_factory.measure.bench import draw_texts, drive, load_texts, percentile
from model_factory.measure.sweep import TEXT_GENERATION, GenerationPoint, sweep_header

DEFAULT_MAX_TOKENS = 128


class StreamError(Exception):
    """A stream that ended with an error (its message as the server wrote it)."""


@dataclass(frozen=True)
class Stream:
    """One stream that finished: when its first and last tokens came (from sending it), and how many."""

    ttft_s: float
    last_s: float
    output_tokens: int
    prompt_tokens: int

    @property
    def itl_s(self) -> float | None:
        """Mean interval between its tokens: (last - first) / (tokens - 1); None for a single token."""
        return (self.last_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def _ids(value: Any) -> int:
    """Tokens in an event's ``output_ids`` (a JSON number for one, a list otherwise)."""
    if value is None:
        return 0
    return len(value) if isinstance(value, list) else 1


def _scalar(value: Any) -> Any:
    return value[0] if isinstance(value, list) and value else value


def stream_timings(events: Sequence[tuple[float, dict[str, Any]]], start: float) -> Stream:
    """A :class:`Stream` from a stream's events (arrival time, parsed JSON), or StreamError for an error event.

    An event's ``output_ids`` says how many tokens it carries; the last event's ``num_output_tokens`` (the
    backend's count) wins when present.
    """
    first = last = None
    tokens = 0
    n_out = n_in = None
    for at, event in events:
        if "error" in event:
            raise StreamError(str(event["error"]))
        n = _ids(event.get("output_ids"))
        if event.get("num_output_tokens") is not None:
            n_out = int(_scalar(event["num_output_tokens"]))
        if event.get("num_input_tokens") is not None:
            n_in = int(_scalar(event["num_input_tokens"]))
        if n == 0:
            continue
        if first is None:
            first = at
        last = at
        tokens += n
    if first is None:
        raise StreamError("the stream ended without a token")
    return Stream(ttft_s=first - start, last_s=last - start, output_tokens=n_out if n_out else tokens,
                  prompt_tokens=n_in or 0)


async def generate_stream(session: Any, url: str, model: str, body: dict[str, Any]) -> Stream:
    """Send one generate_stream request and time its events (StreamError for an error answer)."""
    start = time.perf_counter()
    events: list[tuple[float, dict[str, Any]]] = []
    async with session.post(f"{url}/v2/models/{model}/generate_stream", json=body) as resp:
        if resp.status != 200:
            text = await resp.text()
            try:
                text = str(json.loads(text).get("error", text))
            except (ValueError, AttributeError):
                pass
            raise StreamError(f"HTTP {resp.status}: {text[:300]}")
        async for raw in resp.content:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("data:"):
                continue
            try:
                events.append((time.perf_counter(), json.loads(line[5:])))
            except ValueError:
                continue
    return stream_timings(events, start)


def request_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    """A greedy request for exactly ``max_tokens`` tokens (eos ignored), streamed, the prompt not echoed."""
    return {"text_input": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "exclude_input_in_output": True}


def summarize_streams(streams: Sequence[Stream], *, concurrency: int, requests: int, rejected: int, errors: int,
                      seconds: float, max_tokens: int = 0, error_messages: Sequence[str] = ()) -> GenerationPoint:
    """The point of a run from the streams that finished and the counts of the others."""
    if seconds <= 0:
        raise ValueError(f"the run must last a positive time, got {seconds}")
    ttft = [s.ttft_s * 1e3 for s in streams]
    itl = [s.itl_s * 1e3 for s in streams if s.itl_s is not None]
    whole = [s.last_s * 1e3 for s in streams]  # a stream's latency: to its last token
    out = sum(s.output_tokens for s in streams)
    return GenerationPoint(
        concurrency=concurrency, requests=requests, ok=len(streams), rejected=rejected, errors=errors,
        seconds=float(seconds), output_tokens=out, prompt_tokens=sum(s.prompt_tokens for s in streams),
        tokens_per_s=out / seconds, ttft_p50_ms=percentile(ttft, 50), ttft_p99_ms=percentile(ttft, 99),
        itl_p50_ms=percentile(itl, 50), itl_p99_ms=percentile(itl, 99), p50_ms=percentile(whole, 50),
        p99_ms=percentile(whole, 99), throughput=len(streams) / seconds, max_tokens=max_tokens,
        error_messages=tuple(error_messages)[:5])


async def _check_ready(session: Any, url: str, model: str) -> None:
    try:
        async with session.get(f"{url}/v2/health/live") as resp:
            live = resp.status == 200
    except Exception as exc:  # connection refused, DNS: the server is not there
        raise FactoryError(f"cannot reach a Triton server at {url} over http: {exc}. Fix: check --url (Triton's "
                           "HTTP port, 8000 by default)") from exc
    async with session.get(f"{url}/v2/models/{model}/ready") as resp:
        ready = live and resp.status == 200
    if not ready:
        raise FactoryError(f"model {model!r} is not ready on {url}. Fix: check the model name (GET /v2/models) and "
                           "that it loaded")


def run_generate_load(url: str, model: str, prompts: Sequence[str], *, concurrency: int = 8, warmup: int = 1,
                      max_tokens: int = DEFAULT_MAX_TOKENS, timeout_s: float = 600.0) -> GenerationPoint:
    """Send ``prompts`` (one stream each) to ``model`` at ``url`` (Triton's HTTP address), ``concurrency`` in
    flight, after ``warmup`` streams left out of the numbers."""
    if not prompts:
        raise FactoryError("no prompts to send")
    if max_tokens < 1:
        raise FactoryError(f"--max-tokens must be at least 1, got {max_tokens}")
    if warmup < 0:
        raise FactoryError(f"warm-up must be >= 0 requests, got {warmup}")
    aiohttp = require("aiohttp", "client")
    base = url if "://" in url else f"http://{url}"
    bodies = [request_body(p, max_tokens) for p in prompts]

    async def session_run() -> tuple[list[Stream], Any, float]:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout_s)
        connector = aiohttp.TCPConnector(limit=max(concurrency, 1))
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            await _check_ready(session, base, model)
            streams: list[Stream] = []

            async def one(i: int, keep: bool = True) -> None:
                stream = await generate_stream(session, base, model, bodies[i % len(bodies)])
                if keep:
                    streams.append(stream)

            if warmup:
                await drive(lambda i: one(i, keep=False), warmup, concurrency)
            tally, seconds = await drive(one, len(bodies), concurrency)
            return streams, tally, seconds

    streams, tally, seconds = asyncio.run(session_run())
    if not streams:
        raise FactoryError(f"every one of the {tally.errors + tally.rejected} streams to {model!r} failed "
                           f"({tally.rejected} refused: server busy); the first error: "
                           f"{tally.messages[0] if tally.messages else 'no message'}")
    return summarize_streams(streams, concurrency=concurrency, requests=len(bodies), rejected=tally.rejected,
                             errors=tally.errors, seconds=seconds, max_tokens=max_tokens,
                             error_messages=tally.messages)


def default_requests(concurrency: int) -> int:
    """Streams measured at ``concurrency`` when not given: four rounds, at least 8."""
    return max(8, 4 * concurrency)


def run_generate_sweep(url: str, model: str, texts_file: str | Path, concurrencies: Sequence[int], *,
                       requests: int | None = None, warmup: int | None = None, seed: int = 0,
                       max_tokens: int = DEFAULT_MAX_TOKENS,
                       progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The sweep document of a text-generation model (``task`` = ``text-generation``; see ``sweep.write_sweep``).

    Each concurrency sends ``requests`` streams (default :func:`default_requests`) drawn from one seeded
    stream of lines of ``texts_file``, after ``warmup`` streams (default: one round, ``concurrency``)."""
    if not concurrencies:
        raise FactoryError("a sweep needs at least one concurrency. Fix: e.g. --sweep 1,8,32")
    lines = load_texts(texts_file)
    header = sweep_header(model, url, "http", task=TEXT_GENERATION, send="text", endpoint="generate_stream",
                          requests=requests, warmup=warmup, seed=seed, texts=str(texts_file), max_tokens=max_tokens,
                          metrics=False)
    points = []
    for c in concurrencies:
        n = requests if requests is not None else default_requests(c)
        point = run_generate_load(url, model, draw_texts(lines, n, seed), concurrency=c,
                                  warmup=c if warmup is None else warmup, max_tokens=max_tokens)
        points.append(point)
        if progress is not None:
            progress(f"concurrency {c}: {point.tokens_per_s:.1f} output tokens/s, TTFT p99 {point.ttft_p99_ms:.0f} ms,"
                     f" ITL p99 {point.itl_p99_ms:.1f} ms")
    return {**header, "points": [asdict(p) for p in points]}


def model_task(url: str, model: str, protocol: str = "http") -> str | None:
    """The ``task`` parameter of ``model``'s configuration on the server (None when it has none or the server
    does not answer: the caller's own checks then say what is wrong)."""
    tc = require(f"tritonclient.{protocol}", "client")
    try:
        client = (tc.InferenceServerClient(url) if protocol == "grpc" else
                  tc.InferenceServerClient(url, connection_timeout=10.0, network_timeout=10.0))
    except Exception:  # a malformed address: let the load generator's check say so
        return None
    try:
        config = (client.get_model_config(model, as_json=True, client_timeout=10.0) if protocol == "grpc"
                  else client.get_model_config(model))
    except Exception:  # unreachable, unknown model: reported by the run's own readiness check
        return None
    finally:
        client.close()
    config = config.get("config", config)
    value = (config.get("parameters") or {}).get("task") or {}
    return value.get("string_value") if isinstance(value, dict) else None
