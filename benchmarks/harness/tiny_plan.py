"""A tiny TensorRT plan for engine checks: ``out = 2 * float(input_ids)`` over dynamic (batch, length).

Shared by the CPU test of the TensorRT engine (built with ``tensorrt_rtx``, which compiles on a CPU) and the
GPU check of its memory estimate (``benchmarks/gpu_checks.py``).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def doubling_plan(trt: Any, profiles: Sequence[tuple[tuple[int, int], tuple[int, int], tuple[int, int]]]
                  ) -> bytes | None:
    """The serialized plan with one optimization profile per ``(min, opt, max)`` shape of ``input_ids``;
    None when this TensorRT cannot build engines here."""
    builder = trt.Builder(trt.Logger(trt.Logger.ERROR))
    net = builder.create_network(0)
    ids = net.add_input("input_ids", trt.DataType.INT64, (-1, -1))
    as_float = net.add_cast(ids, trt.DataType.FLOAT).get_output(0)
    two = net.add_constant((1, 1), np.array([[2.0]], dtype=np.float32)).get_output(0)
    out = net.add_elementwise(as_float, two, trt.ElementWiseOperation.PROD).get_output(0)
    out.name = "out"
    net.mark_output(out)
    config = builder.create_builder_config()
    for low, opt, high in profiles:
        profile = builder.create_optimization_profile()
        profile.set_shape("input_ids", low, opt, high)
        config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(net, config)
    return None if plan is None else bytes(plan)
