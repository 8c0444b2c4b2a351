"""The prefill cost model of a generative instance: measured at load on dummy prompts in its KV slots, or read from
the machine's cost cache (``MODEL_FACTORY_COST_CACHE``) where a rollout's candidate measured the same graph before.

The scheduler groups prefills and sizes chunked prefill with it (``batching/grouping.py``'s ``CostModel``:
``a + b n L + c n L^2``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..batching.grouping import CostModel, measure_cost_model
from ..settings import Settings
from .causal_lm import CausalLM
from .kv_slots import KVSlots

__all__ = ["cached_cost", "cost_cache_file", "measure_cost", "save_cost"]


def measure_cost(model: CausalLM, slots: KVSlots, max_prefill_tokens: int) -> CostModel:
    """The prefill cost model, timed on dummy prompts in the slots (cleared after)."""
    bucket = max(1, min(128, slots.max_context - 1))
    batch = min(8, slots.slots)

    claim = getattr(slots.storage, "claim", None)  # a block pool (kv_pool): each row its own blocks, as served

    def run(n: int, length: int) -> None:
        if claim is not None:
            for row in range(n):
                claim(row, length)
        model.prefill([[1] * length] * n, slots.views(0, n))

    try:
        cost = measure_cost_model(run, (bucket,), batch, repeats=1, max_tokens=max(bucket, max_prefill_tokens))
    finally:
        slots.clear()
    return cost if hasattr(cost, "a") else cost.models[0]


_COST_FLAVOUR = "onnxruntime-causal-lm-prefill"


def cost_cache_file(version_dir: Path, s: Settings, digests: Any, device: str = "cpu",
                     attention: str = "") -> Path | None:
    """Where this graph's prefill cost model is kept on this machine (``cost_cache``: keyed by the graph's sha256,
    the CPU and its cores, and the attention kernel when it is the factory's: ``CausalLM.attention``), or None
    without a cache folder (``MODEL_FACTORY_COST_CACHE``). A rollout's candidate
    measures it; the same version, loaded again at the switch, reads it instead of running the warm-up beside
    live traffic."""
    from ..batching import cost_cache
    from ..operations.shadow import CANDIDATE_SUFFIX

    folder = cost_cache.cache_dir_from_env()
    if folder is None:
        return None
    relpath = f"{version_dir.name}/{s.onnx_file}"
    sha = (digests or {}).get(relpath)
    if not sha:
        return None  # unverified: no key that names these bytes without hashing them again
    where = cost_cache.device_description({"device": device}, "GPU" if device.startswith("cuda") else "CPU",
                                          int(device.partition(":")[2] or 0))
    flavour = _COST_FLAVOUR + ("+int8-kv-attention" if attention.startswith("model-factory") else "")
    key = cost_cache.cache_key(sha, flavour, where, (128,), False)
    return cost_cache.cache_path(folder, s.model_name.removesuffix(CANDIDATE_SUFFIX), key)


def cached_cost(path: Path | None) -> CostModel | None:
    from ..batching import cost_cache

    if path is None:
        return None
    state, _why = cost_cache.load_state(path, required="prefill")
    if state is None:
        return None  # none yet, or unreadable: the load measures
    try:
        a, b, c = (float(state["prefill"][k]) for k in ("a", "b", "c"))
    except (KeyError, TypeError, ValueError):
        return None
    return CostModel(a, b, c) if a > 0 and b >= 0 and c >= 0 else None


def save_cost(path: Path, cost: CostModel, model_name: str) -> None:
    from ..batching import cost_cache

    try:
        cost_cache.save_state(path, {"prefill": {"a": cost.a, "b": cost.b, "c": cost.c}, "model": model_name})
    except OSError:
        pass  # a cache folder that cannot be written: the next load measures again
