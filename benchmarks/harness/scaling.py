"""The autoscaling signal: the prometheus-adapter rule's formula, evaluated on scrapes of one server.

The Helm chart (deploy/helm/model-factory) ships a prometheus-adapter rule that turns Triton's
cumulative counters into the per-pod custom metric its HPA scales on::

    sum(rate(nv_inference_queue_duration_us{<<.LabelMatchers>>}[1m])) by (<<.GroupBy>>)
      / clamp_min(sum(rate(nv_inference_compute_infer_duration_us{<<.LabelMatchers>>}[1m])) by (<<.GroupBy>>), 1)

that is, the time requests spent queued over the time they spent computing, both per second
of wall time. :func:`parse_ratio_rule` reads that exact shape (and refuses any other, so the
rule cannot drift away from what is evaluated here); :func:`evaluate` computes it for one pod
from two scrapes of its metrics endpoint, as Prometheus would over a window spanning them (a
counter's ``rate`` over a window is its increase divided by the window's length).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from model_factory.measure.bench import Sample, metric_total
from model_factory.errors import FactoryError

_METRIC = r"([a-zA-Z_:][a-zA-Z0-9_:]*)"
_MATCH = r"\{[^}]*\}"
_WINDOW = r"\[([0-9]+[smh])\]"
_BY = r"\s*by\s*\([^)]*\)"
_RATE = rf"sum\(rate\({_METRIC}{_MATCH}{_WINDOW}\)\){_BY}"
_RULE = re.compile(rf"^\s*{_RATE}\s*/\s*clamp_min\(\s*{_RATE}\s*,\s*([0-9.eE+-]+)\s*\)\s*$")


@dataclass(frozen=True)
class RatioRule:
    """``sum(rate(numerator)) / clamp_min(sum(rate(denominator)), floor)`` over ``window``."""

    numerator: str
    denominator: str
    window: str
    floor: float


def parse_ratio_rule(metrics_query: str) -> RatioRule:
    """Read a prometheus-adapter ``metricsQuery`` of the ratio shape above."""
    m = _RULE.match(metrics_query)
    if not m:
        raise FactoryError(f"metricsQuery {metrics_query!r} is not 'sum(rate(A{{..}}[w])) by (..) / "
                           "clamp_min(sum(rate(B{..}[w])) by (..), floor)'. Fix: keep the chart's rule shape, "
                           "or extend benchmarks.harness.scaling to evaluate the new one")
    num, w1, den, w2, floor = m.groups()
    if w1 != w2:
        raise FactoryError(f"metricsQuery uses two windows ({w1}, {w2}). Fix: use one window for both rates")
    return RatioRule(num, den, w1, float(floor))


def evaluate(rule: RatioRule, before: Sequence[Sample], after: Sequence[Sample], seconds: float) -> float:
    """The rule's value for one pod between two scrapes ``seconds`` apart (all models of the pod summed)."""
    if seconds <= 0:
        raise FactoryError(f"scrapes must be taken apart in time (got {seconds} s)")

    def rate(name: str) -> float:
        increase = (metric_total(after, name) or 0.0) - (metric_total(before, name) or 0.0)
        if increase < 0:  # a counter reset (the server restarted): Prometheus would count from zero
            increase = metric_total(after, name) or 0.0
        return increase / seconds

    return rate(rule.numerator) / max(rate(rule.denominator), rule.floor)
