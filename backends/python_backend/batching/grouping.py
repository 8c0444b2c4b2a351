"""Split a window of variable-length requests into padded groups, by a cost model.

A launch of ``n`` sequences padded to length ``L`` is modelled as::

    seconds = a + b * n * L + c * n * L * L

``a`` is the fixed cost of one launch (kernel launches, copies, Python), ``b`` the
cost per computed token (the linear layers) and ``c`` the cost per token per token
(attention). Padding is paid for in ``b`` and ``c``; a split is paid for in ``a``.
On a GPU running a small encoder ``a`` dominates and one padded group is best; on
a CPU the per-token terms dominate and splitting by length wins. The constants are
measured per engine at load time (:func:`measure_cost_model`), so the split follows
the hardware instead of a guess.

:func:`plan_groups` sorts the window by length and finds, by dynamic programming,
the split of the sorted order into contiguous groups with the least total modelled
cost, within a batch limit and a token (memory) budget. For a fixed set of
sequences in a group the padded length is its longest one, and an optimal
partition into groups can always be taken contiguous in sorted order, so the
search over contiguous splits is exact.

Pure Python and numpy: this module is copied into the Triton model folder and
runs inside the Python-backend stub.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

MODES = ("cost_model", "pad_to_longest", "none")


@dataclass(frozen=True)
class CostModel:
    """Seconds for one launch of ``n`` sequences padded to ``length`` tokens."""

    a: float
    b: float
    c: float

    def __post_init__(self) -> None:
        for name in ("a", "b", "c"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"cost model constant {name} must be finite and >= 0, got {value!r}")

    def cost(self, n: int, length: int) -> float:
        """Modelled seconds for one launch of ``n`` sequences padded to ``length``."""
        tokens = n * length
        return self.a + self.b * tokens + self.c * tokens * length


@dataclass(frozen=True)
class ProfileCostModel:
    """One :class:`CostModel` per engine optimization profile.

    A launch padded to ``length`` runs on the profile that covers ``length`` (the
    smallest bucket at least that long), so it costs what that profile's kernels
    cost: TensorRT tunes each profile for its own shapes, and one model fitted over
    all of them misprices the short ones.
    """

    buckets: tuple[int, ...]
    models: tuple[CostModel, ...]

    def __post_init__(self) -> None:
        if not self.buckets or len(self.buckets) != len(self.models):
            raise ValueError(f"need one cost model per bucket, got {len(self.models)} for buckets {self.buckets}")

    def for_length(self, length: int) -> CostModel:
        """The cost model of the profile that covers ``length``."""
        return self.models[profile_for_length(length, self.buckets)]

    def cost(self, n: int, length: int) -> float:
        """Modelled seconds for one launch of ``n`` sequences padded to ``length``."""
        return self.for_length(length).cost(n, length)


# --------------------------------------------------------------------------- fitting


def _nnls3(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of columns, exactly.

    The optimum of ``min |x w - y|, w >= 0`` is the plain least-squares solution on
    its own support, so trying every support (2^k of them, k = 3 here) and keeping
    the best feasible one finds it. Columns are scaled to unit norm first so the
    three terms, which differ by orders of magnitude, are solved equally well.
    """
    k = x.shape[1]
    norms = np.linalg.norm(x, axis=0)
    norms[norms == 0] = 1.0
    xs = x / norms
    # Usually the unconstrained optimum is already non-negative: then it is the answer.
    w_all, *_ = np.linalg.lstsq(xs, y, rcond=None)
    if np.all(w_all >= 0):
        return w_all / norms
    best_w = np.zeros(k)
    best_r = float(np.sum(y * y))
    for size in range(1, k + 1):
        for support in itertools.combinations(range(k), size):
            cols = list(support)
            w_sub, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
            if np.any(w_sub < 0):
                continue
            w = np.zeros(k)
            w[cols] = w_sub
            r = float(np.sum((xs @ w - y) ** 2))
            if r < best_r - 1e-15 * max(1.0, best_r):
                best_w, best_r = w, r
    return best_w / norms


def fit_cost_model(samples: Sequence[tuple[int, int, float]]) -> CostModel:
    """Fit ``a, b, c >= 0`` to timings ``(n, length, seconds)``.

    The fit minimises the *relative* error of each sample (each row is divided by
    its time), so the fast launches that decide whether to split weigh as much as
    the slow ones. With exact timings from a model of this form the constants are
    recovered exactly.
    """
    if not samples:
        raise ValueError("fit_cost_model needs at least one (n, length, seconds) sample")
    rows = []
    times = []
    for n, length, seconds in samples:
        if n < 1 or length < 1:
            raise ValueError(f"sample (n={n}, length={length}) must have n >= 1 and length >= 1")
        if not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"sample (n={n}, length={length}) has a bad time {seconds!r}: must be > 0")
        tokens = float(n) * float(length)
        rows.append((1.0, tokens, tokens * float(length)))
        times.append(float(seconds))
    x = np.asarray(rows, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    w = _nnls3(x / t[:, None], np.ones_like(t))
    return CostModel(a=float(w[0]), b=float(w[1]), c=float(w[2]))


# --------------------------------------------------------------------------- planning


def _check_limits(max_batch: int, max_tokens: int | None) -> None:
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")


def _fits(n: int, padded: int, max_batch: int, max_tokens: int | None) -> bool:
    return n <= max_batch and (max_tokens is None or n * padded <= max_tokens)


def plan_groups(
    lengths: Sequence[int],
    cost: CostModel | ProfileCostModel,
    max_batch: int,
    max_tokens: int | None = None,
    mode: str = "cost_model",
) -> list[list[int]]:
    """Split a window into groups of indices into ``lengths``; each index once.

    - ``cost_model``: the split of the length-sorted window with the least total
      ``cost.cost(len(group), longest in group)``, exact (dynamic programming,
      O(n * max_batch)).
    - ``pad_to_longest``: one group, split only where a limit forces it.
    - ``none``: one request per group, in the window's order.

    A group holds at most ``max_batch`` sequences and, when ``max_tokens`` is set,
    at most ``max_tokens`` padded tokens (``len(group) * longest``). A single
    sequence longer than ``max_tokens`` cannot be placed and raises ``ValueError``:
    check lengths against the engine's profiles before planning.

    Groups come shortest first; the indices inside a group are in ascending length
    (ties by index), so ``lengths[group[-1]]`` is the group's padded length.
    """
    if mode not in MODES:
        raise ValueError(f"grouping mode {mode!r} is not one of: {', '.join(MODES)}")
    _check_limits(max_batch, max_tokens)
    lens = [int(x) for x in lengths]
    for i, length in enumerate(lens):
        if length < 0:
            raise ValueError(f"length of request {i} is negative ({length})")
        if max_tokens is not None and length > max_tokens:
            raise ValueError(
                f"request {i} has {length} tokens, more than max_tokens={max_tokens}: "
                "it cannot fit in any group"
            )
    count = len(lens)
    if count == 0:
        return []
    if mode == "none":
        return [[i] for i in range(count)]

    order = sorted(range(count), key=lambda i: (lens[i], i))
    sorted_lens = [lens[i] for i in order]

    if mode == "pad_to_longest":
        groups: list[list[int]] = []
        start = 0
        for end in range(1, count + 1):
            # Extending [start, end) by the next one would break a limit: cut here.
            if end == count or not _fits(end + 1 - start, sorted_lens[end], max_batch, max_tokens):
                groups.append(order[start:end])
                start = end
        return groups

    # best[j]: least cost to run sorted[0:j]; cut[j]: start of the last group.
    best = [0.0] + [math.inf] * count
    cut = [0] * (count + 1)
    for j in range(1, count + 1):
        padded = sorted_lens[j - 1]
        # Every group ending at j is padded to the same length: look its profile's model up once.
        model = cost.for_length(padded) if isinstance(cost, ProfileCostModel) else cost
        lowest = max(0, j - max_batch)
        if max_tokens is not None and padded > 0:
            lowest = max(lowest, j - max_tokens // padded)
        for i in range(j - 1, lowest - 1, -1):
            total = best[i] + model.cost(j - i, padded)
            if total < best[j]:
                best[j] = total
                cut[j] = i
    groups = []
    j = count
    while j > 0:
        i = cut[j]
        groups.append(order[i:j])
        j = i
    groups.reverse()
    return groups


def plan_cost(groups: Sequence[Sequence[int]], lengths: Sequence[int], cost: CostModel | ProfileCostModel) -> float:
    """Total modelled seconds of running ``groups`` (each padded to its longest)."""
    return sum(cost.cost(len(g), max(lengths[i] for i in g)) for g in groups if g)


def token_counts(groups: Sequence[Sequence[int]], lengths: Sequence[int]) -> tuple[int, int]:
    """``(computed, real)`` tokens of ``groups``, each padded to its longest member."""
    computed = 0
    real = 0
    for g in groups:
        if not g:
            continue
        group_lens = [int(lengths[i]) for i in g]
        computed += len(group_lens) * max(group_lens)
        real += sum(group_lens)
    return computed, real


def padding_ratio(groups: Sequence[Sequence[int]], lengths: Sequence[int]) -> float:
    """Computed tokens over real tokens: 1.0 means no padding at all.

    Each group is padded to its longest member. With no real tokens (an empty
    window, or only empty sequences) nothing is wasted and the ratio is 1.0.
    """
    computed, real = token_counts(groups, lengths)
    return computed / real if real else 1.0


def pad_group(arrays: list[np.ndarray], pad_value, *, length: int | None = None) -> np.ndarray:
    """Stack arrays of shape ``(L_i, ...)`` into ``(n, L, ...)``, padding axis 0.

    ``L`` is the longest ``L_i``, or ``length`` when given (it must be at least the
    longest; use it to meet an engine profile's minimum). All arrays must share
    their trailing dimensions; the result takes the first array's dtype.
    """
    if not arrays:
        raise ValueError("pad_group needs at least one array")
    first = np.asarray(arrays[0])
    if first.ndim < 1:
        raise ValueError("pad_group needs arrays with a sequence axis (ndim >= 1)")
    tail = first.shape[1:]
    longest = 0
    for k, arr in enumerate(arrays):
        arr = np.asarray(arr)
        if arr.shape[1:] != tail:
            raise ValueError(
                f"array {k} has shape {arr.shape}; all arrays must end in {tail} after the sequence axis"
            )
        longest = max(longest, arr.shape[0])
    target = longest if length is None else int(length)
    if target < longest:
        raise ValueError(f"pad length {target} is shorter than the longest array ({longest})")
    out = np.full((len(arrays), target, *tail), pad_value, dtype=first.dtype)
    for k, arr in enumerate(arrays):
        arr = np.asarray(arr)
        out[k, : arr.shape[0]] = arr
    return out


def profile_for_length(length: int, buckets: Sequence[int]) -> int:
    """Index of the smallest bucket (profile maximum) that holds ``length``."""
    best = None
    for index, bucket in enumerate(buckets):
        if bucket >= length and (best is None or bucket < buckets[best]):
            best = index
    if best is None:
        largest = max(buckets) if len(buckets) else None
        raise ValueError(
            f"sequence length {length} exceeds the largest engine profile ({largest}); "
            "truncate the input or build the engine with a larger sequence bucket"
        )
    return best


# --------------------------------------------------------------------------- measuring


def sweep_points(
    buckets: Sequence[int], max_batch: int, max_tokens: int | None = None, sweep_batch: int = 16
) -> list[tuple[int, int]]:
    """The ``(n, length)`` points :func:`measure_cost_model` times.

    For each profile (bucket), three lengths inside its range (just above the
    previous bucket, the middle, the bucket itself) times three batch sizes
    (1, half, ``min(max_batch, sweep_batch)``), skipping points over ``max_tokens``.
    Points are grouped by profile, in bucket order. The cost is linear in ``n``, so
    timing batches beyond ``sweep_batch`` adds load time without telling more.
    """
    _check_limits(max_batch, max_tokens)
    if not buckets:
        raise ValueError("sweep_points needs at least one bucket")
    ordered = sorted(set(int(b) for b in buckets))
    if ordered[0] < 1:
        raise ValueError(f"buckets must be >= 1, got {ordered[0]}")
    top = max(1, min(max_batch, sweep_batch))
    batches = sorted({1, max(1, top // 2), top})
    points: list[tuple[int, int]] = []
    previous = 0
    for bucket in ordered:
        low = previous + 1 if previous else max(1, bucket // 4)
        lengths = sorted({low, (low + bucket) // 2, bucket})
        for length in lengths:
            for n in batches:
                if max_tokens is None or n * length <= max_tokens:
                    points.append((n, length))
        previous = bucket
    return points


def time_points(
    run: Callable[[int, int], None],
    points: Sequence[tuple[int, int]],
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> list[tuple[int, int, float]]:
    """Time ``run(n, length)`` at each point: one warm-up, then the fastest of ``repeats``.

    The fastest run is the engine's own cost; slower ones measured other processes on a
    shared machine (the benchmark saw the median's ``a`` swing 5x between loads).

    ``run`` must finish its work before it returns (copy outputs to the host, or
    synchronize the stream), or the times measure only the launch.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    samples = []
    for n, length in points:
        run(n, length)  # warm-up: first use of a shape builds kernels/caches
        times = []
        for _ in range(repeats):
            start = clock()
            run(n, length)
            times.append(clock() - start)
        samples.append((n, length, min(times)))
    return samples


def measure_cost_model(
    run: Callable[[int, int], None],
    buckets: Sequence[int],
    max_batch: int,
    repeats: int = 3,
    *,
    max_tokens: int | None = None,
    per_profile: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> CostModel | ProfileCostModel:
    """Time ``run`` over :func:`sweep_points` and fit the cost model.

    ``run(n, length)`` runs the engine on ``n`` dummy sequences of ``length`` tokens
    and returns once the outputs are on the host. With ``per_profile`` (an engine
    with one optimization profile per bucket, as TensorRT's), each profile's points
    are fitted on their own into a :class:`ProfileCostModel`; else one
    :class:`CostModel` is fitted over all points (an engine that takes any shape).
    """
    samples = time_points(run, sweep_points(buckets, max_batch, max_tokens), repeats, clock)
    return fit_samples(samples, buckets, per_profile)


def fit_samples(samples: Sequence[tuple[int, int, float]], buckets: Sequence[int], per_profile: bool = False
                ) -> CostModel | ProfileCostModel:
    """One :class:`CostModel` over all ``samples``, or with ``per_profile`` one per bucket's profile."""
    ordered = tuple(sorted(set(int(b) for b in buckets)))
    if not per_profile or len(ordered) < 2:
        return fit_cost_model(samples)
    by_profile: dict[int, list[tuple[int, int, float]]] = {}
    for sample in samples:
        by_profile.setdefault(profile_for_length(sample[1], ordered), []).append(sample)
    return ProfileCostModel(ordered, tuple(fit_cost_model(by_profile[i]) for i in range(len(ordered))))
