"""A running estimate of the cost model, refitted from the timings of real launches.

The load-time warm-up gives a first guess of ``a + b·n·L + c·n·L²`` (see
``grouping``); this module keeps learning from every launch the executor times:

- **Cells.** A timing ``(n, L, seconds)`` lands in the cell of its shape class (batch
  size and padded length binned by powers of about 1.5, per optimization profile). A
  cell keeps only its last ``cell_size`` timings and stands for one point, its median
  shape, at the **median** of its timings, each first rescaled by the current model
  from its own shape to that point (``t · M(point) / M(n, L)``, so shapes inside a
  cell compare). One stall or GC pause in a cell moves nothing, and a cell follows a
  real change once half of its recent timings show it; timings older than two
  half-lives give way as soon as three newer ones are in the cell.
- **Recency.** A cell weighs ``0.5 ** (age / half_life)`` (times the share of
  ``cell_size`` it holds), ``age`` being the median age of the timings its median
  stands for, counted in timings the estimator has seen since; so the fit follows
  current traffic; cells
  from the warm-up (or from a cache of what this instance learned before) are the
  prior, kept at a small floor weight so that directions the traffic never explores
  stay anchored to what was measured.
- **Robust fit.** Every ``refit_every`` timings the constants are refitted over the
  cells, by non-negative least squares on the *relative* error (as
  ``grouping.fit_cost_model``), then reweighted with Huber weights on the residuals
  (scale from their median absolute deviation) so that no single cell can pull the
  constants far from what the others support.
- **Uncertainty.** The standard errors of ``a, b, c`` come from the residuals and the
  design of the last fit; with fewer distinct cells than constants they are infinite
  (the planner then treats the model as unsure).

Pure Python and numpy, no clock: time is counted in timings, so a test replays
synthetic timings deterministically. Runs inside the Python-backend stub.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .grouping import CostModel, ProfileCostModel, _nnls3, profile_for_length

STATE_VERSION = 1


@dataclass(frozen=True)
class EstimatorConfig:
    """How the estimator weighs and refits (defaults tuned on MiniLM, 2 CPU cores)."""

    cell_size: int = 8  # timings kept per cell (the most recent); the cell stands for their median
    half_life: float = 96.0  # timings seen since a timing that halve its weight
    prior_weight: float = 0.05  # floor weight of a prior cell (warm-up, cache), relative to a full live cell
    refit_every: int = 32  # timings between refits (a refit takes ~2 ms on 2 CPU cores)
    huber_k: float = 1.5  # Huber threshold, in robust standard deviations of the relative residuals
    max_cells: int = 512  # per estimator; the lowest-weight live cells go first
    outlier_factor: float = 3.0  # a timing this far from its cell's median counts as an outlier (metric only)

    def __post_init__(self) -> None:
        if self.cell_size < 1 or self.refit_every < 1 or self.max_cells < 8:
            raise ValueError("cell_size and refit_every must be >= 1, max_cells >= 8")
        if not (self.half_life > 0 and 0 <= self.prior_weight <= 1 and self.huber_k > 0 and self.outlier_factor > 1):
            raise ValueError("half_life, huber_k > 0; 0 <= prior_weight <= 1; outlier_factor > 1")


def length_bin(length: int) -> int:
    """The upper end of ``length``'s bin: 8, 16, 24, 32, 48, 64, 96, 128, 192, ... (about 1.5x apart)."""
    length = int(length)
    if length <= 32:
        return max(8, -(-length // 8) * 8)
    edge = 32
    while edge < length:
        edge = edge * 3 // 2 if (edge & (edge - 1)) == 0 else edge * 4 // 3  # 32, 48, 64, 96, 128, ...
    return edge


def size_bin(n: int) -> int:
    """The upper end of ``n``'s bin: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, ..."""
    n = int(n)
    if n <= 4:
        return n
    edge = 4
    while edge < n:
        edge = edge * 3 // 2 if (edge & (edge - 1)) == 0 else edge * 4 // 3
    return edge


@dataclass
class _Cell:
    times: deque  # of (n, length, seconds, stamp): stamp = the estimator's timing count then
    last: int  # the estimator's timing count when last updated
    prior: bool = False  # from the warm-up or the cache, not yet refreshed by live traffic
    live: int = 0  # live timings that reached this cell, ever
    _memo: tuple | None = None  # (key, point, median stamp) of the last point() (refits recompute only changes)

    def used(self, fresh_from: int) -> list:
        """The timings the cell stands for: those from ``fresh_from`` on when there are three, else all."""
        times = [x for x in self.times if x[3] >= fresh_from]
        return times if len(times) >= min(3, len(self.times)) else list(self.times)

    def point(self, model: CostModel, fresh_from: int = 0) -> tuple[int, int, float]:
        """``(n, length, seconds)``: the median shape, at the median of the timings rescaled to it by ``model``.

        Timings stamped before ``fresh_from`` are left out when at least three newer ones are there.
        """
        return self._point(model, fresh_from)[0]

    def stamp(self, model: CostModel, fresh_from: int) -> float:
        """The median stamp of the timings :meth:`point` stands for (their age tells the cell's weight)."""
        return self._point(model, fresh_from)[1]

    def _point(self, model: CostModel, fresh_from: int) -> tuple[tuple[int, int, float], float]:
        # Recomputed when the cell's timings (or those it stands for) change; a refit's new constants alone
        # do not redo the rescaling inside a cell (its shapes are close: the old constants rescale them as well).
        key = (self.last, len(self.times), sum(1 for x in self.times if x[3] >= fresh_from))
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1], self._memo[2]
        times = self.used(fresh_from)
        stamp = _median(sorted(x[3] for x in times))
        point = self._compute(times, model)
        self._memo = (key, point, stamp)
        return point, stamp

    @staticmethod
    def _compute(times: list, model: CostModel) -> tuple[int, int, float]:
        n = int(_median(sorted(x[0] for x in times)))
        length = int(_median(sorted(x[1] for x in times)))
        here = model.cost(n, length)
        scaled = []
        for tn, tl, seconds, _ in times:
            there = model.cost(tn, tl)
            scaled.append(seconds * here / there if there > 0 and here > 0 else seconds)
        return n, length, _median(sorted(scaled))

    def median_seconds(self) -> float:
        return _median(sorted(x[2] for x in self.times))


def _median(xs: Sequence[float]) -> float:
    m = len(xs)
    return float(xs[m // 2]) if m % 2 else 0.5 * (xs[m // 2 - 1] + xs[m // 2])


@dataclass(frozen=True)
class Uncertainty:
    """Standard errors of one profile's constants (seconds; ``inf`` when the data cannot tell)."""

    a: float
    b: float
    c: float

    def relative(self, model: CostModel) -> float:
        """The largest standard error relative to its constant, over the constants that matter (> 0)."""
        worst = 0.0
        for name in ("a", "b", "c"):
            value, se = getattr(model, name), getattr(self, name)
            if value > 0:
                worst = max(worst, se / value)
            elif math.isinf(se):
                worst = math.inf
        return worst


@dataclass
class EstimatorStats:
    """Counts since load (the metrics send their increments)."""

    timings: int = 0
    outliers: int = 0
    refits: int = 0
    rejected: int = 0  # timings refused outright (not finite, <= 0)


class CostEstimator:
    """The running cost model of one engine: per profile when the engine has one per bucket."""

    def __init__(self, buckets: Sequence[int], prior: CostModel | ProfileCostModel, *, per_profile: bool = False,
                 prior_samples: Iterable[tuple[int, int, float]] = (), config: EstimatorConfig = EstimatorConfig()
                 ) -> None:
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        if not self.buckets:
            raise ValueError("CostEstimator needs at least one bucket")
        self.per_profile = bool(per_profile) and len(self.buckets) > 1
        self.config = config
        self.stats = EstimatorStats()
        self.learned_before = 0  # timings behind a prior restored from a saved state
        self._count = 0  # timings seen (the estimator's clock)
        self._since_refit = 0
        self._cells: dict[tuple[int, int, int], _Cell] = {}
        self._models = list(self._split(prior))
        self._uncertainty = [Uncertainty(math.inf, math.inf, math.inf) for _ in self._models]
        for n, length, seconds in prior_samples:
            self._add(int(n), int(length), float(seconds), prior=True)
        if self._cells:
            self.refit()

    # ------------------------------------------------------------------ views

    def _split(self, model: CostModel | ProfileCostModel) -> tuple[CostModel, ...]:
        if isinstance(model, ProfileCostModel):
            if not self.per_profile:
                raise ValueError("a per-profile prior needs per_profile=True and more than one bucket")
            if tuple(model.buckets) != self.buckets:
                raise ValueError(f"prior buckets {model.buckets} differ from {self.buckets}")
            return tuple(model.models)
        return (model,) * (len(self.buckets) if self.per_profile else 1)

    @property
    def model(self) -> CostModel | ProfileCostModel:
        """The current constants, as the planner takes them."""
        if self.per_profile:
            return ProfileCostModel(self.buckets, tuple(self._models))
        return self._models[0]

    @property
    def uncertainty(self) -> tuple[Uncertainty, ...]:
        """Standard errors, one per fitted model (per profile, or one)."""
        return tuple(self._uncertainty)

    def profiles(self) -> list[tuple[str, CostModel, Uncertainty]]:
        """``(profile label, constants, uncertainty)``: labels ``0, 1, ...`` per profile, or ``all``."""
        if self.per_profile:
            return [(str(i), m, u) for i, (m, u) in enumerate(zip(self._models, self._uncertainty))]
        return [("all", self._models[0], self._uncertainty[0])]

    def relative_uncertainty(self, length: int | None = None) -> float:
        """The worst relative standard error (of the profile covering ``length``, or of all)."""
        if length is not None:
            i = self._profile(length)
            return self._uncertainty[i].relative(self._models[i])
        return max(u.relative(m) for m, u in zip(self._models, self._uncertainty))

    def timed(self, n: int, length: int, minimum: int = 3) -> bool:
        """Whether live traffic has timed a launch of ``n`` padded to about ``length`` (``minimum`` times)."""
        cell = self._cells.get(self._key(n, length))
        return cell is not None and cell.live >= minimum

    @property
    def cell_count(self) -> int:
        return len(self._cells)

    # ------------------------------------------------------------------ learning

    def _profile(self, length: int) -> int:
        return profile_for_length(length, self.buckets) if self.per_profile else 0

    def _key(self, n: int, length: int) -> tuple[int, int, int]:
        return (self._profile(length), size_bin(n), length_bin(length))

    def _add(self, n: int, length: int, seconds: float, prior: bool) -> None:
        key = self._key(n, length)
        cell = self._cells.get(key)
        if cell is None:
            cell = self._cells[key] = _Cell(deque(maxlen=self.config.cell_size), self._count, prior)
        elif cell.prior and not prior:
            # Live traffic replaces what the warm-up or the cache said about this cell.
            cell.times.clear()
            cell.prior = False
        if not prior and len(cell.times) >= 3:
            cn, cl, median = cell.point(self._models[key[0]], self._fresh_from())
            expected = median * _ratio(self._models[key[0]], n, length, cn, cl)
            f = self.config.outlier_factor
            if seconds > f * expected or seconds * f < expected:
                self.stats.outliers += 1
        cell.times.append((n, length, seconds, self._count))
        cell.last = self._count
        if not prior:
            cell.live += 1
        if len(self._cells) > self.config.max_cells:
            self._evict()

    def _evict(self) -> None:
        live = [(self._weight(c, k[0]), k) for k, c in self._cells.items() if not c.prior]
        live.sort()
        for _, k in live[: max(1, len(self._cells) - self.config.max_cells)]:
            del self._cells[k]

    def observe(self, n: int, length: int, seconds: float) -> bool:
        """Add one launch's timing; refit when due. Returns True when the constants were refitted."""
        if n < 1 or length < 1 or not math.isfinite(seconds) or seconds <= 0:
            self.stats.rejected += 1
            return False
        self._count += 1
        self.stats.timings += 1
        self._add(int(n), int(length), float(seconds), prior=False)
        self._since_refit += 1
        if self._since_refit >= self.config.refit_every:
            self.refit()
            return True
        return False

    def _fresh_from(self) -> int:
        """Timings older than this (two half-lives) give way to newer ones in their cell."""
        return self._count - int(2 * self.config.half_life)

    def _weight(self, cell: _Cell, profile: int) -> float:
        # A cell counts by the age of the timings its median stands for: one refreshed by a new timing
        # among seven old ones weighs as little as its old median deserves; one full of recent ones weighs 1.
        fresh = self._fresh_from()
        model = self._models[profile]
        age = max(0.0, self._count - cell.stamp(model, fresh))
        w = 0.5 ** (age / self.config.half_life) * len(cell.used(fresh)) / self.config.cell_size
        if cell.prior:
            w = max(w, 1.0 / self.config.cell_size) * self.config.prior_weight
        return w

    def refit(self) -> None:
        """Refit every profile's constants from its cells (a profile with too little data keeps its own)."""
        self._since_refit = 0
        self.stats.refits += 1
        groups: dict[int, list[tuple[float, float, float, float]]] = {}
        fresh = self._fresh_from()
        for (profile, _, _), cell in self._cells.items():
            n, length, seconds = cell.point(self._models[profile], fresh)
            groups.setdefault(profile, []).append((float(n), float(length), seconds, self._weight(cell, profile)))
        for profile, rows in groups.items():
            fitted = fit_robust(rows, self.config.huber_k)
            if fitted is not None:
                self._models[profile], self._uncertainty[profile] = fitted

    # ------------------------------------------------------------------ state (the cache)

    def state(self) -> dict[str, Any]:
        """What was learned, as JSON-able data (the cells' points and the constants)."""
        cells = []
        fresh = self._fresh_from()
        for (profile, _, _), cell in self._cells.items():
            n, length, seconds = cell.point(self._models[profile], fresh)
            cells.append([n, length, seconds, cell.live])
        return {"version": STATE_VERSION, "buckets": list(self.buckets), "per_profile": self.per_profile,
                "timings": self.learned_before + self.stats.timings, "constants": [[m.a, m.b, m.c] for m in self._models],
                "cells": cells}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], buckets: Sequence[int], *, per_profile: bool = False,
                   config: EstimatorConfig = EstimatorConfig()) -> "CostEstimator":
        """An estimator whose prior is a saved :meth:`state` (its cells become prior cells).

        Raises ``ValueError`` when the state does not fit (another version, other buckets).
        """
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"cost model state version {state.get('version')!r}, expected {STATE_VERSION}")
        ordered = tuple(sorted(set(int(b) for b in buckets)))
        if tuple(state.get("buckets", ())) != ordered or bool(state.get("per_profile")) != (
                bool(per_profile) and len(ordered) > 1):
            raise ValueError("cost model state was learned for other buckets or profiles")
        models = tuple(CostModel(*map(float, abc)) for abc in state["constants"])
        prior: CostModel | ProfileCostModel = (ProfileCostModel(ordered, models) if len(models) > 1 else models[0])
        samples = []
        for n, length, seconds, _live in state.get("cells", []):
            samples.append((int(n), max(1, int(round(float(length)))), float(seconds)))
        est = cls(ordered, prior, per_profile=per_profile, prior_samples=samples, config=config)
        est._models = list(models if len(models) > 1 else models * len(est._models))  # as saved, not refitted
        est.learned_before = int(state.get("timings", 0))
        return est


def merged_state(saved: Mapping[str, Any], mine: CostEstimator, new_timings: int) -> dict[str, Any]:
    """``saved`` (what the model's instances saved so far) with what ``mine`` learned merged into it.

    Both sets of cells meet in one estimator (one point per cell each, so a cell both learned holds both
    medians) and the constants are refitted from them; the timings add up: the saved count plus the
    ``new_timings`` this instance made since it last saved. A saved state that does not fit (another
    version, other buckets) is replaced by ``mine``'s.
    """
    try:
        est = CostEstimator.from_state(saved, mine.buckets, per_profile=mine.per_profile, config=mine.config)
    except (ValueError, KeyError, TypeError):
        return mine.state()
    for n, length, seconds, _live in mine.state()["cells"]:
        est._add(int(n), max(1, int(round(float(length)))), float(seconds), prior=True)
    est.refit()
    state = est.state()
    state["timings"] = int(saved.get("timings", 0)) + max(0, int(new_timings))
    return state


def _ratio(model: CostModel, n: int, length: int, cn: int, cl: int) -> float:
    """``model``'s cost at ``(n, length)`` over its cost at ``(cn, cl)`` (1 when undefined)."""
    there = model.cost(cn, cl)
    return model.cost(n, length) / there if there > 0 else 1.0


def fit_robust(rows: Sequence[tuple[float, float, float, float]], huber_k: float = 1.5, iterations: int = 4
               ) -> tuple[CostModel, Uncertainty] | None:
    """Fit ``a, b, c >= 0`` to weighted points ``(n, length, seconds, weight)``; None with too little data.

    Minimises the weighted relative error (Huber-reweighted), as the module docstring says.
    """
    pts = [r for r in rows if r[2] > 0 and r[3] > 0 and math.isfinite(r[2])]
    if len({(r[0], round(r[1], 3)) for r in pts}) < 2:
        return None
    n = np.array([r[0] for r in pts])
    length = np.array([r[1] for r in pts])
    t = np.array([r[2] for r in pts])
    w = np.array([r[3] for r in pts])
    tokens = n * length
    x = np.stack([np.ones_like(t), tokens, tokens * length], axis=1) / t[:, None]  # model / t, to equal 1
    huber = np.ones_like(t)
    coef = np.zeros(3)
    for _ in range(iterations):
        sw = np.sqrt(w * huber)
        coef = _nnls3(x * sw[:, None], sw)
        r = x @ coef - 1.0
        scale = max(1.4826 * float(np.median(np.abs(r))), 0.02)
        new = np.minimum(1.0, huber_k * scale / np.maximum(np.abs(r), 1e-12))
        if np.allclose(new, huber, atol=1e-3):
            break
        huber = new
    sw = np.sqrt(w * huber)
    xs = x * sw[:, None]
    r = xs @ coef - sw
    model = CostModel(*(float(max(0.0, v)) for v in coef))
    return model, _standard_errors(xs, r, w * huber, coef)


def _standard_errors(xs: np.ndarray, resid: np.ndarray, weights: np.ndarray, coef: np.ndarray) -> Uncertainty:
    """Sandwich-free textbook errors ``s² (XᵀX)⁻¹`` of a weighted fit, with effective sample size."""
    # Columns the fit left at zero (on the non-negativity bound) still get an error from the full design.
    k = xs.shape[1]
    total = float(np.sum(weights))
    eff = total * total / float(np.sum(weights * weights)) if total > 0 else 0.0  # Kish's effective count
    dof = eff - k
    if dof <= 0:
        return Uncertainty(math.inf, math.inf, math.inf)
    s2 = float(np.sum(resid * resid)) / float(np.sum(weights)) * eff / dof
    norms = np.linalg.norm(xs, axis=0)
    if np.any(norms == 0):
        return Uncertainty(math.inf, math.inf, math.inf)
    xn = xs / norms  # the three columns differ by orders of magnitude: invert on unit columns
    info = (xn.T @ xn / total * eff).tolist()  # Fisher information scaled to the effective count
    diag = _inverse_diagonal(info)
    if diag is None:  # the points cannot tell the constants apart
        return Uncertainty(math.inf, math.inf, math.inf)
    se = [math.sqrt(max(0.0, s2 * d)) / float(nm) for d, nm in zip(diag, norms)]
    return Uncertainty(*(float(v) for v in se))


def _inverse_diagonal(m: list) -> list[float] | None:
    """The diagonal of the inverse of a symmetric 3x3 matrix, or None when it is (nearly) singular.

    By cofactors in plain Python: numpy's LAPACK call costs milliseconds for a 3x3 on a busy machine.
    """
    (a, b, c), (_, e, f), (_, _, i) = m
    cof = (e * i - f * f, a * i - c * c, a * e - b * b)
    det = a * cof[0] - b * (b * i - c * f) + c * (b * f - c * e)
    scale = max(abs(a), abs(e), abs(i), 1e-300) ** 3
    if not math.isfinite(det) or abs(det) <= 1e-12 * scale:
        return None
    return [x / det for x in cof]
