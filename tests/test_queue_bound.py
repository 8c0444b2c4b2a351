"""The queue bound is derived where the model is served, from the signed budget and this machine's cost model."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from model_factory.build.repository import FALLBACK_QUEUE_BATCHES, package_model, read_config
from model_factory.serving.queue_bound import derived_config, load_configs, needs_measuring, queue_size


def _sizes(recipe):
    s = recipe.shapes
    return dict(max_batch=s.max_batch, length=s.sequence_buckets[0], preferred=recipe.batching.preferred_batch_sizes,
                budget_ms=recipe.batching.queue_budget_ms)


def test_the_bound_is_the_budget_of_work_this_machine_clears(minilm_recipe) -> None:
    max_batch = minilm_recipe.shapes.max_batch
    # 1 ms + 10 µs per token: a full batch of the first bucket's length takes a + b·n·L seconds.
    length = minilm_recipe.shapes.sequence_buckets[0]
    seconds = 0.001 + 1e-5 * max_batch * length
    size = queue_size((0.001, 1e-5, 0.0), **_sizes(minilm_recipe))
    smallest = min(minilm_recipe.batching.preferred_batch_sizes)
    assert size == max(smallest, math.ceil(max_batch / seconds * minilm_recipe.batching.queue_budget_ms / 1000.0))
    assert queue_size((0.001, 1e-7, 0.0), **_sizes(minilm_recipe)) > size  # a faster machine clears more
    assert queue_size((10.0, 0.0, 0.0), **_sizes(minilm_recipe)) == smallest  # never below the smallest batch
    assert queue_size((0.0, 0.0, 0.0), **_sizes(minilm_recipe)) is None  # a cost model that says nothing


def _package(recipe, tmp_path: Path, **params: str) -> Path:
    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"not read")
    recipe = replace(recipe, repository=replace(recipe.repository, path=tmp_path / "repo"))
    return package_model(recipe, {"model.onnx": onnx}, parameters=params).model_dir


def _shed_by(recipe, how: str):
    return replace(recipe, batching=replace(recipe.batching, shed_by=how))


def test_serve_derives_the_bound_from_a_measured_or_fixed_cost_model(minilm_recipe, tmp_path: Path) -> None:
    minilm_recipe = _shed_by(minilm_recipe, "count")  # the bound itself; shedding by age multiplies it (below)
    model_dir = _package(minilm_recipe, tmp_path)
    config = read_config(model_dir)
    signed = config.dynamic_batching.default_queue_policy.max_queue_size
    assert signed == FALLBACK_QUEUE_BATCHES * minilm_recipe.shapes.max_batch
    assert needs_measuring(model_dir)  # auto, and no constants in the configuration
    assert derived_config(config, None) is None  # nothing to derive from: the signed bound stays
    data = derived_config(config, (0.001, 1e-5, 0.0))
    assert int(data["dynamic_batching"]["default_queue_policy"]["max_queue_size"]) == \
        queue_size((0.001, 1e-5, 0.0), **_sizes(minilm_recipe))
    # Everything else is the signed configuration as it is.
    assert data["name"] == config.name and data["parameters"]["queue_bound"]["string_value"] == "auto"
    # The configuration Triton's load API receives (JSON text), per model.
    configs = load_configs(model_dir.parent, [model_dir.name], {model_dir.name: (0.001, 1e-5, 0.0)})
    assert json.loads(configs[model_dir.name]) == data


def test_constants_in_the_configuration_need_no_measuring(minilm_recipe, tmp_path: Path) -> None:
    minilm_recipe = _shed_by(minilm_recipe, "count")
    model_dir = _package(minilm_recipe, tmp_path, cost_model="0.001,1e-7,0")
    assert not needs_measuring(model_dir)
    configs = load_configs(model_dir.parent, [model_dir.name])
    bound = json.loads(configs[model_dir.name])["dynamic_batching"]["default_queue_policy"]["max_queue_size"]
    assert int(bound) == queue_size((0.001, 1e-7, 0.0), **_sizes(minilm_recipe))


def test_a_fixed_bound_or_one_instance_is_left_as_signed(minilm_recipe, tmp_path: Path) -> None:
    fixed = replace(minilm_recipe, batching=replace(minilm_recipe.batching, max_queue_size=7))
    model_dir = _package(fixed, tmp_path)
    assert load_configs(model_dir.parent, [model_dir.name], {model_dir.name: (0.001, 1e-5, 0.0)}) == {}
    assert not needs_measuring(model_dir)


def test_a_measured_cost_is_kept_per_served_version_and_machine(minilm_recipe, tmp_path: Path,
                                                                 monkeypatch) -> None:
    from model_factory.backend.engines.cpu_features import INT8_KERNELS_ENV
    from model_factory.serving.queue_bound import cached_cost, cost_file, remember_cost
    from model_factory.serving.verified_start import check_on_this_machine

    monkeypatch.delenv(INT8_KERNELS_ENV, raising=False)
    model_dir = _package(minilm_recipe, tmp_path)
    cache = tmp_path / "cost-cache"
    path = cost_file(cache, model_dir)
    assert path is not None and cached_cost(path) is None and cost_file(None, model_dir) is None
    remember_cost(path, (0.002, 3e-6, 1e-9), model_dir.name)
    assert cached_cost(path) == (0.002, 3e-6, 1e-9)
    # Another build (other digests), other INT8 kernels or another GPU product never read this file.
    assert cost_file(cache, model_dir, {"1/model.onnx": "0" * 64}) != path
    assert cost_file(cache, model_dir, int8_kernels="simulated") != path
    assert cost_file(cache, model_dir, gpu_product="NVIDIA H200") != path
    # A start on this machine reads the kept cost and measures nothing (this model's engine file is not ONNX:
    # a measurement would give no cost at all).
    checks = check_on_this_machine(model_dir.parent, (model_dir.name,), None, accept=False, gpu_product=None,
                                   cost_cache=cache)
    assert checks.costs == {model_dir.name: (0.002, 3e-6, 1e-9)} and checks.passed == (model_dir.name,)
    assert check_on_this_machine(model_dir.parent, (model_dir.name,), None, accept=False, gpu_product=None,
                                 ).costs == {}  # no cache: measured, and "not read" is no engine
    for bad in ("{", "[]", json.dumps({"queue_cost": {"a": "x"}}), json.dumps({"queue_cost": {"a": 0, "b": 0,
                                                                                             "c": 0}})):
        path.write_text(bad)
        assert cached_cost(path) is None  # a file that does not fit is ignored: the start measures


def test_a_model_that_degrades_gets_a_larger_bound(minilm_recipe, tmp_path: Path) -> None:
    """degrade_to: Triton's bound is DEGRADE_QUEUE_FACTOR times the one that would shed, so the backend sees them."""
    from model_factory.backend.contract import DEGRADE_QUEUE_FACTOR

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = derived_config(read_config(_package(minilm_recipe, tmp_path / "a")), (0.001, 1e-5, 0.0))
    degrading = derived_config(read_config(_package(minilm_recipe, tmp_path / "b", degrade_to="int8")),
                               (0.001, 1e-5, 0.0))
    bound = int(plain["dynamic_batching"]["default_queue_policy"]["max_queue_size"])
    assert int(degrading["dynamic_batching"]["default_queue_policy"]["max_queue_size"]) == DEGRADE_QUEUE_FACTOR * bound


def test_a_queue_that_sheds_by_age_waits_the_budget_behind_a_larger_bound(minilm_recipe, tmp_path: Path) -> None:
    """shed_by = "age": serve derives Triton's queue timeout (the budget, at least twice the longest launch by the
    cost model measured there) and a bound SHED_AGE_BOUND_FACTOR times the one that sheds by count (a cap on
    memory, not the shedding rule); the signed configuration has that cap on its fallback bound, no timeout."""
    from model_factory.backend.contract import SHED_AGE_BOUND_FACTOR
    from model_factory.serving.queue_bound import shed_wait_us

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    age = _shed_by(minilm_recipe, "age")
    plain = derived_config(read_config(_package(_shed_by(minilm_recipe, "count"), tmp_path / "a")),
                           (0.001, 1e-5, 0.0))
    by_age = read_config(_package(age, tmp_path / "b"))
    signed = by_age.dynamic_batching.default_queue_policy
    assert signed.default_timeout_microseconds == 0  # derived where it serves, as the bound is
    assert signed.max_queue_size == SHED_AGE_BOUND_FACTOR * FALLBACK_QUEUE_BATCHES * minilm_recipe.shapes.max_batch
    assert not read_config(tmp_path / "a" / "repo" / "minilm").dynamic_batching.default_queue_policy \
        .default_timeout_microseconds  # shedding by count: no timeout
    derived = derived_config(by_age, (0.001, 1e-5, 0.0))["dynamic_batching"]["default_queue_policy"]
    bound = int(plain["dynamic_batching"]["default_queue_policy"]["max_queue_size"])
    assert int(derived["max_queue_size"]) == SHED_AGE_BOUND_FACTOR * bound
    # A full launch of 64 x 128 tokens takes 1 ms + 82 ms here: the 300 ms budget is the wait.
    budget = minilm_recipe.batching.queue_budget_ms
    assert int(derived["default_timeout_microseconds"]) == budget * 1000
    assert derived["timeout_action"] == "REJECT"
    # A machine where that launch takes 0.82 s: a request may wait two of them (1.64 s), not the 300 ms budget, so
    # that no request is shed for waiting behind one busy launch.
    slow = derived_config(by_age, (0.001, 1e-4, 0.0))["dynamic_batching"]["default_queue_policy"]
    max_len = minilm_recipe.shapes.max_sequence_length
    assert int(slow["default_timeout_microseconds"]) == shed_wait_us(
        (0.001, 1e-4, 0.0), max_batch=minilm_recipe.shapes.max_batch, max_length=max_len, budget_ms=budget)
    assert 1_600_000 < int(slow["default_timeout_microseconds"]) < 1_700_000
    assert shed_wait_us((0.0, 0.0, 0.0), max_batch=64, max_length=128, budget_ms=300) is None
    # One instance: no bound, so no shedding of either kind (Triton's batcher and a queue policy, above).
    one = replace(age, repository=replace(age.repository, instance_count=1))
    (tmp_path / "c").mkdir()
    policy = read_config(_package(one, tmp_path / "c")).dynamic_batching.default_queue_policy
    assert (policy.max_queue_size, policy.default_timeout_microseconds) == (0, 0)
