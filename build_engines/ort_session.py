"""An ONNX Runtime CPU session for the build's checks, with telemetry off (the factory is air-gapped)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from model_factory.errors import require


def onnxruntime_session(model: Path | bytes, threads: int | None = None, basic_optimizations: bool = False,
                        data_folder: Path | None = None) -> Any:
    """An ONNX Runtime CPU session with telemetry switched off (we are air-gapped).

    ``model`` is a file or a serialized ModelProto; ``basic_optimizations`` stops at ORT's basic graph
    optimizations (Q/DQ nodes stay float arithmetic, see :func:`accuracy.ort_session`); ``data_folder`` is where
    a serialized ModelProto's external data lie (a graph read in place, rewritten in memory).
    """
    ort = require("onnxruntime", "onnx")
    # ORT 1.32 resolves a telemetry host during inference unless told not to.
    if hasattr(ort, "disable_telemetry_events"):
        ort.disable_telemetry_events()
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    opts.log_severity_level = 4  # errors arrive as exceptions; ORT's coloured stderr lines are noise
    if basic_optimizations:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    if data_folder is not None:
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(data_folder))
    source = bytes(model) if isinstance(model, (bytes, bytearray)) else str(model)
    return ort.InferenceSession(source, sess_options=opts, providers=["CPUExecutionProvider"])
