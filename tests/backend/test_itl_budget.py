"""The ITL-aware chunk budget (generation/itl_budget.py): a step's chunk fitted to ``(ratio - 1)`` times the timed
decode launch of the running batch by the prefill cost model, corrected by what the chunks measured; whole blocks, a
floor for the first launch, a ceiling; on only under ``auto`` with a ratio."""

from __future__ import annotations

import pytest

from model_factory.backend.batching.grouping import CostModel
from model_factory.backend.generation.chunked_prefill import AUTO_MAX, MIN_CHUNK
from model_factory.backend.generation.itl_budget import ALPHA, SCALE_MAX, ItlBudget, itl_budget

LINEAR = CostModel(0.02, 0.0005, 0.0)  # a 20 ms launch, 0.5 ms a token


def test_the_chunk_fills_what_the_ratio_leaves_beside_the_decode_launch_in_whole_blocks():
    budget = ItlBudget(LINEAR, 2.0, ceiling=512)
    assert budget.allowance(8) is None  # no decode launch timed yet: the scheduler keeps the fixed chunk
    budget.observe_decode(8, 0.05)
    assert budget.allowance(8) == pytest.approx(0.05)  # (2 - 1) x 50 ms
    # 20 ms + 0.5 ms L <= 50 ms: L = 60, rounded down to whole blocks of 16.
    assert budget.fit(0.05) == 48
    assert budget.chunk_seconds(48) == pytest.approx(0.044) and budget.chunk_seconds(48) <= 0.05
    assert ItlBudget(LINEAR, 3.0, ceiling=512).ratio == 3.0
    three = ItlBudget(LINEAR, 3.0, ceiling=512)
    three.observe_decode(8, 0.05)
    assert three.fit(three.allowance(8)) == 160  # (0.1 - 0.02) / 0.0005 = 160


def test_the_first_chunk_never_falls_below_the_floor_and_a_second_launch_only_where_it_fits():
    budget = ItlBudget(LINEAR, 2.0, ceiling=512)
    assert budget.fit(0.01) == MIN_CHUNK  # less than a launch's fixed cost: the floor, so the long prompt advances
    assert budget.fit(0.01, first=False) == 0  # a second launch in the step: none
    assert budget.fit(0.03, first=False) == 16  # (0.03 - 0.02) / 0.0005 = 20 -> 16
    assert ItlBudget(LINEAR, 2.0, ceiling=512, floor=40).fit(0.0) == 32  # the floor in whole blocks
    assert budget.fit(100.0) == 512 and ItlBudget(LINEAR, 2.0, ceiling=200).fit(100.0) == 192  # the ceiling


def test_the_budget_follows_the_running_batch():
    budget = ItlBudget(LINEAR, 2.0, ceiling=512)
    budget.observe_decode(8, 0.05)
    budget.observe_decode(32, 0.2)
    small, large = budget.fit(budget.allowance(8)), budget.fit(budget.allowance(32))
    assert (small, large) == (48, 352)  # (0.2 - 0.02) / 0.0005 = 360 -> 352
    assert budget.allowance(30) == pytest.approx(0.2) and budget.allowance(9) == pytest.approx(0.05)  # the nearest
    budget.observe_decode(8, 0.07)  # the batch's launch grew dearer (a longer context, a busier machine)
    assert budget.decode_seconds(8) == pytest.approx(0.05 + ALPHA * 0.02)


def test_the_chunk_cost_is_corrected_by_what_the_chunks_measured():
    budget = ItlBudget(LINEAR, 2.0, ceiling=512)
    before = budget.fit(0.1)
    budget.observe_chunk(64, 0, 2 * LINEAR.cost(1, 64))  # twice what the model says
    assert budget.scale == pytest.approx(1 + ALPHA)
    assert budget.fit(0.1) < before
    for _ in range(100):
        budget.observe_chunk(64, 0, 1000.0)
    assert budget.scale == pytest.approx(SCALE_MAX)  # bounded: one stalled launch does not stop chunking


def test_a_chunk_after_many_cached_tokens_is_modelled_dearer():
    quadratic = ItlBudget(CostModel(0.02, 1e-4, 1e-6), 2.0, ceiling=512)
    assert quadratic.modelled(64, 1000) == pytest.approx(0.02 + 64e-4 + 1e-6 * 64 * 1064)
    assert quadratic.fit(0.1, past=1500) < quadratic.fit(0.1, past=0)


def test_on_only_under_auto_with_a_ratio_and_a_ratio_must_exceed_one():
    assert isinstance(itl_budget("auto", 2.0, 64, LINEAR, 2048), ItlBudget)
    assert itl_budget("auto", 2.0, 64, LINEAR, 2048).ceiling == AUTO_MAX
    assert itl_budget("auto", 2.0, 64, LINEAR, 100).ceiling == 96
    assert itl_budget(128, 2.0, 128, LINEAR, 2048) is None  # a number given fixes the chunk
    assert itl_budget("auto", 0.0, 64, LINEAR, 2048) is None  # off: the cost model's fixed chunk
    assert itl_budget("auto", 2.0, 0, LINEAR, 2048) is None  # chunking off
    with pytest.raises(ValueError, match="max_itl_ratio"):
        ItlBudget(LINEAR, 1.0, ceiling=512)
