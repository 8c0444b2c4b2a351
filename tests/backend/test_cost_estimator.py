"""The online cost-model estimator on synthetic timings: converges, ignores outliers, follows a change."""

from __future__ import annotations

import math
import random

import pytest

from model_factory.backend.batching.cost_estimator import CostEstimator, EstimatorConfig, fit_robust, length_bin, size_bin
from model_factory.backend.batching.grouping import CostModel, ProfileCostModel

TRUE = CostModel(2e-3, 1.5e-4, 4e-7)  # a CPU-like engine: a launch ~ a dozen tokens
SIZES = (1, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def stream(model, count: int, seed: int, noise: float = 0.05, lengths=(4, 128)):
    """``count`` timings ``(n, L, seconds)`` of ``model`` with lognormal noise, over a spread of shapes."""
    rng = random.Random(seed)
    for _ in range(count):
        n, length = rng.choice(SIZES), rng.randint(*lengths)
        yield n, length, model.cost(n, length) * rng.lognormvariate(0.0, noise)


def close(model: CostModel, truth: CostModel, rel: float) -> bool:
    """Every constant within ``rel`` (relative), and the modelled cost of typical launches within ``rel`` too."""
    for n, length in ((1, 8), (1, 64), (8, 32), (32, 128)):
        if abs(model.cost(n, length) - truth.cost(n, length)) > rel * truth.cost(n, length):
            return False
    return all(abs(getattr(model, k) - getattr(truth, k)) <= rel * getattr(truth, k) for k in "abc")


def feed(est: CostEstimator, timings) -> None:
    for n, length, seconds in timings:
        est.observe(n, length, seconds)


def test_length_bins_are_exact_when_short_and_coarser_when_long():
    assert [length_bin(x) for x in (1, 8, 9, 32, 33, 48, 49, 65, 97, 128)] == [8, 8, 16, 32, 48, 48, 64, 96, 128, 128]
    assert [size_bin(x) for x in (1, 4, 5, 6, 7, 9, 13, 17, 33, 64)] == [1, 4, 6, 6, 8, 12, 16, 24, 48, 64]


def test_converges_to_the_true_constants_from_a_wrong_prior():
    est = CostEstimator((32, 128), CostModel(1e-2, 5e-5, 0.0))  # launch 5x too dear, tokens 3x too cheap
    assert not close(est.model, TRUE, 0.5)
    feed(est, stream(TRUE, 600, seed=1))
    assert close(est.model, TRUE, 0.10), est.model
    assert est.stats.timings == 600 and est.stats.refits >= 600 // EstimatorConfig().refit_every


def test_uncertainty_is_infinite_without_data_and_shrinks_with_it():
    est = CostEstimator((128,), CostModel(1e-3, 1e-4, 0.0))
    assert math.isinf(est.relative_uncertainty())
    feed(est, stream(TRUE, 64, seed=2, noise=0.2))
    early = est.uncertainty[0]
    feed(est, stream(TRUE, 600, seed=3, noise=0.2))
    late = est.uncertainty[0]
    assert math.isfinite(early.b) and late.b < early.b and late.a < early.a
    # The truth lies within a few standard errors of the estimate.
    for k in "abc":
        assert abs(getattr(est.model, k) - getattr(TRUE, k)) <= 4 * getattr(late, k) + 1e-12


def test_injected_outliers_do_not_move_the_constants():
    clean = CostEstimator((32, 128), CostModel(1e-2, 5e-5, 0.0))
    dirty = CostEstimator((32, 128), CostModel(1e-2, 5e-5, 0.0))
    rng = random.Random(7)
    timings = list(stream(TRUE, 800, seed=4))
    feed(clean, timings)
    for i, (n, length, seconds) in enumerate(timings):
        if rng.random() < 0.10:
            seconds *= 20  # a stall: the process was descheduled
        if 400 <= i < 430:
            seconds += 0.25  # a GC pause hitting 30 launches in a row
        dirty.observe(n, length, seconds)
    assert dirty.stats.outliers > 40
    assert close(dirty.model, TRUE, 0.12), dirty.model
    assert close(dirty.model, clean.model, 0.12)


def test_a_burst_of_stalls_cannot_swing_the_constants():
    est = CostEstimator((128,), TRUE)
    feed(est, stream(TRUE, 400, seed=5))
    before = est.model
    for n, length, seconds in stream(TRUE, 40, seed=6):
        est.observe(n, length, seconds * 50)  # 40 broken timings in a row, spread over the cells
        assert close(est.model, before, 0.25), est.model


def test_follows_a_change_of_regime():
    slower = CostModel(5e-3, 3.5e-4, 6e-7)  # the machine got busy: everything dearer, launches most
    est = CostEstimator((32, 128), CostModel(1e-2, 5e-5, 0.0))
    feed(est, stream(TRUE, 600, seed=8))
    assert close(est.model, TRUE, 0.10)
    feed(est, stream(slower, 800, seed=9))  # the old regime is forgotten within a few half-lives
    assert close(est.model, slower, 0.10), est.model


def test_per_profile_constants_are_learned_apart():
    short, long = CostModel(1e-3, 1e-4, 0.0), CostModel(4e-3, 2e-4, 5e-7)
    truth = ProfileCostModel((32, 128), (short, long))
    est = CostEstimator((32, 128), CostModel(1e-2, 1e-5, 0.0), per_profile=True)
    rng = random.Random(10)
    for _ in range(1200):
        n, length = rng.choice(SIZES), rng.randint(1, 128)
        est.observe(n, length, truth.cost(n, length) * rng.lognormvariate(0, 0.03))
    model = est.model
    assert isinstance(model, ProfileCostModel)
    assert close(model.models[0], CostModel(1e-3, 1e-4, 1e-12), 0.15) or abs(model.models[0].b - 1e-4) < 1.5e-5
    assert close(model.models[1], long, 0.15), model.models[1]
    assert [label for label, _, _ in est.profiles()] == ["0", "1"]


def test_bad_timings_are_refused_and_count_nothing():
    est = CostEstimator((128,), TRUE)
    for bad in (0.0, -1.0, math.nan, math.inf):
        assert est.observe(1, 8, bad) is False
    assert est.observe(0, 8, 1e-3) is False
    assert est.stats.rejected == 5 and est.stats.timings == 0 and est.model == TRUE


def test_timed_means_live_traffic_not_the_prior():
    est = CostEstimator((128,), TRUE, prior_samples=[(1, 8, TRUE.cost(1, 8)), (4, 64, TRUE.cost(4, 64))])
    assert not est.timed(1, 8)
    for _ in range(3):
        est.observe(1, 8, TRUE.cost(1, 8))
    assert est.timed(1, 8) and not est.timed(4, 64)


def test_state_round_trip_restores_what_was_learned():
    est = CostEstimator((32, 128), CostModel(1e-2, 5e-5, 0.0))
    feed(est, stream(TRUE, 500, seed=11))
    state = est.state()
    again = CostEstimator.from_state(state, (32, 128))
    assert again.model == est.model  # the constants as they were saved
    assert all(math.isfinite(u.b) for u in again.uncertainty)
    assert again.learned_before == 500 and again.stats.timings == 0
    assert again.state()["timings"] == 500
    with pytest.raises(ValueError, match="other buckets"):
        CostEstimator.from_state(state, (64, 128))
    with pytest.raises(ValueError, match="version"):
        CostEstimator.from_state({**state, "version": 99}, (32, 128))


def test_fit_robust_needs_two_distinct_points():
    assert fit_robust([(1, 8, 1e-3, 1.0)]) is None
    model, se = fit_robust([(1, 8, TRUE.cost(1, 8), 1.0), (8, 64, TRUE.cost(8, 64), 1.0),
                            (2, 128, TRUE.cost(2, 128), 1.0), (16, 16, TRUE.cost(16, 16), 1.0)])
    assert close(model, TRUE, 0.01)
    assert se.a >= 0 and se.b >= 0


def test_cells_are_bounded():
    est = CostEstimator((128,), TRUE, config=EstimatorConfig(max_cells=16))
    feed(est, stream(TRUE, 300, seed=12))
    assert est.cell_count <= 17
