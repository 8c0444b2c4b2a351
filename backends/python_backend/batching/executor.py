"""Grouped execution of one window of requests.

Items (one sequence each) from all requests of the window are sorted by length
and split into groups by the cost model (``grouping.plan_groups``). Each group
is padded only to its own longest item, run on the engine with the profile that
covers its length, and its outputs are sliced back to each item. On a GPU, a group
whose activations would not fit the memory free now is split in halves before it
is launched (``memory_guard``). A group that
fails (out of memory included) is split in halves and retried, down to single
items; only the items that still fail get an error. The result is one entry
per request, in order: a dict of outputs or the exception for that request.

Items are first partitioned by shape: only items of one shape share a launch,
apart from the length of the sequence axis when the model may be padded (it
reads an attention mask). A fixed-shape model (an image CNN) thus runs plain
batches split at the max batch, and a model that must not be padded batches
only requests of equal length.

The split comes from an ``adaptive_planner.AdaptivePlanner``; every group that
runs is timed (padding, the launch and slicing its outputs: what a split costs)
and the timing goes back to the planner, whose estimator refits the cost model
when it learns (``cost_estimator``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .adaptive_planner import AdaptivePlanner, PlanReport
from .cost_estimator import CostEstimator
from .grouping import CostModel, ProfileCostModel, profile_for_length, token_counts
from ..memory.guard import MemoryGuard
from ..requests.items import Item

Engine = object  # anything with input_names, output_names and run(feeds, profile)


@dataclass
class WindowStats:
    """What one execute() did, for the metrics (counted as planned; retries re-run the same tokens)."""

    groups: list[int] = field(default_factory=list)  # items per group
    real_tokens: int = 0
    computed_tokens: int = 0  # each group padded to its longest item
    retries: int = 0
    memory_splits: int = 0  # groups split before launch: their activations would not fit the free memory
    # The cost model's side (see adaptive_planner and cost_estimator).
    plan: PlanReport = field(default_factory=PlanReport)
    timings: int = 0  # launches timed and fed back to the estimator
    outliers: int = 0  # of those, timings far (> 3x) from their cell's median
    refits: int = 0
    plan_changes: int = 0
    # With span recording on (tracing.py): ("group" | "engine_run", start_ns, end_ns, request indices, attributes).
    spans: list = field(default_factory=list)

    @property
    def explorations(self) -> int:
        """1 when this window ran a split it had not timed (exploration), else 0."""
        return int(self.plan.explored)

    @property
    def sequences(self) -> int:
        """Items run in this window."""
        return sum(self.groups)

    @property
    def group_count(self) -> int:
        """Engine launches planned for this window."""
        return len(self.groups)

    @property
    def padding_ratio(self) -> float:
        """Computed over real tokens (1.0 for an empty window)."""
        return self.computed_tokens / self.real_tokens if self.real_tokens else 1.0


class GroupError(RuntimeError):
    """An item could not be run even alone."""


def pad_items(items: Sequence[Item], names: Sequence[str], seq_names: frozenset[str], length: int) -> dict[str, np.ndarray]:
    """Stack items into one batch, padding sequence inputs with zeros up to ``length``."""
    feeds = {}
    for name in names:
        first = items[0][name]
        if name in seq_names:
            out = np.zeros((len(items), length) + first.shape[1:], dtype=first.dtype)
            for i, it in enumerate(items):
                out[i, : it[name].shape[0]] = it[name]
        else:
            out = np.stack([it[name] for it in items])
        feeds[name] = out
    return feeds


class GroupedExecutor:
    """Plans and runs groups for a window of requests on one engine."""

    def __init__(self, engine: Engine, cost: CostModel | ProfileCostModel | CostEstimator, *, max_batch: int,
                 buckets: Sequence[int], seq_inputs: frozenset[str], seq_outputs: frozenset[str],
                 mode: str = "cost_model", max_tokens: int | None = None,
                 fill: Callable[[Item], Item] | None = None, pad_sequences: bool = True,
                 memory_guard: MemoryGuard | None = None) -> None:
        self.engine = engine
        self.planner = AdaptivePlanner(cost, max_batch=max_batch, max_tokens=max_tokens, mode=mode)
        self.estimator = self.planner.estimator  # None with fixed constants
        self.buckets = tuple(buckets)
        self.seq_inputs = seq_inputs
        self.seq_outputs = seq_outputs
        self.mode = mode
        self.fill = fill or (lambda item: item)
        self.pad_sequences = pad_sequences
        self.memory_guard = memory_guard
        self.record_spans = False  # set when the backend traces (tracing.py): the window's phases, timed

    def _partitions(self, flat: Sequence[tuple[int, Item]]) -> dict[tuple, list[int]]:
        """Items that may share a launch, by shape: equal shapes, apart from the sequence axis when padding.

        A fixed-shape model (an image CNN) has one partition, run as plain batches split at the max batch;
        a model with other dynamic axes, or one that must not be padded, batches only equal shapes.
        """
        parts: dict[tuple, list[int]] = {}
        for i, (_, item) in enumerate(flat):
            key = tuple((name, item[name].shape[1:] if self.pad_sequences and name in self.seq_inputs
                         else item[name].shape) for name in sorted(item))
            parts.setdefault(key, []).append(i)
        return parts

    @property
    def cost(self) -> CostModel | ProfileCostModel:
        """The cost model the next window is planned with (it changes as the estimator learns)."""
        return self.planner.model

    def _length(self, item: Item) -> int:
        for name in self.seq_inputs:
            if name in item:
                return int(item[name].shape[0])
        return 1

    def run(self, requests: Sequence[Sequence[Item]], wanted: Sequence[Sequence[str]] | None = None
            ) -> tuple[list[dict[str, np.ndarray] | Exception], WindowStats]:
        """Run every item of every request; return per-request outputs (or the error) and stats."""
        flat: list[tuple[int, Item]] = [(r, self.fill(it)) for r, items in enumerate(requests) for it in items]
        stats = WindowStats()
        lengths = [self._length(it) for _, it in flat]
        groups = []
        # Within a partition every item has the same shape apart (when padding is allowed) from its length.
        # Without padding (a fixed-shape model, or one that must not be padded) they are plain batches.
        padded = self.pad_sequences and bool(self.seq_inputs)
        mode = self.mode if padded or self.mode == "none" else "pad_to_longest"
        reports = []
        plan_start = time.time_ns() if self.record_spans else 0
        for members in self._partitions(flat).values():
            planned, report = self.planner.plan([lengths[i] for i in members], mode)
            reports.append(report)
            groups.extend([members[k] for k in g] for g in planned)
        stats.plan = PlanReport.total(reports)
        if self.record_spans:
            stats.spans.append(("group", plan_start, time.time_ns(), sorted({r for r, _ in flat}),
                                {"groups": len(groups), "sequences": len(flat)}))
        stats.groups = [len(g) for g in groups]
        stats.computed_tokens, stats.real_tokens = token_counts(groups, lengths)
        per_item: list[dict[str, np.ndarray] | Exception | None] = [None] * len(flat)
        est = self.estimator
        before = (est.stats.timings, est.stats.outliers, est.stats.refits, self.planner.plan_changes) if est else None
        for group in groups:
            self._run_group(group, flat, lengths, per_item, stats)
        if est is not None:
            after = (est.stats.timings, est.stats.outliers, est.stats.refits, self.planner.plan_changes)
            stats.timings, stats.outliers, stats.refits, stats.plan_changes = (x - y for x, y in zip(after, before))
        return self._assemble(requests, flat, per_item, wanted), stats

    def _run_group(self, group: list[int], flat, lengths, per_item, stats: WindowStats) -> None:
        length = max(lengths[i] for i in group)
        if len(group) > 1 and self.memory_guard is not None:
            try:
                fits = self.memory_guard.fits(len(group), length, profile_for_length(length, self.buckets))
            except Exception:  # noqa: BLE001 - an estimate that fails must not fail the group: launch it
                fits = True
            if not fits:  # split first, instead of failing on the device and retrying
                stats.memory_splits += 1
                half = len(group) // 2
                self._run_group(group[:half], flat, lengths, per_item, stats)
                self._run_group(group[half:], flat, lengths, per_item, stats)
                return
        start = time.perf_counter()
        start_ns = time.time_ns() if self.record_spans else 0
        try:
            profile = profile_for_length(length, self.buckets)
            feeds = pad_items([flat[i][1] for i in group], self.engine.input_names, self.seq_inputs, length)
            outs = self.engine.run(feeds, profile)
        except Exception as exc:  # the engine may raise anything (ORT, TensorRT, CUDA OOM)
            if len(group) == 1:
                per_item[group[0]] = GroupError(f"inference failed: {type(exc).__name__}: {exc}")
                return
            # Smaller groups need less memory and isolate a poisoned item.
            stats.retries += 1
            half = len(group) // 2
            self._run_group(group[:half], flat, lengths, per_item, stats)
            self._run_group(group[half:], flat, lengths, per_item, stats)
            return
        if self.record_spans:
            stats.spans.append(("engine_run", start_ns, time.time_ns(), sorted({flat[i][0] for i in group}),
                                {"sequences": len(group), "padded_length": length, "profile": profile}))
        for row, i in enumerate(group):
            # Only a padded item's sequence outputs are cut back to its own length.
            per_item[i] = {name: (val[row, : lengths[i]] if name in self.seq_outputs and lengths[i] < length
                                  else val[row])
                           for name, val in outs.items()}
        # A run on borrowed cores (idle_cores) is faster than the loaded case the cost model plans for.
        if self.estimator is not None and not getattr(self.engine, "last_run_borrowed", False):
            self.planner.observe(len(group), max(1, length), time.perf_counter() - start)

    def _assemble(self, requests, flat, per_item, wanted) -> list[dict[str, np.ndarray] | Exception]:
        results: list[dict[str, np.ndarray] | Exception] = []
        pos = 0
        for r, items in enumerate(requests):
            chunk = per_item[pos: pos + len(items)]
            pos += len(items)
            if not chunk:  # the request was refused before execution (validation); the caller answers it
                results.append(ValueError("request has no valid items"))
                continue
            err = next((c for c in chunk if isinstance(c, Exception)), None)
            if err is not None:
                results.append(err)
                continue
            names = list(wanted[r]) if wanted and wanted[r] else list(chunk[0].keys())
            out = {}
            for name in names:
                parts = [c[name] for c in chunk]
                if name in self.seq_outputs and len({p.shape[0] for p in parts}) > 1:
                    width = max(p.shape[0] for p in parts)
                    buf = np.zeros((len(parts), width) + parts[0].shape[1:], dtype=parts[0].dtype)
                    for i, p in enumerate(parts):
                        buf[i, : p.shape[0]] = p
                    out[name] = buf
                else:
                    out[name] = np.ascontiguousarray(np.stack(parts))
            results.append(out)
        return results
