"""Custom Triton metrics for the grouped batching path (see docs/metrics.md).

Made with ``pb_utils.MetricFamily`` (Triton's Python backend); ``pb_utils`` is passed
in, so tests use a fake and the backend runs without metrics when it has none.
Every family object is kept alive as long as its metrics: Triton refuses to use a
metric whose family was deleted.

Why counters, summed here and flushed about once a second: every metric call in
the Python backend is a round trip from the stub process to the Triton process.
Measured on 2 CPU cores with one request in flight, the four histogram
observations per ``execute()`` this module used to make took 1.3-1.5 ms of a
~13 ms request. Counters can be summed in-process and sent as one increment each,
and their rates give the same means (padding ratio = computed / real tokens over
any interval, mean group size = sequences / groups, ...) exactly, weighted by
tokens rather than by windows.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping

PREFIX = "model_factory_"

# name: (kind, description)
FAMILIES: dict[str, tuple[str, str]] = {
    "executions_total": ("COUNTER", "execute() windows run by the backend (one per Triton model execution)."),
    "sequences_total": ("COUNTER", "Sequences run (one per request item), failed ones included."),
    "groups_total": ("COUNTER", "Engine launches (groups); groups_total / executions_total = groups per window."),
    "real_tokens_total": ("COUNTER", "Tokens of the sequences run, without padding."),
    "computed_tokens_total": (
        "COUNTER",
        "Tokens computed, each group padded to its longest sequence; computed / real = padding ratio.",
    ),
    "group_retries_total": ("COUNTER", "Groups split and retried after a failure (out of memory included)."),
    "groups_split_for_memory_total": (
        "COUNTER", "Groups split before launch because their activations would not fit the GPU memory free now."),
    "engine_info": ("GAUGE", "1, labelled with what the instance runs: precision, int8_kernels (integer or "
                             "simulated, ONNX Runtime CPU INT8), int8_weights (8-bit, or 7-bit: model.int8.w7.onnx on a CPU "
                             "without VNNI/AMX), threads (ONNX Runtime CPU intra-op threads), "
                             "wide_threads (the threads of a run on borrowed idle cores; 0: it never borrows), sandbox (on (Landlock "
                             "ABI n, seccomp): the stub is walled in since it loaded; off (why))."),
    "borrowed_core_runs_total": (
        "COUNTER", "Engine runs that took every core because no other CPU instance was computing (idle cores lent)."),
    "execute_seconds_total": ("COUNTER", "Wall time spent in execute(), in seconds."),
    "long_inputs_total": ("COUNTER", "Texts over max_sequence_length, by what was done (action=refused: 400, "
                                     "truncated: cut and said in truncated_tokens, chunked: pooled from windows)."),
    "events_dropped_total": ("COUNTER", "Decision events the rate limit did not write (each written event says "
                                        "how many it follows)."),
    "degraded_requests_total": ("COUNTER", "Requests answered by the degrade precision (label precision) because "
                                           "their window's backlog reached degrade_backlog (docs/serving.md, "
                                           "\"Degrade before shedding\")."),
    "truncated_tokens_total": ("COUNTER", "Tokens cut from truncated texts (the model never saw them)."),
    "trace_spans_total": ("COUNTER", "The backend's trace spans (serve --trace-endpoint), by outcome: sent to the "
                                     "collector, or dropped (export queue full, collector away or refusing)."),
    "pool_reserved_bytes": ("GAUGE", "GPU memory the instance's pool holds (in use + cached)."),
    "pool_used_bytes": ("GAUGE", "GPU memory handed out by the instance's pool and not yet freed."),
    "pool_high_water_bytes": ("GAUGE", "Most GPU memory the instance's pool has held since load or reset."),
    "cost_model_a_seconds": ("GAUGE", "Cost model: fixed seconds per engine launch."),
    "cost_model_b_seconds": ("GAUGE", "Cost model: seconds per computed token."),
    "cost_model_c_seconds": ("GAUGE", "Cost model: seconds per computed token per token of padded length."),
    "cost_model_a_stderr_seconds": ("GAUGE", "Cost model: standard error of a (+Inf until the data can tell)."),
    "cost_model_b_stderr_seconds": ("GAUGE", "Cost model: standard error of b (+Inf until the data can tell)."),
    "cost_model_c_stderr_seconds": ("GAUGE", "Cost model: standard error of c (+Inf until the data can tell)."),
    "cost_model_timings_total": ("COUNTER", "Engine launches timed and fed back to the cost model's estimator."),
    "cost_model_outliers_total": ("COUNTER", "Timings more than 3x away from the median of their (n, length) cell."),
    "cost_model_refits_total": ("COUNTER", "Times the cost model's constants were refitted from recent timings."),
    "cost_model_plan_changes_total": (
        "COUNTER", "Recent windows whose split changed when a refit changed the constants."),
    "cost_model_explorations_total": ("COUNTER", "Windows run with a split the model had not timed (exploration)."),
    "cost_model_modelled_seconds_total": (
        "COUNTER",
        "Modelled seconds of each window's split (plan=chosen: the split run; best: the least-cost one; one_group: "
        "padded to the longest; singles: one launch per sequence), under the constants it was planned with.",
    ),
}

# The plans priced for every window (label plan of cost_model_modelled_seconds_total): PlanReport attributes.
PLANS = ("chosen", "best", "one_group", "singles")

# Counter: the WindowStats attribute summed into it (execute_seconds_total and executions_total aside).
_WINDOW_COUNTERS = {
    "sequences_total": "sequences",
    "groups_total": "group_count",
    "real_tokens_total": "real_tokens",
    "computed_tokens_total": "computed_tokens",
    "group_retries_total": "retries",
    "groups_split_for_memory_total": "memory_splits",
    "cost_model_timings_total": "timings",
    "cost_model_outliers_total": "outliers",
    "cost_model_refits_total": "refits",
    "cost_model_plan_changes_total": "plan_changes",
    "cost_model_explorations_total": "explorations",
}

# What happened to texts over the limit (label action of long_inputs_total).
LONG_INPUT_ACTIONS = ("refused", "truncated", "chunked")

# What became of the backend's trace spans (label outcome of trace_spans_total).
TRACE_OUTCOMES = ("sent", "dropped")

# engine_info keys published as labels of the engine_info gauge (loading.load_engine's info).
ENGINE_INFO_LABELS = ("precision", "int8_kernels", "int8_weights", "threads", "wide_threads", "sandbox")

PoolSource = Callable[[], Any]  # returns PoolStats-like (reserved, used, high_water) or a dict, or None


class BackendMetrics:
    """The backend's custom metrics for one model instance.

    ``labels`` (model, plus the engine flavour and device from ``engine_info`` and anything in
    ``extra_labels``) are put on every metric. ``cost``, when given, is published
    at once: a CostModel under profile label ``all``, a ProfileCostModel under each
    profile's index; a learning ``CostEstimator`` (anything with ``profiles()``) is read
    again at every flush and its constants and standard errors re-sent when they
    changed. Window counters are summed
    in-process and sent by :meth:`flush`, which a background thread calls every
    ``interval_s`` seconds while there is something new (``interval_s=None``: no
    thread, the caller flushes). ``pool_source``, when given, is read at each flush
    and published as the pool gauges.
    """

    def __init__(
        self,
        pb_utils: Any,
        model_name: str,
        cost: Any = None,
        engine_info: Mapping[str, Any] | None = None,
        *,
        extra_labels: Mapping[str, str] | None = None,
        interval_s: float | None = 1.0,
        pool_source: PoolSource | None = None,
    ) -> None:
        family_class = pb_utils.MetricFamily
        self.labels = {"model": str(model_name)}
        if engine_info and "flavour" in engine_info:
            self.labels["engine"] = str(engine_info["flavour"])
        if engine_info and engine_info.get("device"):  # where it computes: cpu, cuda:<id>
            self.labels["device"] = str(engine_info["device"])
        self.labels.update({str(k): str(v) for k, v in (extra_labels or {}).items()})
        self._families: dict[str, Any] = {}
        self._metrics: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        for short, (kind, description) in FAMILIES.items():
            self._families[short] = family_class(
                name=PREFIX + short, description=description, kind=getattr(family_class, kind)
            )
        self._lock = threading.Lock()  # guards _pending (execute() adds, the flusher takes)
        self._send_lock = threading.Lock()  # one flush at a time, so counters are sent in order
        self._pending: dict[tuple[str, str, str], float] = {}  # (short name, label value or "", label name)
        self._pool_source = pool_source
        self._last_pool: tuple[float, float, float] | None = None
        # Counters exist (at 0) from load, so a scrape before any traffic already lists them.
        for short in ("executions_total", "execute_seconds_total", "borrowed_core_runs_total", *_WINDOW_COUNTERS):
            self._metric(short)
        for plan in PLANS:
            self._metric("cost_model_modelled_seconds_total", plan=plan)
        for action in LONG_INPUT_ACTIONS:
            self._metric("long_inputs_total", action=action)
        self._metric("truncated_tokens_total")
        self._metric("events_dropped_total")
        self._events_dropped_sent = 0
        for outcome in TRACE_OUTCOMES:
            self._metric("trace_spans_total", outcome=outcome)
        self._trace_spans_sent = dict.fromkeys(TRACE_OUTCOMES, 0)
        info = {k: str(engine_info[k]) for k in ENGINE_INFO_LABELS if engine_info and engine_info.get(k) is not None}
        self._metric("engine_info", **info).set(1.0)
        self._estimator = cost if cost is not None and hasattr(cost, "profiles") else None
        self._last_cost: dict[str, tuple[float, ...]] = {}
        if self._estimator is not None:
            self._publish_estimator()
        elif cost is not None:
            models = getattr(cost, "models", None)
            if models is not None:  # a ProfileCostModel: one set of constants per optimization profile
                for profile, model in enumerate(models):
                    self.set_cost_model(model, profile)
            else:
                self.set_cost_model(cost)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        if interval_s is not None:
            self._interval = float(interval_s)
            self._thread = threading.Thread(target=self._flusher, name="model-factory-metrics", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ plumbing

    def _metric(self, short: str, **more: str) -> Any:
        labels = dict(self.labels, **more)
        key = (short, tuple(sorted(labels.items())))
        metric = self._metrics.get(key)
        if metric is None:
            metric = self._families[short].Metric(labels=labels)
            self._metrics[key] = metric
        return metric

    def _add(self, short: str, value: float, plan: str = "", label: str = "plan") -> None:
        if value:
            key = (short, plan, label)
            self._pending[key] = self._pending.get(key, 0.0) + float(value)

    def _flusher(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - metrics must never take the model down; retried next tick
                pass

    # ------------------------------------------------------------------ recording

    def observe_window(self, stats: Any, seconds: float | None = None) -> None:
        """One execute(): add its counts (``stats``: a WindowStats) to what the next flush sends."""
        with self._lock:
            self._add("executions_total", 1)
            for short, attr in _WINDOW_COUNTERS.items():
                self._add(short, getattr(stats, attr, 0) or 0)
            if seconds is not None:
                self._add("execute_seconds_total", max(0.0, float(seconds)))
            report = getattr(stats, "plan", None)
            if report is not None:
                for plan in PLANS:
                    self._add("cost_model_modelled_seconds_total", getattr(report, plan, 0.0) or 0.0, plan)

    def observe_long_inputs(self, refused: int = 0, truncated: int = 0, chunked: int = 0, dropped: int = 0) -> None:
        """Texts over the limit in one window, by action, and the tokens truncation cut."""
        with self._lock:
            for action, count in (("refused", refused), ("truncated", truncated), ("chunked", chunked)):
                self._add("long_inputs_total", count, action, "action")
            self._add("truncated_tokens_total", dropped)

    def add_degraded(self, precision: str, count: int) -> None:
        """Requests of one window answered by the degrade precision."""
        with self._lock:
            self._add("degraded_requests_total", count, str(precision), "precision")

    def set_events_dropped(self, total: int) -> None:
        """The instance's events refused by the rate limit so far (the counter gets the difference)."""
        with self._lock:
            self._add("events_dropped_total", max(0, int(total) - self._events_dropped_sent))
            self._events_dropped_sent = max(self._events_dropped_sent, int(total))

    def set_trace_spans(self, sent: int, dropped: int) -> None:
        """The span exporter's totals so far (sent, dropped); the counter gets the differences."""
        with self._lock:
            for outcome, total in (("sent", sent), ("dropped", dropped)):
                self._add("trace_spans_total", max(0, int(total) - self._trace_spans_sent[outcome]), outcome,
                          "outcome")
                self._trace_spans_sent[outcome] = max(self._trace_spans_sent[outcome], int(total))

    def add_borrowed_runs(self, count: int) -> None:
        """Runs on borrowed cores since the last call (the engine's ``wide_runs`` difference)."""
        with self._lock:
            self._add("borrowed_core_runs_total", count)

    def flush(self) -> None:
        """Send what was added since the last flush, and the pool gauges if they changed."""
        with self._send_lock:
            with self._lock:
                pending, self._pending = self._pending, {}
            for (short, value_label, label), value in pending.items():
                (self._metric(short, **{label: value_label}) if value_label else self._metric(short)).increment(value)
            if self._estimator is not None:
                self._publish_estimator()
            if self._pool_source is not None:
                stats = self._pool_source()
                if stats:  # None or {} where the engine has no pool (a CPU instance)
                    self.set_pool_stats(stats)

    def set_pool_stats(self, stats: Any) -> None:
        """Publish pool bytes (reserved, used, high_water), from a PoolStats or a dict; unchanged values are not re-sent."""
        get = stats.get if isinstance(stats, Mapping) else lambda k: getattr(stats, k)
        values = (float(get("reserved")), float(get("used")), float(get("high_water")))
        if values == self._last_pool:
            return
        self._last_pool = values
        for short, value in zip(("pool_reserved_bytes", "pool_used_bytes", "pool_high_water_bytes"), values):
            self._metric(short).set(value)

    def set_cost_model(self, cost: Any, profile: int | str = "all", stderr: Any = None) -> None:
        """Publish the cost-model constants (a, b, c) for one profile (or ``all``), and their standard errors."""
        for name in ("a", "b", "c"):
            self._metric(f"cost_model_{name}_seconds", profile=str(profile)).set(float(getattr(cost, name)))
            if stderr is not None:
                self._metric(f"cost_model_{name}_stderr_seconds", profile=str(profile)).set(
                    float(getattr(stderr, name)))

    def _publish_estimator(self) -> None:
        """Re-send a learning estimator's constants and standard errors, where they changed since last sent."""
        for label, model, stderr in self._estimator.profiles():
            values = tuple(float(getattr(x, k)) for x in (model, stderr) for k in ("a", "b", "c"))
            if self._last_cost.get(label) != values:
                self._last_cost[label] = values
                self.set_cost_model(model, label, stderr)

    def close(self) -> None:
        """Stop the flusher, send what is pending, then drop the metrics and their families (in that order)."""
        if self._thread is not None:
            self._stop.set()
            self._wake.set()
            self._thread.join(timeout=5)
            self._thread = None
        try:
            self.flush()
        finally:
            self._metrics.clear()
            self._families.clear()
