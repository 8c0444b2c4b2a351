"""Grouped execution on a fake engine: order, slicing, padding only per group, split-and-retry."""

from __future__ import annotations

import numpy as np

from model_factory.backend.batching.executor import GroupedExecutor, pad_items
from model_factory.backend.batching.grouping import CostModel

SEQ = frozenset({"input_ids", "attention_mask"})


class SumEngine:
    """Hidden state = the id times the mask, embedding = sum over the sequence; records launches."""

    input_names = ("input_ids", "attention_mask")
    output_names = ("last_hidden_state", "embedding")

    def __init__(self, fail_over: int | None = None, poison: int | None = None) -> None:
        self.launches: list[tuple[int, int, int]] = []
        self.fail_over = fail_over
        self.poison = poison

    def run(self, feeds, profile=0):
        ids, mask = feeds["input_ids"], feeds["attention_mask"]
        if self.fail_over is not None and ids.shape[0] > self.fail_over:
            raise MemoryError("out of memory")
        if self.poison is not None and (ids == self.poison).any():
            raise RuntimeError("poisoned")
        self.launches.append((ids.shape[0], ids.shape[1], profile))
        hidden = (ids * mask).astype(np.float32)[..., None].repeat(2, axis=-1)
        return {"last_hidden_state": hidden, "embedding": hidden.sum(axis=1)}


def item(length: int, value: int = 1):
    return {"input_ids": np.full(length, value, np.int64), "attention_mask": np.ones(length, np.int64)}


def executor(engine, cost=CostModel(0.0, 1.0, 0.0), max_batch=8, mode="cost_model"):
    return GroupedExecutor(engine, cost, max_batch=max_batch, buckets=(8, 32), seq_inputs=SEQ,
                           seq_outputs=frozenset({"last_hidden_state"}), mode=mode)


def test_outputs_per_request_in_order_and_sliced() -> None:
    engine = SumEngine()
    reqs = [[item(3, 1)], [item(30, 2), item(30, 3)], [item(5, 4)]]
    results, stats = executor(engine).run(reqs)
    assert [r["last_hidden_state"].shape for r in results] == [(1, 3, 2), (2, 30, 2), (1, 5, 2)]
    np.testing.assert_array_equal(results[1]["embedding"], [[60, 60], [90, 90]])
    np.testing.assert_array_equal(results[2]["embedding"], [[20, 20]])
    # Padding is expensive in this cost model: short and long items never share a launch.
    assert all(length in (3, 5, 30) for _, length, _ in engine.launches)
    assert stats.padding_ratio < 1.1
    assert {p for _, L, p in engine.launches if L == 30} == {1} and {p for _, L, p in engine.launches if L < 8} == {0}


def test_expensive_launches_pad_to_one_group() -> None:
    engine = SumEngine()
    results, stats = executor(engine, cost=CostModel(1.0, 1e-6, 0.0)).run([[item(3)], [item(30)], [item(5)]])
    assert engine.launches == [(3, 30, 1)] and stats.groups == [3]
    assert results[0]["last_hidden_state"].shape == (1, 3, 2)


def test_requested_outputs_only() -> None:
    results, _ = executor(SumEngine()).run([[item(4)]], wanted=[("embedding",)])
    assert list(results[0]) == ["embedding"]


def test_oom_splits_and_retries() -> None:
    engine = SumEngine(fail_over=2)
    reqs = [[item(4, v)] for v in range(1, 7)]
    results, stats = executor(engine, cost=CostModel(1.0, 0.0, 0.0)).run(reqs)
    assert all(isinstance(r, dict) for r in results) and stats.retries >= 1
    assert max(n for n, _, _ in engine.launches) <= 2


def test_poisoned_item_fails_alone() -> None:
    engine = SumEngine(poison=9)
    results, _ = executor(engine, cost=CostModel(1.0, 0.0, 0.0)).run([[item(4, 1)], [item(4, 9)], [item(4, 2)]])
    assert isinstance(results[1], Exception) and "poisoned" in str(results[1])
    assert isinstance(results[0], dict) and isinstance(results[2], dict)


def test_requests_with_rows_of_different_lengths_are_padded_in_the_response() -> None:
    results, _ = executor(SumEngine()).run([[item(3), item(6)]])
    assert results[0]["last_hidden_state"].shape == (2, 6, 2)
    assert (results[0]["last_hidden_state"][0, 3:] == 0).all()


def test_pad_items_pads_only_sequence_inputs() -> None:
    feeds = pad_items([item(2), item(4)], ("input_ids", "attention_mask"), SEQ, 4)
    assert feeds["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


def test_window_of_only_refused_requests_still_answers_each() -> None:
    results, stats = executor(SumEngine()).run([[], [item(3)], []])
    assert len(results) == 3 and isinstance(results[0], Exception) and isinstance(results[1], dict)
    results, _ = executor(SumEngine()).run([[]])
    assert len(results) == 1 and isinstance(results[0], Exception)


class ImageEngine:
    """A fixed-shape model: one score per image (the sum of its pixels); records launch batch sizes."""

    input_names = ("pixels",)
    output_names = ("logits",)

    def __init__(self) -> None:
        self.launches: list[tuple[int, ...]] = []

    def run(self, feeds, profile=0):
        x = feeds["pixels"]
        self.launches.append(x.shape)
        return {"logits": x.reshape(x.shape[0], -1).sum(axis=1, keepdims=True).astype(np.float32)}


def test_fixed_shape_inputs_run_as_plain_batches_split_at_max_batch() -> None:
    engine = ImageEngine()
    ex = GroupedExecutor(engine, CostModel(0.0, 1.0, 0.0), max_batch=4, buckets=(8,), seq_inputs=frozenset(),
                         seq_outputs=frozenset())
    reqs = [[{"pixels": np.full((3, 2, 2), r, np.float32)} for _ in range(n)] for r, n in enumerate((3, 2, 1))]
    results, stats = ex.run(reqs)
    assert sorted(s[0] for s in engine.launches) == [2, 4] and all(s[1:] == (3, 2, 2) for s in engine.launches)
    assert [r["logits"].shape for r in results] == [(3, 1), (2, 1), (1, 1)]
    np.testing.assert_array_equal(results[1]["logits"], [[12.0], [12.0]])
    assert stats.padding_ratio == 1.0


class RunningSumEngine:
    """No mask: each position's output is the sum of the sequence so far, so padding would change nothing
    here, but ``total`` (the sum of the whole row) would; records launch shapes."""

    input_names = ("a", "b")
    output_names = ("y", "total")

    def __init__(self) -> None:
        self.launches: list[tuple[int, ...]] = []

    def run(self, feeds, profile=0):
        a, b = feeds["a"], feeds["b"]
        self.launches.append(a.shape)
        return {"y": np.cumsum(a, axis=1) + b[:, None, :], "total": a.sum(axis=1)}


def test_unpaddable_model_batches_equal_lengths_only_and_returns_exact_outputs() -> None:
    engine = RunningSumEngine()
    ex = GroupedExecutor(engine, CostModel(1.0, 0.0, 0.0), max_batch=8, buckets=(16,), seq_inputs=frozenset({"a"}),
                         seq_outputs=frozenset({"y"}), pad_sequences=False)

    def req(length, value):
        return [{"a": np.full((length, 2), value, np.float32), "b": np.zeros(2, np.float32)}]

    results, _ = ex.run([req(3, 1.0), req(5, 1.0), req(3, 2.0)])
    # Launches are free of cost here, yet lengths 3 and 5 never share one: the model must not be padded.
    assert sorted(engine.launches) == [(1, 5, 2), (2, 3, 2)]
    np.testing.assert_array_equal(results[0]["total"], [[3.0, 3.0]])
    np.testing.assert_array_equal(results[1]["total"], [[5.0, 5.0]])
    assert results[1]["y"].shape == (1, 5, 2) and results[2]["y"][0, -1, 0] == 6.0


def test_other_dynamic_axes_batch_only_equal_shapes() -> None:
    engine = ImageEngine()
    ex = GroupedExecutor(engine, CostModel(1.0, 0.0, 0.0), max_batch=8, buckets=(64,), seq_inputs=frozenset(),
                         seq_outputs=frozenset())
    reqs = [[{"pixels": np.ones((3, h, h), np.float32)}] for h in (8, 16, 8)]
    results, _ = ex.run(reqs)
    assert sorted(engine.launches) == [(1, 3, 16, 16), (2, 3, 8, 8)]
    assert [float(r["logits"][0, 0]) for r in results] == [192.0, 768.0, 192.0]


def test_every_launch_is_timed_and_fed_back_to_a_learning_cost_model() -> None:
    from model_factory.backend.batching.cost_estimator import CostEstimator

    engine = SumEngine()
    est = CostEstimator((8, 32), CostModel(1.0, 1e-6, 0.0))
    ex = executor(engine, cost=est)
    assert ex.estimator is est and ex.cost == est.model
    total = 0
    for k in range(40):
        _, stats = ex.run([[item(3 + k % 5)], [item(30)], [item(5)]])
        assert stats.timings == len(engine.launches) - total == stats.group_count
        total = len(engine.launches)
        assert stats.plan.chosen > 0 and stats.plan.singles > 0 and stats.plan.one_group > 0
    assert est.stats.timings == total and est.stats.refits >= 1
    assert ex.cost == est.model  # the planner plans with what the estimator learned


def test_fixed_constants_are_not_timed() -> None:
    ex = executor(SumEngine())
    _, stats = ex.run([[item(3)], [item(30)]])
    assert ex.estimator is None and stats.timings == 0 and stats.plan.chosen > 0


def test_runs_on_borrowed_cores_do_not_teach_the_cost_model() -> None:
    """A run on every core (idle_cores) is faster than the loaded case the planner prices: not a timing."""
    from model_factory.backend.batching.cost_estimator import CostEstimator

    class Borrowing(SumEngine):
        last_run_borrowed = True

    est = CostEstimator((8, 32), CostModel(1.0, 1e-6, 0.0))
    engine = Borrowing()
    _, stats = executor(engine, cost=est).run([[item(3)], [item(30)]])
    assert engine.launches and stats.timings == 0 and est.stats.timings == 0
    plain = SumEngine()
    _, stats = executor(plain, cost=CostEstimator((8, 32), CostModel(1.0, 1e-6, 0.0))).run([[item(3)], [item(30)]])
    assert stats.timings == len(plain.launches) > 0
