"""The cost model, its fit, and the exact split (checked against brute force)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from model_factory.backend.batching.grouping import (
    ProfileCostModel,
    CostModel,
    fit_cost_model,
    measure_cost_model,
    pad_group,
    padding_ratio,
    plan_cost,
    plan_groups,
    profile_for_length,
    sweep_points,
    time_points,
)

# Launch-bound: from the H200 numbers in docs/environment.md (MiniLM-shaped BERT, torch fp16):
# batch-1 ran 0.35k seq/s (~2.8 ms a launch, almost all fixed cost) and a window of 64
# padded to its longest 16.3k seq/s (~3.9 ms for 64 sequences of up to 128 tokens).
GPU_LIKE = CostModel(a=2.8e-3, b=1.3e-7, c=0.0)
# Measured on this project's 2-core CPU machine with grouping.measure-style sweeps:
# all-MiniLM-L6-v2 in torch, 1 thread, profiles (32, 128), max_batch 16; fit gave
# a = 15 ms, b = 0.43 ms per token, c = 0 (see the issue-5 report).
CPU_MEASURED = CostModel(a=1.5e-2, b=4.3e-4, c=0.0)


def _window(seed: int, count: int = 64) -> list[int]:
    """Mixed traffic: short queries and long passages."""
    rng = random.Random(seed)
    return [rng.randint(6, 20) if rng.random() < 0.6 else rng.randint(60, 128) for _ in range(count)]


def _brute_force_best(lengths, cost, max_batch, max_tokens):
    """Least cost over every contiguous split of the sorted order (2^(n-1) of them)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    n = len(order)
    best = float("inf")
    for mask in range(1 << (n - 1)):
        cuts = [0] + [k + 1 for k in range(n - 1) if mask >> k & 1] + [n]
        groups = [order[a:b] for a, b in zip(cuts, cuts[1:])]
        if any(
            len(g) > max_batch or (max_tokens is not None and len(g) * max(lengths[i] for i in g) > max_tokens)
            for g in groups
        ):
            continue
        best = min(best, plan_cost(groups, lengths, cost))
    return best


def _brute_force_any_partition(lengths, cost, max_batch):
    """Least cost over *every* set partition (not only contiguous): tiny n only."""
    n = len(lengths)
    best = float("inf")

    def partitions(items):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for part in partitions(rest):
            for k in range(len(part)):
                yield part[:k] + [[first] + part[k]] + part[k + 1 :]
            yield [[first]] + part

    for part in partitions(list(range(n))):
        if all(len(g) <= max_batch for g in part):
            best = min(best, plan_cost(part, lengths, cost))
    return best


def _assert_partition(groups, count):
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(count)), "every index exactly once"
    assert all(g for g in groups), "no empty groups"


# --------------------------------------------------------------------------- cost model


def test_cost_formula():
    cm = CostModel(a=1.0, b=2.0, c=3.0)
    assert cm.cost(4, 10) == pytest.approx(1.0 + 2.0 * 40 + 3.0 * 400)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_cost_model_rejects_bad_constants(bad):
    with pytest.raises(ValueError, match="constant"):
        CostModel(a=bad, b=0.0, c=0.0)


# --------------------------------------------------------------------------- fit


@pytest.mark.parametrize(
    "truth",
    [CostModel(2.8e-3, 1.3e-7, 2e-10), CostModel(1.5e-2, 4.3e-4, 0.0), CostModel(0.0, 1e-6, 1e-9)],
)
def test_fit_recovers_known_constants(truth):
    samples = [(n, length, truth.cost(n, length)) for n, length in sweep_points([32, 128], 32)]
    fitted = fit_cost_model(samples)
    for name in "abc":
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-15)


def test_fit_with_noise_stays_close_and_non_negative():
    truth = CostModel(2e-3, 5e-7, 1e-9)
    rng = np.random.default_rng(0)
    samples = [
        (n, length, truth.cost(n, length) * float(rng.uniform(0.97, 1.03)))
        for n, length in sweep_points([32, 128, 512], 64)
    ]
    fitted = fit_cost_model(samples)
    assert min(fitted.a, fitted.b, fitted.c) >= 0
    for n, length, _ in samples:
        assert fitted.cost(n, length) == pytest.approx(truth.cost(n, length), rel=0.1)


def test_fit_clamps_a_negative_intercept_to_zero():
    # Times proportional to tokens minus a constant: unconstrained LS gives a < 0.
    samples = [(n, length, 1e-5 * n * length - 1e-6) for n in (1, 4, 16) for length in (8, 64, 128)]
    fitted = fit_cost_model(samples)
    assert fitted.a == 0.0
    assert fitted.b > 0


def test_fit_rejects_bad_samples():
    with pytest.raises(ValueError, match="at least one"):
        fit_cost_model([])
    with pytest.raises(ValueError, match="bad time"):
        fit_cost_model([(1, 8, 0.0)])
    with pytest.raises(ValueError, match="n >= 1"):
        fit_cost_model([(0, 8, 1.0)])


# --------------------------------------------------------------------------- planning: exactness


@pytest.mark.parametrize("seed", range(40))
def test_dp_matches_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 11)
    lengths = [rng.randint(1, 128) for _ in range(n)]
    cost = CostModel(a=rng.choice([0.0, 1e-4, 1e-3, 3e-3]), b=rng.choice([0.0, 1e-7, 1e-5]), c=rng.choice([0.0, 1e-9]))
    max_batch = rng.randint(1, n + 1)
    max_tokens = rng.choice([None, max(lengths) * rng.randint(1, 4)])
    groups = plan_groups(lengths, cost, max_batch, max_tokens)
    _assert_partition(groups, n)
    assert plan_cost(groups, lengths, cost) == pytest.approx(
        _brute_force_best(lengths, cost, max_batch, max_tokens), rel=1e-12, abs=1e-15
    )


@pytest.mark.parametrize("seed", range(10))
def test_contiguous_splits_are_enough(seed):
    """The DP searches contiguous splits only; no set partition does better."""
    rng = random.Random(1000 + seed)
    lengths = [rng.randint(1, 64) for _ in range(rng.randint(1, 7))]
    cost = CostModel(a=rng.choice([1e-4, 1e-3]), b=1e-6, c=rng.choice([0.0, 1e-8]))
    max_batch = rng.randint(1, len(lengths))
    groups = plan_groups(lengths, cost, max_batch)
    assert plan_cost(groups, lengths, cost) == pytest.approx(
        _brute_force_any_partition(lengths, cost, max_batch), rel=1e-12
    )


# --------------------------------------------------------------------------- planning: limits and modes


@pytest.mark.parametrize("mode", ["cost_model", "pad_to_longest", "none"])
@pytest.mark.parametrize("seed", range(5))
def test_limits_respected_and_every_index_once(mode, seed):
    lengths = _window(seed, 200)
    max_batch, max_tokens = 16, 1024
    groups = plan_groups(lengths, GPU_LIKE, max_batch, max_tokens, mode=mode)
    _assert_partition(groups, len(lengths))
    for g in groups:
        assert len(g) <= max_batch
        assert len(g) * max(lengths[i] for i in g) <= max_tokens


def test_groups_sorted_by_length_inside_and_across():
    lengths = _window(3, 50)
    groups = plan_groups(lengths, CPU_MEASURED, 8)
    flat = [lengths[i] for g in groups for i in g]
    assert flat == sorted(flat)


def test_pad_to_longest_is_one_group_unless_a_limit_cuts():
    lengths = [5, 9, 100, 7]
    assert plan_groups(lengths, CPU_MEASURED, 32, mode="pad_to_longest") == [[0, 3, 1, 2]]
    # max_tokens 200: [5,7,9] fits (27 tokens) but adding 100 would need 400.
    assert plan_groups(lengths, CPU_MEASURED, 32, 200, mode="pad_to_longest") == [[0, 3, 1], [2]]
    assert plan_groups(lengths, CPU_MEASURED, 2, mode="pad_to_longest") == [[0, 3], [1, 2]]


def test_mode_none_is_one_request_per_group_in_order():
    assert plan_groups([30, 4, 12], GPU_LIKE, 8, mode="none") == [[0], [1], [2]]


def test_empty_window_and_bad_arguments():
    assert plan_groups([], GPU_LIKE, 8) == []
    with pytest.raises(ValueError, match="mode"):
        plan_groups([1], GPU_LIKE, 8, mode="buckets")
    with pytest.raises(ValueError, match="max_batch"):
        plan_groups([1], GPU_LIKE, 0)
    with pytest.raises(ValueError, match="cannot fit"):
        plan_groups([10, 300], GPU_LIKE, 8, max_tokens=256)
    with pytest.raises(ValueError, match="negative"):
        plan_groups([-1], GPU_LIKE, 8)


# --------------------------------------------------------------------------- the claim in issue 5


@pytest.mark.parametrize("seed", range(5))
def test_launch_bound_model_pads_everything_into_one_group(seed):
    lengths = _window(seed)
    groups = plan_groups(lengths, GPU_LIKE, max_batch=64)
    assert len(groups) == 1
    assert padding_ratio(groups, lengths) > 1.5  # a lot of padding, and still the cheapest


@pytest.mark.parametrize("seed", range(5))
def test_padding_bound_model_splits_by_length(seed):
    lengths = _window(seed)
    groups = plan_groups(lengths, CPU_MEASURED, max_batch=64)
    one = plan_groups(lengths, CPU_MEASURED, max_batch=64, mode="pad_to_longest")
    single = plan_groups(lengths, CPU_MEASURED, max_batch=64, mode="none")
    assert len(groups) > 1
    assert padding_ratio(groups, lengths) < padding_ratio(one, lengths)
    # Cheaper, by the model, than both fixed strategies.
    assert plan_cost(groups, lengths, CPU_MEASURED) < plan_cost(one, lengths, CPU_MEASURED)
    assert plan_cost(groups, lengths, CPU_MEASURED) < plan_cost(single, lengths, CPU_MEASURED)


# --------------------------------------------------------------------------- padding helpers


def test_padding_ratio_math():
    lengths = [2, 4, 10, 10]
    assert padding_ratio([[0, 1], [2, 3]], lengths) == pytest.approx((2 * 4 + 2 * 10) / 26)
    assert padding_ratio([[0, 1, 2, 3]], lengths) == pytest.approx(40 / 26)
    assert padding_ratio([[0], [1], [2], [3]], lengths) == 1.0
    assert padding_ratio([], []) == 1.0


def test_pad_group_pads_the_sequence_axis():
    out = pad_group([np.array([1, 2, 3]), np.array([4])], pad_value=0)
    np.testing.assert_array_equal(out, [[1, 2, 3], [4, 0, 0]])
    assert out.dtype == np.array([1]).dtype
    wide = pad_group([np.ones((2, 3), np.float32), np.ones((1, 3), np.float32)], -1.0, length=4)
    assert wide.shape == (2, 4, 3) and wide.dtype == np.float32
    assert (wide[1, 1:] == -1).all() and (wide[0, :2] == 1).all()


def test_pad_group_errors():
    with pytest.raises(ValueError, match="at least one"):
        pad_group([], 0)
    with pytest.raises(ValueError, match="must end in"):
        pad_group([np.ones((2, 3)), np.ones((2, 4))], 0)
    with pytest.raises(ValueError, match="shorter than the longest"):
        pad_group([np.ones(5)], 0, length=3)


def test_profile_for_length():
    buckets = [32, 128]
    assert profile_for_length(1, buckets) == 0
    assert profile_for_length(32, buckets) == 0
    assert profile_for_length(33, buckets) == 1
    assert profile_for_length(128, buckets) == 1
    assert profile_for_length(40, [128, 64]) == 1  # smallest bucket that fits, by index
    with pytest.raises(ValueError, match="exceeds the largest engine profile \\(128\\)"):
        profile_for_length(129, buckets)


# --------------------------------------------------------------------------- measuring


def test_sweep_points_cover_each_profile_and_respect_budget():
    points = sweep_points([32, 128], max_batch=32, max_tokens=2048)
    assert {profile_for_length(length, [32, 128]) for _, length in points} == {0, 1}
    assert all(n * length <= 2048 for n, length in points)
    assert {n for n, _ in points} == {1, 8, 16}  # capped at sweep_batch=16: cost is linear in n
    assert len({length for _, length in points}) >= 4  # enough lengths to separate b from c
    assert {n for n, _ in sweep_points([32, 128], max_batch=32, sweep_batch=64)} == {1, 16, 32}


def test_time_points_warms_up_and_takes_the_fastest():
    calls = []
    ticks = iter([0.0, 3.0, 3.0, 4.0, 4.0, 6.0])  # durations 3, 1, 2 -> fastest 1

    def run(n, length):
        calls.append((n, length))

    samples = time_points(run, [(2, 8)], repeats=3, clock=lambda: next(ticks))
    assert calls == [(2, 8)] * 4  # one warm-up + three timed
    assert samples == [(2, 8, 1.0)]


def test_measure_cost_model_recovers_a_simulated_engine():
    """A fake engine advances a fake clock by the true cost: the sweep + fit find it."""
    truth = CostModel(a=3e-3, b=2e-7, c=1e-9)
    clock = [0.0]
    seen = []

    def run(n, length):
        seen.append((n, length))
        clock[0] += truth.cost(n, length)

    fitted = measure_cost_model(run, [32, 128], max_batch=16, repeats=2, clock=lambda: clock[0])
    points = sweep_points([32, 128], 16)
    assert seen == [p for p in points for _ in range(3)]  # warm-up + 2 timed, per point
    assert fitted.a == pytest.approx(truth.a, rel=1e-6)
    assert fitted.b == pytest.approx(truth.b, rel=1e-6)
    assert fitted.c == pytest.approx(truth.c, rel=1e-6)


def test_measure_per_profile_fits_each_profile_on_its_own_points():
    """Two profiles with different kernels: one model each, recovered exactly; one model over both cannot."""
    short, long_ = CostModel(a=1e-3, b=1e-7, c=0.0), CostModel(a=4e-3, b=3e-7, c=2e-9)
    truth = ProfileCostModel((32, 128), (short, long_))
    clock = [0.0]

    def run(n, length):
        clock[0] += truth.cost(n, length)

    fitted = measure_cost_model(run, [32, 128], max_batch=16, repeats=1, per_profile=True, clock=lambda: clock[0])
    assert isinstance(fitted, ProfileCostModel) and fitted.buckets == (32, 128)
    for got, want in zip(fitted.models, (short, long_)):
        assert (got.a, got.b, got.c) == pytest.approx((want.a, want.b, want.c), rel=1e-6, abs=1e-15)
    assert fitted.for_length(32) is fitted.models[0] and fitted.for_length(33) is fitted.models[1]
    one = measure_cost_model(run, [32, 128], max_batch=16, repeats=1, clock=lambda: clock[0])
    assert isinstance(one, CostModel)
    # A single bucket has nothing to split by: one model even when asked per profile.
    assert isinstance(measure_cost_model(run, [128], max_batch=4, repeats=1, per_profile=True,
                                         clock=lambda: clock[0]), CostModel)


def test_sweep_respects_the_token_budget_when_measuring():
    seen = []
    measure_cost_model(lambda n, length: seen.append(n * length), [32, 128], max_batch=16, repeats=1,
                       max_tokens=512, clock=iter(range(10**6)).__next__)
    assert seen and max(seen) <= 512


def test_plan_groups_prices_each_group_on_its_own_profile():
    """Profile 0 (<= 32 tokens) is cheap per launch, profile 1 dear: short requests split, long ones pad together."""
    model = ProfileCostModel((32, 128), (CostModel(a=1e-5, b=1e-4, c=0.0), CostModel(a=1.0, b=1e-4, c=0.0)))
    lengths = [10, 20, 30, 40, 100, 128]
    groups = plan_groups(lengths, model, max_batch=8)
    assert [sorted(lengths[i] for i in g) for g in groups] == [[10], [20], [30], [40, 100, 128]]
    assert plan_cost(groups, lengths, model) < plan_cost([[0, 1, 2, 3, 4, 5]], lengths, model)
    with pytest.raises(ValueError, match="one cost model per bucket"):
        ProfileCostModel((32, 128), (CostModel(0, 0, 0),))
