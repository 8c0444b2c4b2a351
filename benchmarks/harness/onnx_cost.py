"""Benchmark-only: the cost model of an FP32 ONNX on this machine's CPU (ONNX Runtime), for sizing queues.

The product derives a deployment's queue bound where it serves (model_factory/serving/queue_bound.py); the
benchmarks that compare queue policies fix one set of constants for every server they start.
"""

from __future__ import annotations

from pathlib import Path

from model_factory.recipe import Recipe


def measure_onnx_cost_model(onnx_path: Path, recipe: Recipe) -> tuple[float, float, float] | None:
    """The cost model ``(a, b, c)`` of the FP32 ONNX on this machine's CPU, for a benchmark's fixed constants.

    Timed as the backend times its engine at load (the same sweep, one repeat), on ONNX Runtime; None for a
    model whose inputs are not all ``[batch, sequence]`` integer tensors, or when ONNX Runtime is missing.
    The backend measures its own engine again at load; this figure only sizes the queue.
    """
    try:
        import numpy as np
        import onnxruntime  # noqa: F401  (the engine below needs it)

        from model_factory.backend.engines.onnxruntime import OnnxRuntimeEngine
        from model_factory.backend.batching.grouping import measure_cost_model
    except ImportError:
        return None
    engine = OnnxRuntimeEngine(Path(onnx_path))
    try:
        inputs = engine._session.get_inputs()
        if not all(i.type in ("tensor(int64)", "tensor(int32)") and len(i.shape) == 2 for i in inputs):
            return None
        dtypes = {i.name: np.int64 if i.type == "tensor(int64)" else np.int32 for i in inputs}

        def run(n: int, length: int) -> None:
            engine.run({name: np.ones((n, length), dtype=dt) for name, dt in dtypes.items()})

        model = measure_cost_model(run, recipe.shapes.sequence_buckets or (recipe.shapes.max_sequence_length,),
                                   recipe.shapes.max_batch, repeats=1)
        return (float(model.a), float(model.b), float(model.c))
    except Exception:  # a model the sweep cannot run: the fallback bound applies
        return None
    finally:
        engine.close()


def measured_queue_bound(onnx_path: Path, recipe: Recipe) -> tuple[int, tuple[float, float, float] | None]:
    """``(bound, cost)``: the "auto" queue bound ``serve`` would derive here for ``recipe`` (the signed fallback
    when the cost cannot be measured), and the measured cost model it comes from (None then)."""
    from model_factory.build.repository import fallback_queue_size
    from model_factory.serving.queue_bound import queue_size

    cost = measure_onnx_cost_model(onnx_path, recipe)
    shapes, batching = recipe.shapes, recipe.batching
    size = (queue_size(cost, max_batch=shapes.max_batch, length=(shapes.sequence_buckets or
                                                                  (shapes.max_sequence_length,))[0],
                       preferred=batching.preferred_batch_sizes, budget_ms=batching.queue_budget_ms)
            if cost else None) or fallback_queue_size(recipe)
    return size, cost
