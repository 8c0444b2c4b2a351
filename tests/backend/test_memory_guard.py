"""Memory-aware groups on fakes: a group whose activations would not fit the free memory is split before launch."""

from __future__ import annotations

import numpy as np

from model_factory.backend.batching.executor import GroupedExecutor
from model_factory.backend.batching.grouping import CostModel
from model_factory.backend.memory.guard import MemoryGuard, guard_for

SEQ = frozenset({"input_ids", "attention_mask"})
BYTES_PER_TOKEN = 1000


class DeviceEngine:
    """A fake GPU engine: each launch needs BYTES_PER_TOKEN per computed token, out of ``free`` bytes.

    A launch over the free memory raises, as a real one would run out of memory; every launch is recorded.
    """

    input_names = ("input_ids", "attention_mask")
    output_names = ("embedding",)

    def __init__(self, free: int) -> None:
        self.free = free
        self.launches: list[tuple[int, int]] = []
        self.failed: list[tuple[int, int]] = []

    def activation_bytes(self, n: int, length: int, profile: int = 0) -> int:
        return BYTES_PER_TOKEN * n * length

    def free_device_bytes(self) -> int:
        return self.free

    def run(self, feeds, profile=0):
        n, length = feeds["input_ids"].shape
        if self.activation_bytes(n, length) > self.free:
            self.failed.append((n, length))
            raise MemoryError("CUDA out of memory")
        self.launches.append((n, length))
        return {"embedding": feeds["input_ids"].sum(axis=1, keepdims=True).astype(np.float32)}


def item(length: int, value: int = 1):
    return {"input_ids": np.full(length, value, np.int64), "attention_mask": np.ones(length, np.int64)}


def run(engine, guard, window):
    ex = GroupedExecutor(engine, CostModel(1.0, 1e-9, 0.0), max_batch=64, buckets=(32,), seq_inputs=SEQ,
                         seq_outputs=frozenset(), mode="pad_to_longest", memory_guard=guard)
    return ex.run(window)


def test_a_group_that_would_not_fit_is_split_before_launch() -> None:
    # 16 sequences x 32 tokens need 512 kB; 200 kB are free (90% usable): groups of 4 (128 kB) fit.
    engine = DeviceEngine(free=200_000)
    window = [[item(32, v)] for v in range(16)]
    results, stats = run(engine, guard_for(engine), window)
    assert engine.failed == []  # nothing was launched to fail
    assert engine.launches == [(4, 32)] * 4
    assert stats.memory_splits == 3 and stats.retries == 0  # 16 -> 8 + 8 -> 4 x 4
    assert [float(r["embedding"][0, 0]) for r in results] == [32.0 * v for v in range(16)]


def test_without_the_guard_the_same_window_fails_and_retries() -> None:
    engine = DeviceEngine(free=200_000)
    results, stats = run(engine, None, [[item(32, v)] for v in range(16)])
    assert engine.failed and stats.retries == 3 and stats.memory_splits == 0
    assert all(not isinstance(r, Exception) for r in results)


def test_a_group_that_fits_launches_whole_and_a_single_item_always_launches() -> None:
    engine = DeviceEngine(free=10_000_000)
    _, stats = run(engine, guard_for(engine), [[item(32)] for _ in range(16)])
    assert engine.launches == [(16, 32)] and stats.memory_splits == 0
    tight = DeviceEngine(free=1_000)  # not even one item fits: it is launched (and fails alone), never split
    results, stats = run(tight, guard_for(tight), [[item(32)]])
    assert stats.memory_splits == 0 and isinstance(results[0], Exception)


def test_unknown_estimates_launch() -> None:
    guard = MemoryGuard(free_bytes=lambda: 100, activation_bytes=lambda n, length, profile: None)
    assert guard.fits(64, 128)
    guard = MemoryGuard(free_bytes=lambda: None, activation_bytes=lambda n, length, profile: 10**12)
    assert guard.fits(64, 128)
    guard = MemoryGuard(free_bytes=lambda: 1000, activation_bytes=lambda n, length, profile: n * length, headroom=0.5)
    assert guard.fits(10, 50) and not guard.fits(10, 51)


def test_cpu_engines_get_no_guard() -> None:
    class CpuEngine:
        input_names = ("x",)
        output_names = ("y",)

    assert guard_for(CpuEngine()) is None


def test_the_metric_counts_memory_splits() -> None:
    from model_factory.backend.batching.executor import WindowStats
    from model_factory.backend.operations.metrics import _WINDOW_COUNTERS

    assert _WINDOW_COUNTERS["groups_split_for_memory_total"] == "memory_splits"
    assert WindowStats(memory_splits=2).memory_splits == 2
