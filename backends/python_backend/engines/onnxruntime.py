"""ONNX Runtime engine (CPU): the default when no TensorRT engine or GPU is there."""

from __future__ import annotations

from pathlib import Path

import numpy as np


class OnnxRuntimeEngine:
    """Runs an ONNX model with ONNX Runtime's CPU provider, telemetry off."""

    flavour = "onnxruntime"

    def __init__(self, model: Path | bytes, threads: int | None = None, external_data: dict[str, bytes] | None = None,
                 simulate_qdq: bool = False) -> None:
        """``external_data`` maps the data-file names the model refers to onto their (verified) bytes.

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
        if external_data:
            # A model past protobuf's 2 GB limit keeps its weights in a data file; they come from the same
            # verified bytes as the graph, never re-read from disk (ONNX Runtime copies them in).
            if not hasattr(opts, "add_external_initializers_from_files_in_memory"):
                raise RuntimeError("this onnxruntime cannot load external data from memory (needs 1.20 or newer): "
                                   "upgrade onnxruntime in the server's Python")
            names = list(external_data)
            buffers = [external_data[n] for n in names]
            opts.add_external_initializers_from_files_in_memory(names, buffers, [len(b) for b in buffers])
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
