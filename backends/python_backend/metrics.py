"""Custom Triton metrics for the grouped batching path (see docs/metrics.md).

Made with ``pb_utils.MetricFamily`` (Triton's Python backend); ``pb_utils`` is passed
in, so tests use a fake and the backend runs without metrics when it has none.
Every family object is kept alive as long as its metrics: Triton refuses to use a
metric whose family was deleted.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

PREFIX = "model_factory_"

PADDING_RATIO_BUCKETS = (1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)
GROUPS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
GROUP_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)

# name: (kind, description, buckets or None)
FAMILIES: dict[str, tuple[str, str, tuple[float, ...] | None]] = {
    "padding_ratio": (
        "HISTOGRAM",
        "Computed tokens over real tokens for one execute() window (1 = no padding).",
        PADDING_RATIO_BUCKETS,
    ),
    "groups_per_execute": ("HISTOGRAM", "Engine launches (groups) per execute() window.", GROUPS_BUCKETS),
    "group_size": ("HISTOGRAM", "Sequences per engine launch (group).", GROUP_SIZE_BUCKETS),
    "group_retries_total": ("COUNTER", "Groups split and retried after a failure (out of memory included).", None),
    "execute_seconds": ("HISTOGRAM", "Wall time of one execute() call, in seconds.", SECONDS_BUCKETS),
    "queue_seconds": (
        "HISTOGRAM",
        "Time from a request's arrival to the start of the execute() that runs it, in seconds.",
        SECONDS_BUCKETS,
    ),
    "pool_reserved_bytes": ("GAUGE", "GPU memory the instance's pool holds (in use + cached).", None),
    "pool_used_bytes": ("GAUGE", "GPU memory handed out by the instance's pool and not yet freed.", None),
    "pool_high_water_bytes": ("GAUGE", "Most GPU memory the instance's pool has held since load or reset.", None),
    "cost_model_a_seconds": ("GAUGE", "Cost model: fixed seconds per engine launch.", None),
    "cost_model_b_seconds": ("GAUGE", "Cost model: seconds per computed token.", None),
    "cost_model_c_seconds": ("GAUGE", "Cost model: seconds per computed token per token of padded length.", None),
}


class BackendMetrics:
    """The backend's custom metrics for one model instance.

    ``labels`` (model, plus the engine flavour from ``engine_info`` and anything in
    ``extra_labels``) are put on every metric. ``cost`` (a CostModel), when given,
    is published at once under profile label ``all``.
    """

    def __init__(
        self,
        pb_utils: Any,
        model_name: str,
        cost: Any = None,
        engine_info: Mapping[str, Any] | None = None,
        *,
        extra_labels: Mapping[str, str] | None = None,
    ) -> None:
        family_class = pb_utils.MetricFamily
        self.labels = {"model": str(model_name)}
        if engine_info and "flavour" in engine_info:
            self.labels["engine"] = str(engine_info["flavour"])
        self.labels.update({str(k): str(v) for k, v in (extra_labels or {}).items()})
        self._families: dict[str, Any] = {}
        self._metrics: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        self._histograms = hasattr(family_class, "HISTOGRAM")
        for short, (kind, description, _) in FAMILIES.items():
            if kind == "HISTOGRAM" and not self._histograms:
                kind = "GAUGE"  # older Triton: publish the last value instead
            self._families[short] = family_class(
                name=PREFIX + short, description=description, kind=getattr(family_class, kind)
            )
        if cost is not None:
            self.set_cost_model(cost)

    # ------------------------------------------------------------------ plumbing

    def _metric(self, short: str, **more: str) -> Any:
        labels = dict(self.labels, **more)
        key = (short, tuple(sorted(labels.items())))
        metric = self._metrics.get(key)
        if metric is None:
            kind, _, buckets = FAMILIES[short]
            family = self._families[short]
            if kind == "HISTOGRAM" and self._histograms:
                metric = family.Metric(labels=labels, buckets=list(buckets))
            else:
                metric = family.Metric(labels=labels)
            self._metrics[key] = metric
        return metric

    def _observe(self, short: str, value: float, **more: str) -> None:
        metric = self._metric(short, **more)
        if FAMILIES[short][0] == "HISTOGRAM" and self._histograms:
            metric.observe(float(value))
        else:
            metric.set(float(value))

    # ------------------------------------------------------------------ recording

    def observe_groups(self, group_sizes: Iterable[int], padding_ratio: float) -> None:
        """One window: the size of each group launched and the window's padding ratio."""
        sizes = [int(n) for n in group_sizes]
        if not sizes:
            return
        self._observe("groups_per_execute", len(sizes))
        for n in sizes:
            self._observe("group_size", n)
        self._observe("padding_ratio", padding_ratio)

    def observe_window(self, stats: Any, seconds: float | None = None) -> None:
        """One execute(): ``stats`` has ``groups`` (sizes), ``padding_ratio`` and ``retries``."""
        self.observe_groups(getattr(stats, "groups", ()), getattr(stats, "padding_ratio", 1.0))
        retries = int(getattr(stats, "retries", 0) or 0)
        if retries:
            self._metric("group_retries_total").increment(retries)
        if seconds is not None:
            self._observe("execute_seconds", seconds)

    def observe_queue_time(self, seconds: float) -> None:
        """Arrival-to-execute time of one request, when its arrival time is known."""
        self._observe("queue_seconds", max(0.0, float(seconds)))

    def set_pool_stats(self, stats: Any) -> None:
        """Publish a PoolStats (reserved, used, high_water bytes)."""
        self._metric("pool_reserved_bytes").set(float(stats.reserved))
        self._metric("pool_used_bytes").set(float(stats.used))
        self._metric("pool_high_water_bytes").set(float(stats.high_water))

    def set_cost_model(self, cost: Any, profile: int | str = "all") -> None:
        """Publish the cost-model constants (a, b, c) for one profile (or ``all``)."""
        for name in ("a", "b", "c"):
            self._metric(f"cost_model_{name}_seconds", profile=str(profile)).set(float(getattr(cost, name)))

    def close(self) -> None:
        """Drop the metrics, then their families (Triton wants them deleted in that order)."""
        self._metrics.clear()
        self._families.clear()
