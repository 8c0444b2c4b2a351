"""Benchmark a served model: an async load generator at fixed concurrency, and its statistics.

The request stream is drawn once, with a fixed seed, from lines of real text, so
its length mix is that of the text (``benchmarks/texts.txt``: sentences and
paragraphs, mean ~31 MiniLM tokens, up to 128). Each request carries one
sequence, sent either as token ids (``input_ids`` + ``attention_mask``, [1, L],
tokenized here with the model's own tokenizer) or as ``text`` (the backend
tokenizes). Token ids isolate batching from tokenization, and only ids give
Triton different shapes to batch (a ``text`` request is always [1, 1]).

Requests go through ``tritonclient``'s asyncio clients (HTTP or gRPC), with a
fixed number in flight. A warm-up run is made first and left out of the numbers.
The result (:class:`BenchResult`) holds the throughput in sequences per second,
latency percentiles and the padding ratio, read from the model-factory backend's
own counters on Triton's metrics port (``model_factory_computed_tokens_total`` over
``model_factory_real_tokens_total``, see ``docs/metrics.md``), together with the
mean number of requests per model execution from Triton's
``nv_inference_count``/``nv_inference_exec_count``.

Nothing here starts a server: point it at one (``model-factory serve``, or
:class:`model_factory.serving.server.TritonServer` in a benchmark script).
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Sequence

import numpy as np

from model_factory.errors import FactoryError, require

PROTOCOLS = ("http", "grpc")
SEND_MODES = ("ids", "text")
COMPUTED_TOKENS_METRIC = "model_factory_computed_tokens_total"
REAL_TOKENS_METRIC = "model_factory_real_tokens_total"
EXECUTIONS_METRIC = "model_factory_executions_total"
GROUPS_METRIC = "model_factory_groups_total"
EXECUTE_SECONDS_METRIC = "model_factory_execute_seconds_total"
LONG_INPUTS_METRIC = "model_factory_long_inputs_total"  # label action: refused, truncated, chunked
TRUNCATED_TOKENS_METRIC = "model_factory_truncated_tokens_total"
SERVER_TIMES = ("request", "queue", "compute_input", "compute_infer", "compute_output")


# --------------------------------------------------------------------------- request stream


@dataclass(frozen=True, eq=False)
class Payload:
    """One request: one sequence, as text and (when tokenized) as token ids."""

    text: str
    input_ids: np.ndarray | None = None  # int64 [L]
    attention_mask: np.ndarray | None = None  # int64 [L]

    @property
    def length(self) -> int | None:
        """Tokens in the sequence, when tokenized here (None for text-only payloads)."""
        return None if self.input_ids is None else int(self.input_ids.shape[0])


def load_texts(path: str | Path) -> list[str]:
    """Non-empty lines of a UTF-8 text file."""
    path = Path(path)
    if not path.is_file():
        raise FactoryError(f"text file {path} does not exist. Fix: pass a file with one sentence or paragraph "
                           "per line (e.g. benchmarks/texts.txt)")
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        raise FactoryError(f"text file {path} has no non-empty lines. Fix: one sentence or paragraph per line")
    return lines


def draw_texts(texts: Sequence[str], count: int, seed: int = 0) -> list[str]:
    """``count`` texts drawn with replacement from ``texts`` (seeded: the same stream every run)."""
    if count < 1:
        raise FactoryError(f"the number of requests must be at least 1, got {count}")
    if not texts:
        raise FactoryError("no texts to draw requests from")
    return random.Random(seed).choices(list(texts), k=count)


def load_tokenizer(folder: str | Path, max_length: int) -> Any:
    """The model's fast tokenizer (``tokenizer.json``), truncating to ``max_length``, never padding.

    This is what the backend does for ``text`` requests, so ids sent from here are
    the ids the backend would have made.
    """
    tokenizers = require("tokenizers", "serve")
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise FactoryError(f"{path} does not exist. Fix: pass the folder that holds the model's tokenizer.json "
                           "(the tokenizer/ folder of a packaged model version)")
    tok = tokenizers.Tokenizer.from_file(str(path))
    tok.no_padding()
    tok.enable_truncation(max_length=max_length)
    return tok


def make_payloads(texts: Sequence[str], tokenizer: Any = None) -> list[Payload]:
    """Payloads for ``texts``; tokenized when a tokenizer is given."""
    if tokenizer is None:
        return [Payload(t) for t in texts]
    encodings = tokenizer.encode_batch(list(texts))
    return [Payload(t, np.asarray(e.ids, dtype=np.int64), np.asarray(e.attention_mask, dtype=np.int64))
            for t, e in zip(texts, encodings)]


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), numpy's (linear between closest ranks); NaN when empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


@dataclass(frozen=True)
class BenchResult:
    """One measured run (warm-up excluded).

    ``throughput`` is sequences answered without error per second of the measured
    run. ``padding_ratio`` is computed tokens over real tokens over the whole run,
    from the backend's counters (``padding_source``: ``backend metrics``, or
    ``n/a`` without a metrics URL or a model-factory backend). ``mean_batch`` is Triton's mean
    requests per model execution. The counters behind the ratios are kept so runs
    can be merged (:func:`merge_results`).
    """

    label: str
    protocol: str
    concurrency: int
    requests: int
    errors: int  # failures other than a rejection by a full queue
    seconds: float
    sequences: int
    throughput: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    padding_ratio: float | None = None
    padding_source: str = "n/a"
    mean_batch: float | None = None
    computed_tokens: int = 0  # server side, padding included
    served_tokens: int = 0  # server side, real tokens
    inferences: int = 0
    executions: int = 0
    # Where the time went on the server (sums over the run, from the counters): Triton's per-request
    # durations (µs; a batched request counts its whole execution) and the backend's execute() seconds.
    successes: int = 0
    server_us: dict[str, float] = field(default_factory=dict)  # request, queue, compute_input/infer/output
    execute_s: float = 0.0
    real_tokens: int = 0
    error_messages: tuple[str, ...] = ()
    latencies_ms: tuple[float, ...] = field(default=(), repr=False)
    # Requests the server shed at once (queue full: UNAVAILABLE / 503), counted apart from errors.
    rejected: int = 0
    # The backend's engine launches (groups) and execute() windows over the run (its counters).
    groups: int = 0
    windows: int = 0
    # Texts over the model's limit that the backend truncated / chunked over the run, and the tokens truncation
    # cut (its counters; None without a metrics URL or from a backend that has no such counters).
    truncated_texts: int | None = None
    truncated_tokens: int | None = None
    chunked_texts: int | None = None

    @property
    def groups_per_window(self) -> float | None:
        """Engine launches per execute() window (None without the backend's counters)."""
        return self.groups / self.windows if self.windows > 0 else None

    def as_dict(self) -> dict[str, Any]:
        """The headline numbers (no raw latencies), for reports."""
        return {k: getattr(self, k) for k in ("label", "protocol", "concurrency", "requests", "errors", "seconds",
                                              "sequences", "throughput", "p50_ms", "p99_ms", "mean_ms",
                                              "padding_ratio", "padding_source", "mean_batch", "rejected")}


def summarize(latencies_s: Sequence[float], errors: int, seconds: float, *, label: str = "", protocol: str = "",
              concurrency: int = 1, sequences_per_request: int = 1, real_tokens: int = 0,
              error_messages: Sequence[str] = (), rejected: int = 0) -> BenchResult:
    """A :class:`BenchResult` from the latencies (seconds) of the requests that succeeded."""
    if seconds <= 0:
        raise ValueError(f"the run must last a positive time, got {seconds}")
    if errors < 0 or rejected < 0:
        raise ValueError(f"errors and rejected must be >= 0, got {errors} and {rejected}")
    ms = tuple(float(x) * 1e3 for x in latencies_s)
    sequences = len(ms) * sequences_per_request
    return BenchResult(
        label=label, protocol=protocol, concurrency=concurrency, requests=len(ms) + errors + rejected, errors=errors,
        rejected=rejected,
        seconds=float(seconds), sequences=sequences, throughput=sequences / seconds,
        p50_ms=percentile(ms, 50), p99_ms=percentile(ms, 99),
        mean_ms=float(sum(ms) / len(ms)) if ms else math.nan, real_tokens=real_tokens,
        error_messages=tuple(error_messages)[:5], latencies_ms=ms)


def with_counters(result: BenchResult, *, computed_tokens: int = 0, served_tokens: int = 0,
                  inferences: int = 0, executions: int = 0, padding_source: str | None = None,
                  successes: int = 0, server_us: Mapping[str, float] | None = None,
                  execute_s: float = 0.0, groups: int = 0, windows: int = 0, truncated_texts: int | None = None,
                  truncated_tokens: int | None = None, chunked_texts: int | None = None) -> BenchResult:
    """``result`` with the server-side counters of its run, and the ratios they give."""
    ratio = computed_tokens / served_tokens if served_tokens > 0 else None
    return replace(result, successes=successes, groups=groups, windows=windows, server_us=dict(server_us or {}), execute_s=execute_s,
                   truncated_texts=truncated_texts, truncated_tokens=truncated_tokens, chunked_texts=chunked_texts,
                   computed_tokens=computed_tokens, served_tokens=served_tokens, inferences=inferences,
                   executions=executions, padding_ratio=ratio,
                   padding_source=padding_source or ("backend metrics" if ratio is not None else "n/a"),
                   mean_batch=inferences / executions if executions > 0 else None)


def merge_results(results: Sequence[BenchResult], label: str | None = None) -> BenchResult:
    """Pool several runs of one configuration: totals add up, percentiles over all latencies."""
    if not results:
        raise ValueError("merge_results needs at least one result")
    first = results[0]
    if len({(r.protocol, r.concurrency) for r in results}) > 1:
        raise ValueError("merge_results: the runs differ in protocol or concurrency")
    ms = tuple(x for r in results for x in r.latencies_ms)
    seconds = sum(r.seconds for r in results)
    sequences = sum(r.sequences for r in results)
    merged = BenchResult(
        label=first.label if label is None else label, protocol=first.protocol, concurrency=first.concurrency,
        requests=sum(r.requests for r in results), errors=sum(r.errors for r in results), seconds=seconds,
        rejected=sum(r.rejected for r in results),
        sequences=sequences, throughput=sequences / seconds, p50_ms=percentile(ms, 50), p99_ms=percentile(ms, 99),
        mean_ms=float(sum(ms) / len(ms)) if ms else math.nan, real_tokens=sum(r.real_tokens for r in results),
        error_messages=tuple(m for r in results for m in r.error_messages)[:5], latencies_ms=ms)
    sources = {r.padding_source for r in results if r.served_tokens}
    return with_counters(merged, computed_tokens=sum(r.computed_tokens for r in results),
                         served_tokens=sum(r.served_tokens for r in results),
                         inferences=sum(r.inferences for r in results),
                         executions=sum(r.executions for r in results),
                         successes=sum(r.successes for r in results),
                         server_us={k: sum(r.server_us.get(k, 0.0) for r in results) for k in SERVER_TIMES},
                         execute_s=sum(r.execute_s for r in results),
                         groups=sum(r.groups for r in results), windows=sum(r.windows for r in results),
                         truncated_texts=_sum_known(r.truncated_texts for r in results),
                         truncated_tokens=_sum_known(r.truncated_tokens for r in results),
                         chunked_texts=_sum_known(r.chunked_texts for r in results),
                         padding_source=sources.pop() if len(sources) == 1 else None)


def _sum_known(values: Any) -> int | None:
    """The sum of the values that are known (None when none is)."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def batches_padding_ratio(batches: Sequence[Sequence[int]]) -> float:
    """Computed over real tokens for batches of sequence lengths, each padded to its longest (1.0 if empty)."""
    computed = sum(len(b) * max(b) for b in batches if b)
    real = sum(sum(b) for b in batches if b)
    return computed / real if real else 1.0


# --------------------------------------------------------------------------- metrics port

@dataclass(frozen=True)
class Sample:
    """One Prometheus sample: metric name, labels and value."""

    name: str
    labels: Mapping[str, str]
    value: float


def parse_prometheus(text: str) -> list[Sample]:
    """Parse Prometheus text exposition format (``prometheus_client``'s parser).

    Raises FactoryError when the text is not the exposition format.
    """
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError as exc:
        raise FactoryError("reading metrics needs prometheus-client. Fix: pip install 'model-factory[client]'") from exc
    # Without the TYPE lines every sample keeps the name the server exposes: given "counter", the parser
    # renames Triton's nv_inference_count to nv_inference_count_total (OpenMetrics' convention).
    untyped = "\n".join(line for line in text.splitlines() if not line.startswith("# TYPE "))
    try:
        return [Sample(s.name, dict(s.labels), float(s.value))
                for family in text_string_to_metric_families(untyped) for s in family.samples]
    except ValueError as exc:
        raise FactoryError(f"the metrics are not in Prometheus text format ({exc}). Fix: pass Triton's metrics URL, "
                           "e.g. http://localhost:8002/metrics") from None


def metric_total(samples: Sequence[Sample], name: str, **labels: str) -> float | None:
    """Sum of the samples called ``name`` whose labels include ``labels``; None when there is none."""
    values = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(values) if values else None


def scrape_metrics(url: str, timeout: float = 5.0) -> list[Sample]:
    """Read and parse a metrics endpoint (``http://host:8002/metrics``)."""
    if "://" not in url:
        url = "http://" + url
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # loopback / the user's own server
            return parse_prometheus(r.read().decode("utf-8", errors="replace"))
    except (urllib.error.URLError, OSError) as exc:
        raise FactoryError(f"cannot read metrics from {url}: {exc}. Fix: pass Triton's metrics URL, "
                           "e.g. http://localhost:8002/metrics (started with --allow-metrics=true)") from exc


def counter_deltas(before: Sequence[Sample], after: Sequence[Sample], model: str) -> dict[str, float]:
    """What the server did for ``model`` between two scrapes: computed/real tokens, inferences, executions,
    the backend's groups and windows, and the texts over the limit it truncated (and the tokens cut) or chunked."""
    def delta(name: str) -> float:
        a = metric_total(after, name, model=model)
        b = metric_total(before, name, model=model)
        return (a or 0.0) - (b or 0.0)

    def known(name: str, **labels: str) -> int | None:  # None: the server has no such counter (not ours)
        a = metric_total(after, name, model=model, **labels)
        return None if a is None else int(round(a - (metric_total(before, name, model=model, **labels) or 0.0)))

    return {"truncated_texts": known(LONG_INPUTS_METRIC, action="truncated"),
            "truncated_tokens": known(TRUNCATED_TOKENS_METRIC),
            "chunked_texts": known(LONG_INPUTS_METRIC, action="chunked"),
            "computed_tokens": int(round(delta(COMPUTED_TOKENS_METRIC))),
            "served_tokens": int(round(delta(REAL_TOKENS_METRIC))),
            "inferences": int(round(delta("nv_inference_count"))),
            "executions": int(round(delta("nv_inference_exec_count"))),
            "successes": int(round(delta("nv_inference_request_success"))),
            "server_us": {k: delta(f"nv_inference_{k}_duration_us") for k in SERVER_TIMES},
            "execute_s": delta(EXECUTE_SECONDS_METRIC),
            "groups": int(round(delta(GROUPS_METRIC))), "windows": int(round(delta(EXECUTIONS_METRIC)))}


def time_split(result: BenchResult) -> dict[str, float] | None:
    """Mean milliseconds per request, from the client inwards, for a run with server counters.

    ``client``: latency the client saw; ``triton``: Triton's request duration (arrival to response
    sent); ``queue``: in the scheduler's queue; ``infer``: the backend's execution as Triton times it
    (per request; a batched request counts its whole execution), ``execute``: the backend's own
    ``execute()`` wall time per execution. client - triton is the client and the network; triton -
    queue - infer is Triton's front end and the input/output copies; infer - execute is the Python
    backend's IPC around ``execute()``.
    """
    if not result.successes or not result.server_us or not result.executions:
        return None
    per = {k: v / result.successes / 1e3 for k, v in result.server_us.items()}
    return {"client": result.mean_ms, "triton": per["request"], "queue": per["queue"],
            "input": per["compute_input"], "infer": per["compute_infer"], "output": per["compute_output"],
            "execute": result.execute_s / result.executions * 1e3}


def cost_model_from_metrics(samples: Sequence[Sample], model: str) -> tuple[float, float, float] | None:
    """The cost-model constants (a, b, c seconds) the backend published for all profiles at once, if any
    (None too for a model with one cost model per optimization profile)."""
    # One instance's constants (each instance publishes its own; they are not to be summed).
    values = [next((x.value for x in samples if x.name == f"model_factory_cost_model_{k}_seconds"
                    and x.labels.get("model") == model and x.labels.get("profile") == "all"), None)
              for k in "abc"]
    return None if any(v is None for v in values) else tuple(values)  # type: ignore[return-value]


# --------------------------------------------------------------------------- load generation


# What Triton says when a model's queue is full (default_queue_policy.max_queue_size): a shed request; and what
# a text-generation model says when its waiting queue is full ("server busy ... retry after N s").
_REJECTED = re.compile(r"exceeds maximum queue size|\[503\]|StatusCode\.UNAVAILABLE|server busy", re.IGNORECASE)


def is_rejection(exc: BaseException) -> bool:
    """Whether a failed request was shed by a full queue (retry elsewhere) rather than failed."""
    return _REJECTED.search(str(exc)) is not None


@dataclass
class _Tally:
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    rejected: int = 0
    messages: list[str] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0


async def drive(send: Callable[[int], Awaitable[Any]], count: int, concurrency: int) -> tuple[_Tally, float]:
    """Call ``send(i)`` for i in 0..count-1 with at most ``concurrency`` calls in flight.

    Returns the tally (latency of each call that returned, errors for each that
    raised, the most calls seen in flight) and the wall time of the whole run.
    """
    if concurrency < 1:
        raise FactoryError(f"concurrency must be at least 1, got {concurrency}")
    tally = _Tally()
    next_index = iter(range(count))

    async def worker() -> None:
        for i in next_index:  # shared iterator: each index is taken once
            tally.in_flight += 1
            tally.most_in_flight = max(tally.most_in_flight, tally.in_flight)
            start = time.perf_counter()
            try:
                await send(i)
            except Exception as exc:  # a failed request is counted, not fatal
                if is_rejection(exc):
                    tally.rejected += 1
                    continue
                tally.errors += 1
                if len(tally.messages) < 5:
                    tally.messages.append(f"{type(exc).__name__}: {exc}"[:300])
            else:
                tally.latencies.append(time.perf_counter() - start)
            finally:
                tally.in_flight -= 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, max(count, 1)))))
    return tally, time.perf_counter() - start


def _client_module(protocol: str) -> Any:
    if protocol not in PROTOCOLS:
        raise FactoryError(f"protocol {protocol!r} is not one of: {', '.join(PROTOCOLS)}")
    return require(f"tritonclient.{protocol}.aio", "client")


def _inputs_for(tc: Any, payload: Payload, send: str) -> list[Any]:
    if send == "text":
        t = tc.InferInput("text", [1, 1], "BYTES")
        t.set_data_from_numpy(np.array([[payload.text.encode("utf-8")]], dtype=np.object_))
        return [t]
    if payload.input_ids is None or payload.attention_mask is None:
        raise FactoryError("sending token ids needs a tokenizer. Fix: pass the tokenizer folder, or send text")
    inputs = []
    for name, arr in (("input_ids", payload.input_ids), ("attention_mask", payload.attention_mask)):
        t = tc.InferInput(name, [1, int(arr.shape[0])], "INT64")
        t.set_data_from_numpy(np.ascontiguousarray(arr[None, :], dtype=np.int64))
        inputs.append(t)
    return inputs


SUCCESS_METRIC = "nv_inference_request_success"


def settled_scrape(url: str, model: str, pause_s: float = 0.1, timeout_s: float = 5.0,
                   requests: int | None = None) -> list[Sample]:
    """A scrape of ``url`` once the counters for ``model`` agree (or after ``timeout_s``).

    Triton counts a request and its execution just after the responses leave, and the model-factory
    backend sends its counters about once a second: until Triton has counted ``requests`` successful
    requests (when given: the caller knows how many it saw answered) and the backend's executions
    equal Triton's, the counters lag. (A backend without our counters is scraped after ``pause_s``
    once Triton's count is reached.)
    """
    deadline = time.monotonic() + timeout_s
    time.sleep(pause_s)
    while True:
        samples = scrape_metrics(url)
        answered = requests is None or (metric_total(samples, SUCCESS_METRIC, model=model) or 0) >= requests
        ours = metric_total(samples, EXECUTIONS_METRIC, model=model)
        if answered and (ours is None or ours >= (metric_total(samples, "nv_inference_exec_count", model=model) or 0)) \
                or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


async def _settled_scrape(url: str, model: str, requests: int | None = None) -> list[Sample]:
    return await asyncio.to_thread(settled_scrape, url, model, requests=requests)


def run_load(url: str, model: str, payloads: Sequence[Payload], *, protocol: str = "http", concurrency: int = 8,
             warmup: int = 32, send: str = "ids", metrics_url: str | None = None, label: str | None = None,
             output: str = "embedding", timeout_s: float = 120.0) -> BenchResult:
    """Send ``payloads`` (one request each) to ``model`` at ``url`` and measure.

    ``warmup`` requests (the stream's first ones, cycled) are sent first and not
    counted. With ``metrics_url``, the padding ratio and Triton's mean batch are
    read from the counters' change over the measured run.
    """
    if send not in SEND_MODES:
        raise FactoryError(f"send mode {send!r} is not one of: {', '.join(SEND_MODES)}")
    if not payloads:
        raise FactoryError("no requests to send")
    if warmup < 0:
        raise FactoryError(f"warm-up must be >= 0 requests, got {warmup}")
    aio = _client_module(protocol)
    inputs = [_inputs_for(aio, p, send) for p in payloads]
    outputs = [aio.InferRequestedOutput(output)]

    async def session() -> tuple[_Tally, float, list[Sample] | None, list[Sample] | None]:
        if protocol == "http":
            client = aio.InferenceServerClient(url, conn_limit=max(concurrency, 1), conn_timeout=timeout_s)
        else:
            client = aio.InferenceServerClient(url)
        try:
            try:
                live = await client.is_server_live()
            except Exception as exc:  # connection refused, DNS, TLS: the server is not there
                raise FactoryError(f"cannot reach a Triton server at {url} over {protocol}: {exc}. Fix: check "
                                   "--url and --protocol (HTTP port 8000, gRPC 8001 by default)") from exc
            try:
                ready = live and await client.is_model_ready(model)
            except Exception:  # some clients raise for an unknown model instead of answering False
                ready = False
            if not ready:
                raise FactoryError(f"model {model!r} is not ready on {url}. Fix: check the model name "
                                   "(GET /v2/models) and that it loaded")

            # Texts are cut at the model's limit as ids mode cuts them here (the backend refuses a long text
            # unless asked: docs/inputs.md), so both modes send the same work.
            params = {"long_inputs": "truncate"} if send == "text" else None

            async def one(i: int) -> None:
                if protocol == "http":  # the client-side limit is conn_timeout; `timeout` would be the server's
                    await client.infer(model, inputs[i % len(inputs)], outputs=outputs, parameters=params)
                else:
                    await client.infer(model, inputs[i % len(inputs)], outputs=outputs, client_timeout=timeout_s,
                                       parameters=params)

            # Triton counts a request just after its response leaves: each scrape waits until Triton has
            # counted every request answered so far (from a count taken before the first one).
            start = (metric_total(await asyncio.to_thread(scrape_metrics, metrics_url), SUCCESS_METRIC, model=model)
                     or 0) if metrics_url else 0
            answered = start
            if warmup:
                answered += len((await drive(one, warmup, concurrency))[0].latencies)
            before = await _settled_scrape(metrics_url, model, answered) if metrics_url else None
            tally, seconds = await drive(one, len(inputs), concurrency)
            answered += len(tally.latencies)
            after = await _settled_scrape(metrics_url, model, answered) if metrics_url else None
            return tally, seconds, before, after
        finally:
            await client.close()

    tally, seconds, before, after = asyncio.run(session())
    if not tally.latencies:
        raise FactoryError(f"every one of the {tally.errors + tally.rejected} requests to {model!r} failed "
                           f"({tally.rejected} rejected by a full queue); the first error: "
                           f"{tally.messages[0] if tally.messages else 'no message'}")
    real = sum(p.length or 0 for p in payloads)
    result = summarize(tally.latencies, tally.errors, seconds, label=label or model, protocol=protocol,
                       concurrency=concurrency, real_tokens=real, error_messages=tally.messages,
                       rejected=tally.rejected)
    if before is not None and after is not None:
        result = with_counters(result, **counter_deltas(before, after, model))
    return result


def run_bench(url: str, model: str, texts_file: str | Path, *, protocol: str = "http", concurrency: int = 8,
              requests: int = 1000, warmup: int = 32, seed: int = 0, tokenizer_dir: str | Path | None = None,
              max_length: int = 128, metrics_url: str | None = None, output: str = "embedding") -> BenchResult:
    """The ``model-factory bench`` command: draw a stream from ``texts_file`` and run it at ``concurrency``.

    With ``tokenizer_dir`` the texts are tokenized here and sent as token ids;
    without, they are sent as ``text``.
    """
    texts = draw_texts(load_texts(texts_file), requests, seed)
    tokenizer = load_tokenizer(tokenizer_dir, max_length) if tokenizer_dir else None
    payloads = make_payloads(texts, tokenizer)
    return run_load(url, model, payloads, protocol=protocol, concurrency=concurrency, warmup=warmup,
                    send="ids" if tokenizer is not None else "text", metrics_url=metrics_url, output=output)


# --------------------------------------------------------------------------- reporting

_COLUMNS = (("config", "label", "{}"), ("conc.", "concurrency", "{}"), ("seq/s", "throughput", "{:.1f}"),
            ("p50_ms", "p50_ms", "{:.1f}"), ("p99_ms", "p99_ms", "{:.1f}"), ("padding", "padding_ratio", "{:.3f}"),
            ("batch", "mean_batch", "{:.2f}"), ("requests", "requests", "{}"), ("rejected", "rejected", "{}"),
            ("errors", "errors", "{}"))


def _cells(result: BenchResult) -> list[str]:
    out = []
    for _, attr, fmt in _COLUMNS:
        value = getattr(result, attr)
        out.append("n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value))
    return out


def format_table(results: Sequence[BenchResult], markdown: bool = False) -> str:
    """The results as an aligned text table, or a Markdown table."""
    header = [c[0] for c in _COLUMNS]
    rows = [_cells(r) for r in results]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = "  ".join("{:<%d}" % w if i == 0 else "{:>%d}" % w for i, w in enumerate(widths))
    return "\n".join([fmt.format(*header)] + [fmt.format(*r) for r in rows])
