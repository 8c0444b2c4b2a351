"""The queue bound of this deployment: derived where the model is served, never baked into the signed config.

A model packaged with ``max_queue_size = "auto"`` (and two or more instances) carries in its signed
``config.pbtxt`` a fallback bound (a few full batches) and two parameters of the contract:
``queue_bound = auto`` and ``queue_budget_ms``. The bound that fits is the number of requests this
machine clears in that budget, which depends on the machine: so ``serve`` derives it here, from the
cost model of the engine measured on this machine (or the constants the configuration fixes), and loads
the model with that configuration through Triton's load API (its ``config`` parameter: Triton then
uses it instead of reading ``config.pbtxt``). The signed bytes stay reproducible; only the per-deployment
bound differs, and it exists only in the server's memory.

Measuring takes a child process that loads and times the engine (2-3 s for MiniLM on 2 cores): done at every
start it put ``serve`` → READY past 3 s. So the measured cost model is kept in the cost cache folder (the one the
backend keeps its learned constants in, :mod:`model_factory.backend.batching.cost_cache`), one file per (the served
version's signed digests, this machine, the INT8 kernels and GPU product asked for): a restart of the same
engine on the same machine reads it and measures nothing (:func:`cached_cost`, :func:`remember_cost`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

CostModel = tuple[float, float, float]


def queue_size(cost: Sequence[float], *, max_batch: int, length: int, preferred: Sequence[int],
               budget_ms: float) -> int | None:
    """Requests the model's instances clear in ``budget_ms``: the bound; None when ``cost`` says nothing.

    With a cost model ``(a, b, c)`` (seconds; one launch of ``n`` sequences padded to ``L`` takes
    ``a + b·n·L + c·n·L²``) the rate is that of full batches (``max_batch``) of ``length`` (the first
    sequence bucket); the queue then holds about the budget's worth of work, and never less than the
    smallest preferred batch. The bound does not grow with the instance count: a replica's instances share
    its cores (or GPU). Two MiniLM instances of one thread each on 2 CPU cores cleared 1.05-1.47x what one
    session on both cores gives, so there the bound is 200-300 ms of their work (benchmarks/RESULTS.md).
    """
    a, b, c = (float(x) for x in cost)
    n = int(max_batch)
    seconds = a + b * n * length + c * n * length * length
    if not (seconds > 0 and math.isfinite(seconds)) or n < 1:
        return None
    floor = min(preferred or (n,))
    return max(int(floor), int(math.ceil(n / seconds * budget_ms / 1000.0)))


def shed_wait_us(cost: Sequence[float], *, max_batch: int, max_length: int, budget_ms: float) -> int | None:
    """How long, µs, a request may wait in Triton's queue before it is shed by its age; None when ``cost`` says nothing.

    The budget, but never under twice the longest launch the instances run (``max_batch`` sequences of
    ``max_length``, by the cost model ``(a, b, c)``): below one load's worth of clients a request waits at most
    for one busy launch to end, and a budget shorter than that launch shed requests at 4 clients of 16 long
    texts each (tests/integration/test_faults.py on MiniLM, 2 cores). Under overload the answered requests
    then waited at most this long in the queue.
    """
    a, b, c = (float(x) for x in cost)
    n, length = int(max_batch), int(max_length)
    launch = a + b * n * length + c * n * length * length
    if not (launch > 0 and math.isfinite(launch)) or n < 1:
        return None
    return int(math.ceil(max(float(budget_ms) / 1000.0, 2.0 * launch) * 1e6))


def derived_config(config: Any, cost: Sequence[float] | None) -> dict[str, Any] | None:
    """The configuration (Triton's JSON form) with this deployment's queue bound; None when it keeps its own.

    ``config`` is a parsed ``ModelConfig``. Only a model whose parameters say ``queue_bound = auto`` gets
    a derived bound (times ``DEGRADE_QUEUE_FACTOR`` for a model that degrades before shedding: ``degrade_to``;
    times ``SHED_AGE_BOUND_FACTOR`` for one that sheds by age, which also gets its queue timeout here:
    :func:`shed_wait_us`); ``cost`` is the cost model measured here, else the constants the configuration
    fixes (``cost_model``); with neither, the signed (fallback) bound stays.
    """
    from google.protobuf import json_format

    from model_factory.backend.contract import parse_parameters

    params = parse_parameters({k: v.string_value for k, v in config.parameters.items()})
    if params.queue_bound != "auto" or not params.queue_budget_ms:
        return None
    cost = cost if cost is not None else params.cost_model
    if cost is None:
        return None
    length = (params.sequence_buckets or (params.max_sequence_length,))[0]
    size = queue_size(cost, max_batch=config.max_batch_size, length=length,
                      preferred=list(config.dynamic_batching.preferred_batch_size), budget_ms=params.queue_budget_ms)
    if size is None:
        return None
    if params.degrade_to:  # degrade before shedding: the backend sees what it can answer on the cheaper engine
        from model_factory.backend.contract import DEGRADE_QUEUE_FACTOR

        size *= DEGRADE_QUEUE_FACTOR
    wait_us = None
    if params.queue_shed_by == "age":  # shed by the wait, derived here too; the bound only caps memory
        from model_factory.backend.contract import SHED_AGE_BOUND_FACTOR

        size *= SHED_AGE_BOUND_FACTOR
        wait_us = shed_wait_us(cost, max_batch=config.max_batch_size, max_length=params.max_sequence_length,
                               budget_ms=params.queue_budget_ms)
    data = json_format.MessageToDict(config, preserving_proto_field_name=True)
    policy = data.setdefault("dynamic_batching", {}).setdefault("default_queue_policy", {})
    policy["max_queue_size"] = size
    if wait_us is not None:  # Triton's queue timeout: a request that waited this long is answered 503
        policy["default_timeout_microseconds"] = str(wait_us)
        policy["timeout_action"] = "REJECT"
    return data


def load_configs(repository: Path, models: Sequence[str],
                 costs: Mapping[str, Sequence[float]] | None = None) -> dict[str, str]:
    """model -> the JSON configuration its loads carry, for the models whose bound is derived here."""
    from model_factory.build.repository import read_config

    out: dict[str, str] = {}
    for model in models:
        data = derived_config(read_config(Path(repository) / model), (costs or {}).get(model))
        if data is not None:
            out[model] = json.dumps(data)
    return out


def needs_measuring(model_dir: Path) -> bool:
    """Whether the model's bound is derived here and its configuration fixes no cost model to derive it from."""
    from model_factory.backend.contract import parse_parameters
    from model_factory.build.repository import config_parameters, read_config

    params = parse_parameters(config_parameters(read_config(model_dir)))
    return params.queue_bound == "auto" and params.cost_model is None


def measure_engine_cost(model_dir: Path, digests: Mapping[str, str] | None = None,
                        gpu_product: str | None = None, int8_kernels: str | None = None) -> CostModel | None:
    """The cost model of the engine the backend would serve for ``model_dir``, timed on this machine.

    Loads the engine with the backend's own loader (same choice, same files, bytes checked against
    ``digests``) and times the backend's short warm-up (what it starts from at load); None for a model whose
    inputs are not all ``[batch, sequence]`` integer tensors or whose engine does not load (the model's
    own load reports that). Run in a child process: the engine's memory is gone before Triton loads it.
    """
    import numpy as np

    from model_factory.backend.batching.cost_learning import start_cost_model
    from model_factory.backend.batching.grouping import profile_for_length
    from model_factory.backend.engines.loading import load_engine
    from model_factory.build.repository import read_config
    from model_factory.serving.acceptance import engine_settings, gpu_product_env, instance_of, served_version

    config = read_config(model_dir)
    settings = engine_settings(config)
    kind, device = instance_of(config)
    try:
        with gpu_product_env(gpu_product, int8_kernels):
            engine, _info = load_engine(Path(model_dir) / served_version(Path(model_dir), config), settings, kind,
                                        device, digests=None if digests is None else dict(digests))
    except Exception:  # noqa: BLE001 - the model's own load says why; the signed bound stays meanwhile
        return None
    # The engine's own inputs (a text model's `text` input is tokenized before the engine sees it).
    inputs = [i for i in settings.inputs if i.name in set(engine.input_names)]
    if not inputs or not all(i.data_type in ("TYPE_INT64", "TYPE_INT32") and len(i.dims) == 1 for i in inputs):
        engine.close()
        return None
    dtypes = {i.name: np.int64 if i.data_type == "TYPE_INT64" else np.int32 for i in inputs}
    try:
        def run(n: int, length: int) -> None:
            engine.run({name: np.ones((n, length), dtype=dt) for name, dt in dtypes.items()},
                       profile_for_length(length, settings.sequence_buckets))

        # The backend's own short warm-up (a handful of cheap launches), fitted: the constants it starts from.
        start = start_cost_model(run=run, buckets=settings.sequence_buckets, max_batch=settings.max_batch_size,
                                 max_tokens=settings.max_group_tokens, per_profile=False, warmup="short",
                                 online=False)
        model = start.cost
        return (float(model.a), float(model.b), float(model.c))
    except Exception:  # noqa: BLE001 - a model the sweep cannot run keeps the signed bound
        return None
    finally:
        engine.close()


QUEUE_COST = "queue_cost"  # the cache file's field: {"a", "b", "c"} in seconds


def _served_digests(model_dir: Path, digests: Mapping[str, str] | None) -> dict[str, str]:
    """The served version's file digests: the verified ones, else those its metadata.json lists (else {})."""
    from model_factory.backend.contract import Files
    from model_factory.build.repository import read_config
    from model_factory.serving.acceptance import served_version

    if digests:
        return dict(digests)
    version = served_version(Path(model_dir), read_config(model_dir))
    try:
        files = json.loads((Path(model_dir) / version / Files.METADATA).read_text()).get("files")
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in files.items()} if isinstance(files, dict) else {}


def cost_file(cache_dir: Path | None, model_dir: Path, digests: Mapping[str, str] | None = None,
              gpu_product: str | None = None, int8_kernels: str | None = None) -> Path | None:
    """The cost cache file for this model's measured queue-bound cost on this machine (None: nothing to key on).

    The key: every file digest of the served version (engines, config, metadata: another build never reads
    this build's cost), this host and its CPU (model, usable cores), the GPU product and INT8 kernels ``serve``
    was given (they change which engine loads), through the backend's own :func:`cost_cache.cache_key`.
    """
    import hashlib
    import os
    import platform

    from model_factory.backend.batching import cost_cache
    from model_factory.backend.contract import parse_parameters
    from model_factory.backend.engines.cpu_features import INT8_KERNELS_ENV
    from model_factory.build.repository import config_parameters, read_config

    if cache_dir is None:
        return None
    files = _served_digests(model_dir, digests)
    if not files:
        return None
    engine = hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()
    kernels = int8_kernels or os.environ.get(INT8_KERNELS_ENV, "") or "auto"
    flavour = f"queue-bound measurement, int8_kernels={kernels}, gpu_product={gpu_product or 'any'}"
    device = f"{platform.node()} cpu:{cost_cache.cpu_description()}"
    params = parse_parameters(config_parameters(read_config(model_dir)))
    buckets = params.sequence_buckets or (params.max_sequence_length or 1,)
    key = cost_cache.cache_key(engine, flavour, device, buckets, False)
    return cost_cache.cache_path(Path(cache_dir), f"{Path(model_dir).name}.queue-bound", key)


def cached_cost(path: Path | None) -> CostModel | None:
    """The cost model a start on this machine measured before (None: none kept, or a file that does not fit)."""
    from model_factory.backend.batching import cost_cache

    if path is None:
        return None
    state, _why = cost_cache.load_state(path, required=QUEUE_COST)
    if state is None:
        return None
    try:
        cost = tuple(float(state[QUEUE_COST][k]) for k in ("a", "b", "c"))
    except (KeyError, TypeError, ValueError):
        return None
    return cost if all(math.isfinite(x) and x >= 0 for x in cost) and sum(cost) > 0 else None  # type: ignore


def remember_cost(path: Path | None, cost: Sequence[float], model: str) -> None:
    """Keep a measured cost model for the next start (atomically); a cache that cannot be written is skipped."""
    import datetime as dt

    from model_factory.backend.batching import cost_cache

    if path is None:
        return
    a, b, c = (float(x) for x in cost)
    try:
        cost_cache.save_state(path, {QUEUE_COST: {"a": a, "b": b, "c": c}, "model": model,
                                     "saved_at": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")})
    except OSError:
        pass  # a cache is a nicety: the next start measures again
