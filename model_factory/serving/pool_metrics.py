"""The model-server protocol's metrics (Gateway API Inference Extension), served on the OpenAI port's ``/metrics``.

An InferencePool's endpoint picker scrapes ``/metrics`` on the pool's target port (the OpenAI port) and routes each
request by what it reads there: the extension's model-server protocol
(gateway-api-inference-extension ``docs/proposals/003-model-server-protocol``) asks for the queued requests, the
running requests and the KV-cache utilization (gauges), and the LoRA adapters' info metric; the picker reads them under
vLLM's names (its default engine; llm-d-router v0.10.0's ``core-metrics-extractor``), so dashboards made for vLLM read
them too. Not on Triton's metrics port: Triton 2.51 accepts those names (``:`` included) from ``pb_utils``, but the
picker reads the pool's target port only.

It reads the text-generation backend's own gauges from Triton's metrics port (``generation/metrics.py``:
``model_factory_{waiting,running}_sequences``, ``_kv_cache_{reserved,budget}_bytes``, the adapters'; one read serves
the scrapes of 0.25 s), sums them over a model's instances and writes, per served text-generation model (label
``model_name``, as vLLM does):

==============================  =====================================================================================
``vllm:num_requests_waiting``   requests queued, not yet admitted into the running batch (waiting for KV memory)
``vllm:num_requests_running``   requests in the running batch (prefilling or decoding)
``vllm:kv_cache_usage_perc``    KV cache reserved by the running requests over its budget, 0..1 (1 = full)
``vllm:gpu_cache_usage_perc``   the same: its name before vLLM 0.10 (older dashboards and pickers)
``vllm:lora_requests_info``     labels ``max_lora`` (adapters one batch may hold; 0 while none can be served),
                                ``running_lora_adapters`` / ``waiting_lora_adapters`` (comma-separated names of
                                the adapters of running / waiting requests); value: when it was written (Unix s)
==============================  =====================================================================================

and, for vLLM's dashboards (not the protocol's), the counters of prefix caching and speculative decoding under vLLM
v1's names (:data:`VLLM_COUNTERS`: ``vllm:prefix_cache_queries_total`` / ``_hits_total`` in tokens,
``vllm:spec_decode_num_drafts_total`` / ``_num_draft_tokens_total`` / ``_num_accepted_tokens_total``), summed over
the instances as the backend counts them.

A picker takes the first series of a name, so a pool should hold pods serving one base model (the extension's
definition of a pool); with several text-generation models in one pod each has its own series.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

WAITING, RUNNING = "vllm:num_requests_waiting", "vllm:num_requests_running"
KV_USAGE, KV_USAGE_BEFORE_0_10 = "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"
LORA_INFO = "vllm:lora_requests_info"
PROTOCOL_NAMES = (WAITING, RUNNING, KV_USAGE, KV_USAGE_BEFORE_0_10, LORA_INFO)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# The backend's gauges (backends/python_backend/generation/metrics.py), label `model`, one series per instance.
BACKEND_WAITING, BACKEND_RUNNING = "model_factory_waiting_sequences", "model_factory_running_sequences"
BACKEND_RESERVED, BACKEND_BUDGET = "model_factory_kv_cache_reserved_bytes", "model_factory_kv_cache_budget_bytes"
BACKEND_LORA_MAX, BACKEND_LORA_SEQUENCES = "model_factory_lora_max_adapters", "model_factory_lora_adapter_sequences"

# vLLM v1's counter (its sample name) -> the backend's counter it is read from, and its help.
VLLM_COUNTERS: dict[str, tuple[str, str]] = {
    "vllm:prefix_cache_queries_total": ("model_factory_prefix_cache_queried_tokens_total",
                                        "Prefix cache queries: context tokens looked up."),
    "vllm:prefix_cache_hits_total": ("model_factory_prefix_cache_hit_tokens_total",
                                     "Prefix cache hits: context tokens found cached."),
    "vllm:spec_decode_num_drafts_total": ("model_factory_spec_decode_num_drafts_total",
                                          "Speculative decoding: drafts verified."),
    "vllm:spec_decode_num_draft_tokens_total": ("model_factory_spec_decode_num_draft_tokens_total",
                                                "Speculative decoding: tokens drafted."),
    "vllm:spec_decode_num_accepted_tokens_total": ("model_factory_spec_decode_num_accepted_tokens_total",
                                                   "Speculative decoding: drafted tokens accepted."),
}
_COUNTED = {backend: vllm for vllm, (backend, _) in VLLM_COUNTERS.items()}

_HELP = {
    WAITING: "Number of requests waiting to be processed (queued for KV cache memory).",
    RUNNING: "Number of requests in the running batch.",
    KV_USAGE: "KV cache usage: bytes reserved by running requests over the KV budget. 1 means 100 percent usage.",
    KV_USAGE_BEFORE_0_10: "KV cache usage, as vllm:kv_cache_usage_perc (the name vLLM used before 0.10).",
    LORA_INFO: "Running and waiting LoRA adapters and the most one batch may hold; the value is when it was written.",
}


@dataclass(frozen=True)
class ModelLoad:
    """One served text-generation model's load, summed over its instances."""

    waiting: float = 0.0
    running: float = 0.0
    reserved_bytes: float = 0.0
    budget_bytes: float = 0.0
    max_lora: int = 0
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    counters: tuple[tuple[str, float], ...] = ()  # (vLLM counter name, value) of the counters reported

    @property
    def kv_usage(self) -> float:
        """Reserved over budget, 0..1 (0 with no budget yet: nothing can be reserved)."""
        return min(1.0, self.reserved_bytes / self.budget_bytes) if self.budget_bytes > 0 else 0.0


def model_loads(samples: Iterable, models: Sequence[str]) -> dict[str, ModelLoad]:
    """model -> its :class:`ModelLoad`, from the samples of one scrape of Triton's metrics port (objects with
    ``name``, ``labels`` and ``value``: ``model_factory.measure.bench.Sample``); every model in ``models`` is there,
    at 0 until its backend has reported."""
    sums: dict[str, dict[str, float]] = {m: {} for m in models}
    adapters: dict[str, dict[str, dict[str, float]]] = {m: {"running": {}, "waiting": {}} for m in models}
    for s in samples:
        model = s.labels.get("model")
        if model not in sums:
            continue
        if s.name == BACKEND_LORA_SEQUENCES:
            state, adapter = s.labels.get("state"), s.labels.get("adapter")
            if state in ("running", "waiting") and adapter:
                held = adapters[model][state]
                held[adapter] = held.get(adapter, 0.0) + s.value
        elif s.name in _COUNTED or s.name in (BACKEND_WAITING, BACKEND_RUNNING, BACKEND_RESERVED, BACKEND_BUDGET,
                                              BACKEND_LORA_MAX):
            sums[model][s.name] = sums[model].get(s.name, 0.0) + s.value

    def names(held: Mapping[str, float]) -> tuple[str, ...]:
        return tuple(sorted(a for a, n in held.items() if n > 0))

    return {m: ModelLoad(waiting=v.get(BACKEND_WAITING, 0.0), running=v.get(BACKEND_RUNNING, 0.0),
                         reserved_bytes=v.get(BACKEND_RESERVED, 0.0), budget_bytes=v.get(BACKEND_BUDGET, 0.0),
                         max_lora=int(v.get(BACKEND_LORA_MAX, 0.0)),
                         running_adapters=names(adapters[m]["running"]), waiting_adapters=names(adapters[m]["waiting"]),
                         counters=tuple((name, v[backend]) for name, (backend, _) in VLLM_COUNTERS.items() if backend in v))
            for m, v in sums.items()}


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return repr(float(value))


def exposition(loads: Mapping[str, ModelLoad], now: float | None = None) -> str:
    """The Prometheus text exposition (format 0.0.4) of the protocol's metrics for ``loads``."""
    now = time.time() if now is None else now
    lines: list[str] = []
    for name in PROTOCOL_NAMES:
        lines += [f"# HELP {name} {_HELP[name]}", f"# TYPE {name} gauge"]
        for model, load in sorted(loads.items()):
            labels = f'model_name="{_label(model)}"'
            if name == WAITING:
                value = load.waiting
            elif name == RUNNING:
                value = load.running
            elif name in (KV_USAGE, KV_USAGE_BEFORE_0_10):
                value = load.kv_usage
            else:
                labels += (f',max_lora="{load.max_lora}"'
                           f',running_lora_adapters="{_label(",".join(load.running_adapters))}"'
                           f',waiting_lora_adapters="{_label(",".join(load.waiting_adapters))}"')
                value = now
            lines.append(f"{name}{{{labels}}} {_number(value)}")
    for name, (_, help_text) in VLLM_COUNTERS.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
        for model, load in sorted(loads.items()):
            value = dict(load.counters).get(name, 0.0)
            lines.append(f'{name}{{model_name="{_label(model)}"}} {_number(value)}')
    return "\n".join(lines) + "\n"


class ProtocolMetrics:
    """The frontend's ``/metrics`` answer: :func:`exposition` of a read of Triton's metrics port (``metrics_url``,
    with the frontend's aiohttp ``session``).

    One read serves every scrape within ``max_age_s``: a picker scrapes each pod every 50 ms (llm-d-router's
    ``--refresh-metrics-interval``), while the backend's gauges change once a second at most, and a read of Triton's
    port writes every metric of every model. Concurrent scrapes share one read. 503 when the port cannot be read (a
    picker then treats the pod's metrics as stale rather than as an idle pod); a failure is not kept.
    """

    def __init__(self, session, metrics_url: str | None, models: Sequence[str], *, max_age_s: float = 0.25,
                 timeout_s: float = 2.0, clock=time.monotonic) -> None:
        self.session, self.metrics_url, self.models = session, metrics_url, list(models)
        self.max_age_s, self.timeout_s, self.clock = float(max_age_s), float(timeout_s), clock
        self.reads = 0
        self._loads: dict[str, ModelLoad] | None = None
        self._at = float("-inf")
        self._lock = None  # an asyncio.Lock, made on the frontend's loop

    async def _read(self) -> dict[str, ModelLoad]:
        import aiohttp

        from model_factory.measure.bench import parse_prometheus

        self.reads += 1
        async with self.session.get(self.metrics_url, timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
            if resp.status != 200:
                raise ValueError(f"Triton's metrics port answered {resp.status}")
            text = await resp.text()
        return model_loads(parse_prometheus(text), self.models)

    async def loads(self) -> dict[str, ModelLoad]:
        """The models' loads, read again when the last read is older than ``max_age_s``."""
        import asyncio

        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._loads is None or self.clock() - self._at > self.max_age_s:
                self._loads = None
                self._loads = await self._read()
                self._at = self.clock()
            return self._loads

    async def response(self, request=None):
        """The aiohttp handler of ``GET /metrics``."""
        import asyncio

        import aiohttp
        from aiohttp import web

        from model_factory.errors import FactoryError

        if not self.metrics_url:
            return web.Response(status=503, text="no Triton metrics port is known to this frontend\n")
        try:
            body = exposition(await self.loads())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, FactoryError) as exc:
            return web.Response(status=503, text=f"cannot read Triton's metrics port: {exc}\n")
        return web.Response(body=body.encode(), headers={"Content-Type": CONTENT_TYPE})
