"""ONNX Runtime engine (CPU): the default when no TensorRT engine or GPU is there."""

from __future__ import annotations

from pathlib import Path

import numpy as np


class OnnxRuntimeEngine:
    """Runs an ONNX model with ONNX Runtime's CPU provider, telemetry off."""

    flavour = "onnxruntime"

    def __init__(self, model: Path | bytes, threads: int | None = None, simulate_qdq: bool = False) -> None:
        """``model``: the ONNX bytes, or a path (a model with external data is loaded from its path).

        ``simulate_qdq`` keeps Q/DQ pairs as float arithmetic (basic graph optimizations only).
        """
        import onnxruntime as ort  # imported here: the backend package must import without it

        # Air-gapped product: ORT otherwise resolves a telemetry host during inference.
        if hasattr(ort, "disable_telemetry_events"):
            ort.disable_telemetry_events()
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if threads:
            opts.intra_op_num_threads = threads
        if simulate_qdq:
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        # Bytes come from the integrity check: the session is built from exactly what was hashed.
        source = model if isinstance(model, bytes) else str(model)
        self._session = ort.InferenceSession(source, sess_options=opts, providers=["CPUExecutionProvider"])
        self.input_names = tuple(i.name for i in self._session.get_inputs())
        self.output_names = tuple(o.name for o in self._session.get_outputs())

    def run(self, feeds: dict[str, np.ndarray], profile: int = 0) -> dict[str, np.ndarray]:
        """Run one group; ``profile`` is ignored (ONNX Runtime takes any shape)."""
        outs = self._session.run(list(self.output_names), {k: feeds[k] for k in self.input_names})
        return dict(zip(self.output_names, outs))

    def close(self) -> None:
        """Drop the session."""
        self._session = None
