"""Where the cost model starts (given, cache, short warm-up, sweep) and how what it learned is kept."""

from __future__ import annotations

import json

import pytest

from model_factory.backend.batching import cost_cache
from model_factory.backend.batching.cost_estimator import CostEstimator
from model_factory.backend.batching.cost_learning import CostKeeper, short_points, start_cost_model
from model_factory.backend.batching.grouping import CostModel, ProfileCostModel, sweep_points

TRUE = CostModel(2e-3, 1.5e-4, 4e-7)


class FakeEngine:
    """``run(n, L)`` takes exactly TRUE's time on a fake clock; records the launches."""

    def __init__(self, model=TRUE):
        self.now = 0.0
        self.launches: list[tuple[int, int]] = []
        self.model = model

    def clock(self) -> float:
        return self.now

    def run(self, n: int, length: int) -> None:
        self.launches.append((n, length))
        self.now += self.model.cost(n, length)


def start(engine: FakeEngine, **kw):
    args = dict(run=engine.run, buckets=(32, 128), max_batch=64, max_tokens=None, per_profile=False,
                clock=engine.clock)
    args.update(kw)
    return start_cost_model(**args)


def test_short_warm_up_is_a_handful_of_cheap_launches_and_learns():
    engine = FakeEngine()
    s = start(engine)
    assert isinstance(s.cost, CostEstimator) and s.source.startswith("short warm-up")
    points = short_points((32, 128), 64)
    assert len(engine.launches) == len(points) + 1  # one untimed launch first
    assert max(n * length for n, length in engine.launches) <= 2 * 128
    sweep = sum(TRUE.cost(n, length) for n, length in sweep_points((32, 128), 64)) * 4  # warm-up + 3 repeats
    assert s.seconds < sweep / 10
    for k in "abc":  # exact timings: the constants are recovered
        assert getattr(s.cost.model, k) == pytest.approx(getattr(TRUE, k), rel=1e-6, abs=1e-12)
    assert "learning from traffic" in s.note


def test_per_profile_short_warm_up_times_every_profile():
    truth = ProfileCostModel((32, 128), (CostModel(1e-3, 1e-4, 0.0), CostModel(3e-3, 2e-4, 1e-7)))
    engine = FakeEngine(truth)
    s = start(engine, per_profile=True)
    model = s.cost.model
    assert isinstance(model, ProfileCostModel)
    assert model.models[1].b == pytest.approx(2e-4, rel=1e-6)
    assert model.models[0].a == pytest.approx(1e-3, rel=1e-6)


def test_sweep_keeps_todays_full_warm_up_and_can_be_fixed():
    engine = FakeEngine()
    s = start(engine, warmup="sweep", online=False)
    assert isinstance(s.cost, CostModel) and s.source == "warm-up sweep" and "fixed" in s.note
    assert len(engine.launches) == 4 * len(sweep_points((32, 128), 64))


def test_given_constants_are_fixed_unless_told_to_learn():
    engine = FakeEngine()
    fixed = start(engine, given=(1e-3, 1e-4, 0.0))
    assert fixed.cost == CostModel(1e-3, 1e-4, 0.0) and engine.launches == []
    learning = start(engine, given=(1e-3, 1e-4, 0.0), online=True)
    assert isinstance(learning.cost, CostEstimator) and learning.cost.model == CostModel(1e-3, 1e-4, 0.0)


def test_a_restart_reads_what_was_learned_and_skips_the_warm_up(tmp_path):
    path = tmp_path / "cache" / "minilm-key.json"
    engine = FakeEngine()
    first = start(engine, cache_file=path)
    assert "no learned constants yet" in first.note
    logged: list[str] = []
    keeper = CostKeeper(first.cost, cache_file=path, log=logged.append, meta={"model": "minilm"})
    for _ in range(40):
        for n, length in ((1, 8), (4, 16), (2, 64), (8, 128), (16, 32)):
            first.cost.observe(n, length, TRUE.cost(n, length) * 1.5)  # the real engine is slower than warm-up said
    keeper.close()
    assert path.is_file() and "saved to" in logged[-1] and "200 timings" in logged[-1]
    assert not list(path.parent.glob("*.tmp"))  # written atomically
    engine = FakeEngine()
    again = start(engine, cache_file=path)
    assert again.source == "cache" and "200 timings" in again.note
    assert len(engine.launches) == 1  # one untimed touch (one profile here), no sweep
    assert again.cost.model.cost(8, 128) == pytest.approx(first.cost.model.cost(8, 128), rel=1e-9)


def test_two_instances_saving_to_one_file_both_keep_what_they_learned(tmp_path):
    """The instances of a model share one cache file: each save merges, so nothing learned is lost."""
    path = tmp_path / "cache" / "minilm-key.json"
    a, b = start(FakeEngine(), cache_file=path), start(FakeEngine(), cache_file=path)
    keep_a = CostKeeper(a.cost, cache_file=path, log=lambda _m: None, meta={"model": "minilm"})
    keep_b = CostKeeper(b.cost, cache_file=path, log=lambda _m: None, meta={"model": "minilm"})
    for _ in range(10):  # a times short requests, b long ones
        for n, length in ((1, 8), (4, 16)):
            a.cost.observe(n, length, TRUE.cost(n, length))
        for n, length in ((8, 128), (16, 96)):
            b.cost.observe(n, length, TRUE.cost(n, length))
    keep_a.close()
    keep_b.close()  # the last writer: a's timings and cells must still be there
    state = json.loads(path.read_text())["estimator"]
    assert state["timings"] == 40
    lengths = {round(cell[1]) for cell in state["cells"]}
    assert {8, 16} <= lengths and {128, 96} <= lengths
    # Saved again after more traffic: only what is new is added (no double counting).
    a.cost.observe(2, 32, TRUE.cost(2, 32))
    keep_a.save()
    assert json.loads(path.read_text())["estimator"]["timings"] == 41
    assert not list(path.parent.glob("*.tmp"))
    # A restart reads both instances' learning.
    again = start(FakeEngine(), cache_file=path)
    assert again.source == "cache" and "41 timings" in again.note
    assert again.cost.model.cost(8, 128) == pytest.approx(TRUE.cost(8, 128), rel=0.05)


@pytest.mark.parametrize("content", ["{not json", json.dumps({"estimator": {"version": 99}}), json.dumps([1])])
def test_a_broken_or_foreign_cache_file_is_ignored(tmp_path, content):
    path = tmp_path / "m-key.json"
    path.write_text(content)
    engine = FakeEngine()
    s = start(engine, cache_file=path)
    assert s.source.startswith("short warm-up") and len(engine.launches) > 2
    assert str(path) in s.note or "cost model cache" in s.note or "does not fit" in s.note


def test_keeper_saves_every_so_often_and_logs_big_moves(tmp_path):
    now = [0.0]
    est = CostEstimator((128,), CostModel(1e-2, 1e-5, 0.0))
    logged: list[str] = []
    path = tmp_path / "c.json"
    keeper = CostKeeper(est, cache_file=path, log=logged.append, save_every=64, min_interval_s=10,
                        clock=lambda: now[0])
    for i in range(200):
        n, length = (1, 8) if i % 3 == 0 else (4, 64) if i % 3 == 1 else (16, 128)
        est.observe(n, length, TRUE.cost(n, length))
        now[0] += 0.1
        keeper.after_window()
    assert path.is_file() and json.loads(path.read_text())["estimator"]["timings"] >= 64
    assert any("relearned" in line for line in logged)


def test_cache_keys_separate_engines_devices_and_profiles(tmp_path):
    base = cost_cache.cache_key("ab" * 32, "onnxruntime", "cpu:X x2", (32, 128), False)
    assert base != cost_cache.cache_key("cd" * 32, "onnxruntime", "cpu:X x2", (32, 128), False)
    assert base != cost_cache.cache_key("ab" * 32, "onnxruntime", "cpu:Y x2", (32, 128), False)
    assert base != cost_cache.cache_key("ab" * 32, "onnxruntime", "cpu:X x2", (64, 128), False)
    assert base != cost_cache.cache_key("ab" * 32, "tensorrt", "cpu:X x2", (32, 128), True)
    assert cost_cache.cache_path(tmp_path, "a/b", base).name == f"a_b-{base}.json"
    assert cost_cache.cache_dir_from_env({cost_cache.ENV: str(tmp_path)}) == tmp_path
    assert cost_cache.cache_dir_from_env({}) is None
    gpu = cost_cache.device_description({"device": "cuda:0", "device_name": "H200"}, "GPU", 0)
    assert gpu == "gpu0:H200" and cost_cache.device_description({}, "CPU", 0).startswith("cpu:")
