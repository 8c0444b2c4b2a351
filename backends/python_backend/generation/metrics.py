"""Metrics of a text-generation instance: first-token and inter-token latency, jitter, tokens, KV, queues.

What the scheduler reports (``scheduler.NullMetrics`` names the calls) is summed in-process and sent about
once a second by a background thread, as in ``metrics.py``: every metric call is a round trip to the Triton
process (~0.3 ms), and a step makes one observation per running sequence. Latencies are Prometheus
histograms written as their series: ``<name>_bucket{le="..."}`` (cumulative), ``<name>_sum`` and
``<name>_count``, so ``histogram_quantile(0.99, rate(<name>_bucket[1m]))`` works as on a native histogram
(each series is typed a counter: they are sent in batches). See docs/metrics.md.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any, Mapping

from ..operations.metrics import PREFIX

# Seconds: first tokens wait for a prefill (and, under load, for memory); token intervals are a decode step.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "time_to_first_token_seconds": ("Time from a request's arrival to its first token.", TTFT_BUCKETS),
    "inter_token_latency_seconds": ("Time between consecutive tokens of one sequence.", ITL_BUCKETS),
    "token_jitter_seconds": ("Standard deviation of 10 consecutive inter-token intervals of one sequence.",
                             ITL_BUCKETS),
}
COUNTERS: dict[str, str] = {
    "prompt_tokens_total": "Prompt tokens of the sequences prefilled (those found in the prefix cache included; a "
                           "preempted sequence's recomputation not counted).",
    "generation_tokens_total": "Tokens generated.",
    "generate_requests_total": "Generate requests finished, by finish_reason (stop, length, cancelled, error).",
    "generate_refused_total": "Generate requests refused because the waiting queue was full (503).",
    "preemptions_total": "Running sequences preempted: for a request that waited past preemption_wait_ms, or (paged "
                         "KV admission) for the block a running sequence's next token needs.",
    "prefix_cache_queried_tokens_total": "Context tokens of admitted sequences looked up in the prefix cache.",
    "prefix_cache_hit_tokens_total": "Of those, tokens found cached (not prefilled again): hits / queried is the "
                                     "hit rate.",
    "prefix_cache_held_back_total": "Admissions held back a step for a prefix (a whole block or more) that a prompt "
                                    "admitted before them in the same step was about to write: the next step finds "
                                    "it cached.",
    "prefill_chunks_total": "Prefill launches that ran part of a prompt split by the chunk budget "
                            "(prefill_chunk_tokens: chunked prefill), its last chunk included.",
    "chunked_prefill_steps_total": "Engine steps that ran at least one such chunk.",
    "prefill_chunk_tokens_total": "Prompt tokens those chunk launches prefilled.",
    "chunked_step_seconds_total": "Time of the engine steps that ran a chunk, their decode and prefill launches.",
    "chunked_step_predicted_seconds_total": "What the ITL budget (max_itl_ratio) predicted for those steps' decode "
                                            "and chunk launches (0 without it): over the measured, how well it "
                                            "predicts.",
    "spec_decode_num_drafts_total": "Verification launches of speculative decoding (prompt lookup): one per "
                                    "drafting sequence and step.",
    "spec_decode_num_draft_tokens_total": "Tokens drafted by prompt lookup and verified.",
    "spec_decode_num_accepted_tokens_total": "Of those, tokens the model agreed with (accepted / drafted is the "
                                             "acceptance rate; each verification also gives the model's own token).",
}
GAUGES: dict[str, str] = {
    "running_sequences": "Sequences holding a KV slot and decoding.",
    "waiting_sequences": "Sequences waiting for KV cache memory.",
    "kv_cache_usage_ratio": "KV cache bytes reserved by running sequences / the KV budget.",
    "kv_cache_reserved_bytes": "KV cache bytes reserved by running sequences (kv_admission paged: the blocks each "
                               "holds; reserve: prompt + max_tokens each; kv_layout blocks: a block several "
                               "share counted once).",
    "kv_cache_blocks_used": "Blocks of 16 tokens the running sequences and kept prefixes hold (kv_admission paged or "
                            "kv_layout blocks, a shared block once; 0 when reserving prompt + max_tokens in slots).",
    "kv_cache_blocks_free": "Blocks of 16 tokens the KV budget has left (kv_admission paged or kv_layout blocks; "
                            "0 otherwise).",
    "kv_cache_fragmentation_ratio": "Share of the running sequences' reservation no key or value fills yet (paged: "
                                    "each last block's unwritten tail; reserve: the max_tokens not generated yet).",
    "kv_cache_budget_bytes": "KV cache budget: the memory budget less the weights.",
    "prefix_cache_blocks": "Blocks of 16 tokens the prefix cache keeps in slots no sequence holds.",
    "prefix_cache_bytes": "KV cache bytes those kept prefixes hold (within the budget; dropped first when needed).",
}
# LoRA adapters: the OpenAI port's /metrics writes the model-server protocol's vllm:lora_requests_info from them
# (model_factory/serving/pool_metrics.py). The limit is 0 from load; a sequences series (labels `adapter`, `state`:
# running, waiting) exists once an adapter was reported. No dashboard panel until adapters are served.
ADAPTER_GAUGES: dict[str, str] = {
    "lora_max_adapters": "LoRA adapters one batch may hold (0: this instance serves none).",
    "lora_adapter_sequences": "Sequences of one LoRA adapter, by state (running, waiting).",
    "lora_loaded_adapters": "LoRA adapters loaded in this instance's adapter slots (at most max_loras).",
}


class GenerationMetrics:
    """The generation metrics of one instance (``pb_utils`` passed in; tests use a fake)."""

    def __init__(self, pb_utils: Any, model_name: str, *, extra_labels: Mapping[str, str] | None = None,
                 interval_s: float | None = 1.0) -> None:
        family = pb_utils.MetricFamily
        self.labels = {"model": str(model_name), **{str(k): str(v) for k, v in (extra_labels or {}).items()}}
        self._families: dict[str, Any] = {}
        self._metrics: dict[tuple[str, tuple], Any] = {}
        for name, (description, _) in HISTOGRAMS.items():
            for suffix, text in (("_bucket", " Cumulative count per upper bound le."), ("_sum", " Sum."),
                                 ("_count", " Count.")):
                self._families[name + suffix] = family(name=PREFIX + name + suffix, description=description + text,
                                                       kind=family.COUNTER)
        for name, description in COUNTERS.items():
            self._families[name] = family(name=PREFIX + name, description=description, kind=family.COUNTER)
        for name, description in GAUGES.items():
            self._families[name] = family(name=PREFIX + name, description=description, kind=family.GAUGE)
        for name, description in ADAPTER_GAUGES.items():
            self._families[name] = family(name=PREFIX + name, description=description, kind=family.GAUGE)
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, tuple], float] = {}
        self._gauges: dict[str, float] = {}
        self._sent_gauges: dict[str, float] = {}
        self._adapters: dict[tuple[str, str], float] = {}
        self._sent_adapters: dict[tuple[str, str], float] = {}
        for name, (_, buckets) in HISTOGRAMS.items():  # every series exists at 0 from load
            for le in (*buckets, float("inf")):
                self._metric(name + "_bucket", le=_le(le))
            self._metric(name + "_sum")
            self._metric(name + "_count")
        for name in COUNTERS:
            if name != "generate_requests_total":
                self._metric(name)
        for name in (*GAUGES, "lora_max_adapters"):
            self._metric(name).set(0.0)
        self._stop = threading.Event()
        self._thread = None
        if interval_s is not None:
            self._interval = float(interval_s)
            self._thread = threading.Thread(target=self._flusher, name="mf-generation-metrics", daemon=True)
            self._thread.start()

    def _metric(self, name: str, **more: str) -> Any:
        labels = dict(self.labels, **more)
        key = (name, tuple(sorted(more.items())))
        metric = self._metrics.get(key)
        if metric is None:
            metric = self._metrics[key] = self._families[name].Metric(labels=labels)
        return metric

    def _add(self, name: str, value: float, **more: str) -> None:
        key = (name, tuple(sorted(more.items())))
        self._pending[key] = self._pending.get(key, 0.0) + value

    def _observe(self, name: str, seconds: float) -> None:
        buckets = HISTOGRAMS[name][1]
        with self._lock:
            first = bisect.bisect_left(buckets, seconds)  # cumulative: every bound >= the value counts it
            for le in buckets[first:]:
                self._add(name + "_bucket", 1.0, le=_le(le))
            self._add(name + "_bucket", 1.0, le="+Inf")
            self._add(name + "_sum", max(0.0, float(seconds)))
            self._add(name + "_count", 1.0)

    # ------------------------------------------------------------------ the scheduler's reports

    def first_token(self, seconds: float) -> None:
        self._observe("time_to_first_token_seconds", seconds)

    def token_interval(self, seconds: float) -> None:
        self._observe("inter_token_latency_seconds", seconds)

    def jitter(self, seconds: float) -> None:
        self._observe("token_jitter_seconds", seconds)

    def tokens(self, prompt: int, generated: int) -> None:
        with self._lock:
            if prompt:
                self._add("prompt_tokens_total", float(prompt))
            if generated:
                self._add("generation_tokens_total", float(generated))

    def preempted(self) -> None:
        with self._lock:
            self._add("preemptions_total", 1.0)

    def finished(self, reason: str) -> None:
        with self._lock:
            self._add("generate_requests_total", 1.0, finish_reason=str(reason))

    def refused(self) -> None:
        with self._lock:
            self._add("generate_refused_total", 1.0)

    def prefix_lookup(self, queried: int, hit: int) -> None:
        with self._lock:
            self._add("prefix_cache_queried_tokens_total", float(queried))
            if hit:
                self._add("prefix_cache_hit_tokens_total", float(hit))

    def prefix_held_back(self) -> None:
        with self._lock:
            self._add("prefix_cache_held_back_total", 1.0)

    def prefill_chunks(self, chunks: int) -> None:
        with self._lock:
            self._add("prefill_chunks_total", float(chunks))
            self._add("chunked_prefill_steps_total", 1.0)

    def chunked_step(self, tokens: int, predicted_s: float, measured_s: float) -> None:
        with self._lock:
            self._add("prefill_chunk_tokens_total", float(tokens))
            self._add("chunked_step_seconds_total", max(0.0, float(measured_s)))
            if predicted_s:
                self._add("chunked_step_predicted_seconds_total", float(predicted_s))

    def speculated(self, drafted: int, accepted: int) -> None:
        with self._lock:
            self._add("spec_decode_num_drafts_total", 1.0)
            self._add("spec_decode_num_draft_tokens_total", float(drafted))
            if accepted:
                self._add("spec_decode_num_accepted_tokens_total", float(accepted))

    def state(self, running: int, waiting: int, usage: Any, cached_blocks: int = 0) -> None:
        with self._lock:
            self._gauges.update(running_sequences=float(running), waiting_sequences=float(waiting),
                                kv_cache_usage_ratio=float(usage.ratio),
                                kv_cache_reserved_bytes=float(usage.reserved_bytes),
                                kv_cache_budget_bytes=float(usage.budget_bytes),
                                prefix_cache_blocks=float(cached_blocks),
                                prefix_cache_bytes=float(getattr(usage, "cached_bytes", 0)),
                                kv_cache_blocks_used=float(getattr(usage, "blocks_used", 0)),
                                kv_cache_blocks_free=float(getattr(usage, "blocks_free", 0)),
                                kv_cache_fragmentation_ratio=float(getattr(usage, "fragmentation", 0.0)))

    def adapters(self, running: Mapping[str, int], waiting: Mapping[str, int], max_adapters: int,
                 loaded: int = 0) -> None:
        """The LoRA adapters of the running and waiting sequences (adapter -> sequences), and how many one batch may
        hold. An adapter no longer reported goes to 0 (its series stays: Triton cannot drop one)."""
        with self._lock:
            now = {(a, "running"): float(n) for a, n in running.items()}
            now.update({(a, "waiting"): float(n) for a, n in waiting.items()})
            self._adapters = {**{k: 0.0 for k in self._sent_adapters}, **now}
            self._gauges["lora_max_adapters"] = float(max_adapters)
            self._gauges["lora_loaded_adapters"] = float(loaded)

    # ------------------------------------------------------------------ sending

    def _flusher(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - metrics never take the model down; retried next tick
                pass

    def flush(self) -> None:
        """Send what was added since the last flush, and the gauges that changed."""
        with self._lock:
            pending, self._pending = self._pending, {}
            gauges = {k: v for k, v in self._gauges.items() if self._sent_gauges.get(k) != v}
            self._sent_gauges.update(gauges)
            adapters = {k: v for k, v in self._adapters.items() if self._sent_adapters.get(k) != v}
            self._sent_adapters.update(adapters)
        for (name, more), value in pending.items():
            self._metric(name, **dict(more)).increment(value)
        for name, value in gauges.items():
            self._metric(name).set(value)
        for (adapter, state), value in adapters.items():
            self._metric("lora_adapter_sequences", adapter=adapter, state=state).set(value)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.flush()
        finally:
            self._metrics.clear()
            self._families.clear()


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))
