"""Where an instance's cost model starts, and how what it learns is kept and told.

:func:`start_cost_model` runs at load, cheapest source first:

1. constants given in the model configuration (``cost_model`` parameter): used as
   they are (fixed), unless ``cost_model_online = true`` makes them a prior;
2. constants this instance learned before for the same engine bytes on the same
   device (``cost_cache``): no warm-up sweep at all, one launch per profile to
   touch the engine;
3. a short warm-up (``cost_model_warmup = short``, the default): per profile, one
   and four sequences at the profile's shortest and longest length, each run once
   and then timed once; enough to start, since the estimator refines it from real
   launches;
4. ``cost_model_warmup = sweep``: the full sweep (:func:`grouping.measure_cost_model`).

Unless ``cost_model_online = false``, the result is a ``CostEstimator`` that keeps
learning. :class:`CostKeeper` saves what it learned to the cache (every so many
timings, and at unload) and writes to the load log what it started from and,
when the constants moved, what they became.
"""

from __future__ import annotations

import datetime as _dt
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from . import cost_cache
from .cost_estimator import CostEstimator, EstimatorConfig, merged_state
from .grouping import CostModel, ProfileCostModel, fit_samples, measure_cost_model, profile_for_length

WARMUPS = ("short", "sweep")

Run = Callable[[int, int], None]


@dataclass(frozen=True)
class CostStart:
    """The cost model an instance starts with and where it came from."""

    cost: CostModel | ProfileCostModel | CostEstimator
    source: str  # given | cache | short warm-up | sweep
    seconds: float  # spent measuring at load
    note: str  # one line for the load log


def short_points(buckets: Sequence[int], max_batch: int, max_tokens: int | None = None, *,
                 per_profile: bool = False) -> list[tuple[int, int]]:
    """The short warm-up's ``(n, length)`` points, cheapest first.

    Enough to tell ``a``, ``b`` and ``c`` apart, and no more (the estimator refines them
    from real launches): one sequence at a short, a middle and the longest length, and
    a few sequences at the short one and two at the middle one. ``per_profile``: that
    set inside each profile's range, so each profile's fit has its own points.
    """
    ordered = sorted(set(int(b) for b in buckets))
    few = max(1, min(4, max_batch))
    ranges = []
    previous = 0
    for bucket in ordered:
        ranges.append((previous + 1 if previous else max(1, bucket // 16), bucket))
        previous = bucket
    if not per_profile or len(ordered) < 2:
        ranges = [(max(1, ordered[-1] // 16), ordered[-1])]
    points: set[tuple[int, int]] = set()
    for low, high in ranges:
        mid = max(low, (low + high) // 2)
        for n, length in ((1, low), (few, low), (1, mid), (min(2, max_batch), mid), (1, high)):
            if max_tokens is None or n * length <= max_tokens:
                points.add((n, length))
    return sorted(points, key=lambda p: (p[0] * p[1], p))


def time_short(run: Run, points: Sequence[tuple[int, int]], buckets: Sequence[int],
               clock: Callable[[], float] = time.perf_counter, per_profile: bool = False
               ) -> list[tuple[int, int, float]]:
    """Time each point once, after one untimed run (per profile with ``per_profile``: first-use allocations)."""
    ordered = sorted(set(int(b) for b in buckets))
    touched: set[int] = set()
    samples = []
    for n, length in points:
        profile = profile_for_length(length, ordered) if per_profile else 0
        if profile not in touched:
            touched.add(profile)
            run(n, length)
        start = clock()
        run(n, length)
        samples.append((n, length, clock() - start))
    return samples


def cost_text(cost: Any) -> str:
    """Constants for a log line (with standard errors when an estimator has them)."""
    def one(m: CostModel, u: Any = None) -> str:
        def part(name: str) -> str:
            value = f"{name}={getattr(m, name):.3g}s"
            if u is not None and math.isfinite(getattr(u, name)):
                value += f"±{getattr(u, name):.2g}"
            return value

        return " ".join(part(k) for k in ("a", "b", "c"))

    if isinstance(cost, CostEstimator):
        rows = cost.profiles()
        if len(rows) == 1:
            return one(rows[0][1], rows[0][2])
        return "; ".join(f"profile {label} (<= {b} tokens): {one(m, u)}"
                         for (label, m, u), b in zip(rows, cost.buckets))
    if isinstance(cost, ProfileCostModel):
        return "; ".join(f"profile {i} (<= {b} tokens): {one(m)}" for i, (b, m) in enumerate(zip(cost.buckets, cost.models)))
    return one(cost)


def start_cost_model(*, run: Run, buckets: Sequence[int], max_batch: int, max_tokens: int | None, per_profile: bool,
                     given: tuple[float, float, float] | None = None, online: bool | None = None,
                     warmup: str = "short", repeats: int = 3, cache_file: Path | None = None,
                     config: EstimatorConfig = EstimatorConfig(), clock: Callable[[], float] = time.perf_counter
                     ) -> CostStart:
    """The instance's starting cost model (see the module docstring)."""
    if warmup not in WARMUPS:
        raise ValueError(f"cost_model_warmup={warmup!r}: use {' or '.join(WARMUPS)}")
    ordered = tuple(sorted(set(int(b) for b in buckets)))
    per_profile = per_profile and len(ordered) > 1
    learn = online if online is not None else given is None
    t0 = clock()
    if given is not None:
        model = CostModel(*given)
        if not learn:
            return CostStart(model, "given", 0.0, f"cost model given in the configuration (fixed): {cost_text(model)}")
        prior = ProfileCostModel(ordered, (model,) * len(ordered)) if per_profile else model
        est = CostEstimator(ordered, prior, per_profile=per_profile, config=config)
        return CostStart(est, "given", 0.0, f"cost model given in the configuration, learning from traffic: "
                                            f"{cost_text(est)}")
    why = "no cost cache folder (MODEL_FACTORY_COST_CACHE)"
    if learn and cache_file is not None:
        state, why = cost_cache.load_state(cache_file)
        if state is not None:
            try:
                est = CostEstimator.from_state(state["estimator"], ordered, per_profile=per_profile, config=config)
            except (ValueError, KeyError, TypeError) as exc:
                why = f"{cache_file} does not fit this engine: {exc}"
            else:
                previous = 0
                for bucket in ordered if per_profile else ordered[:1]:  # touch each profile once, untimed
                    run(1, previous + 1)
                    previous = bucket
                seconds = clock() - t0
                learned = state["estimator"].get("timings", 0)
                return CostStart(est, "cache", seconds,
                                 f"cost model learned before on this device ({learned} timings, saved "
                                 f"{state.get('saved_at', '?')}, {cache_file}), no warm-up sweep: {cost_text(est)}")
    if warmup == "sweep":
        model = measure_cost_model(run, ordered, max_batch, repeats, max_tokens=max_tokens, per_profile=per_profile,
                                   clock=clock)
        samples: list[tuple[int, int, float]] = []
        label = "warm-up sweep"
    else:
        samples = time_short(run, short_points(ordered, max_batch, max_tokens, per_profile=per_profile), ordered,
                             clock, per_profile)
        model = fit_samples(samples, ordered, per_profile)
        label = f"short warm-up ({len(samples)} launches timed)"
    seconds = clock() - t0
    if not learn:
        return CostStart(model, label, seconds, f"cost model from the {label} in {seconds:.2f} s (fixed, "
                                                f"cost_model_online=false): {cost_text(model)}")
    est = CostEstimator(ordered, model, per_profile=per_profile, prior_samples=samples, config=config)
    return CostStart(est, label, seconds, f"cost model from the {label} in {seconds:.2f} s, learning from traffic "
                                          f"({why}): {cost_text(est)}")


class CostKeeper:
    """Saves what the estimator learned (atomically, outside the repository) and logs when it moved.

    ``after_window()`` is called after every ``execute()``: it saves once ``save_every``
    new timings have come in and ``min_interval_s`` has passed since the last save, and
    logs the constants when one moved by more than ``log_change`` (relative) since the
    last line, at most every ``min_interval_s``. ``close()`` saves and logs a summary.
    """

    def __init__(self, estimator: CostEstimator, *, cache_file: Path | None, log: Callable[[str], None],
                 meta: Mapping[str, Any] | None = None, save_every: int = 64, min_interval_s: float = 10.0,
                 log_change: float = 0.25, clock: Callable[[], float] = time.monotonic) -> None:
        self.estimator = estimator
        self.cache_file = cache_file
        self.log = log
        self.meta = dict(meta or {})
        self.save_every = save_every
        self.min_interval_s = min_interval_s
        self.log_change = log_change
        self.clock = clock
        self._saved_timings = estimator.stats.timings
        self._last_save = clock()
        self._last_log = clock()
        self._logged = [m for _, m, _ in estimator.profiles()]
        self.save_error: str | None = None

    def _moved(self) -> bool:
        for old, (_, new, _) in zip(self._logged, self.estimator.profiles()):
            for name in ("a", "b", "c"):
                o, n = getattr(old, name), getattr(new, name)
                if abs(n - o) > self.log_change * max(o, n, 1e-12):
                    return True
        return False

    def after_window(self) -> None:
        now = self.clock()
        if now - self._last_log >= self.min_interval_s and self._moved():
            self._last_log = now
            self._logged = [m for _, m, _ in self.estimator.profiles()]
            self.log(f"model-factory backend: cost model relearned from {self.estimator.stats.timings} timings: "
                     f"{cost_text(self.estimator)}")
        if (self.cache_file is not None and self.estimator.stats.timings - self._saved_timings >= self.save_every
                and now - self._last_save >= self.min_interval_s):
            self.save()

    def save(self) -> None:
        """Merge what this instance learned since its last save into the cache file (the other instances'
        learning in it is kept: :func:`cost_estimator.merged_state`, under the cache's lock)."""
        if self.cache_file is None:
            return
        new = self.estimator.stats.timings - self._saved_timings
        self._last_save = self.clock()
        self._saved_timings = self.estimator.stats.timings
        saved_at = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")

        def merge(saved: Mapping[str, Any] | None) -> dict[str, Any]:
            estimator = self.estimator.state() if saved is None \
                else merged_state(saved["estimator"], self.estimator, new)
            return {"estimator": estimator, **self.meta, "saved_at": saved_at}

        try:
            cost_cache.update_state(self.cache_file, merge)
            self.save_error = None
        except OSError as exc:  # a cache is a nicety: serving goes on without it
            if self.save_error is None:
                self.log(f"model-factory backend: cannot save the learned cost model to {self.cache_file}: {exc}")
            self.save_error = str(exc)

    def close(self, planner: Any = None) -> None:
        s = self.estimator.stats
        more = ""
        if planner is not None:
            more = f", {planner.explorations} explorations, {planner.plan_changes} plan changes"
        if s.timings:
            self.save()
        where = f"; saved to {self.cache_file}" if self.cache_file is not None and s.timings and not self.save_error \
            else ""
        self.log(f"model-factory backend: cost model learned from {s.timings} timings ({s.refits} refits, "
                 f"{s.outliers} outliers{more}): {cost_text(self.estimator)}{where}")
