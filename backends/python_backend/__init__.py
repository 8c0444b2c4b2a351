"""The code that runs inside Triton's Python backend.

This package is copied into every model version folder as ``mf_backend/`` and
imported by the stub there, so it uses only relative imports among itself and
imports nothing else from ``model_factory``. Heavy dependencies (onnxruntime,
tokenizers, tensorrt, cuda) are imported where used.

Modules: ``contract`` (the model parameters packaging writes and this backend
reads, and the version folder's file names: one definition for both sides),
``model`` (Triton's entry points, thin), ``settings`` (config
parameters, read through ``contract``), ``requests`` (per-request decoding and validation), ``tokenizer``,
``executor`` (grouped execution), ``grouping`` (the cost model and the split),
``cost_estimator`` (the cost model refitted from real launches), ``adaptive_planner``
(plans with it, prices the alternatives, explores a little), ``cost_learning`` (where
the cost model starts: warm-up or cache; saving and logging what it learned),
``cost_cache`` (learned constants kept outside the repository),
``engines/`` (one interface: ONNX Runtime, TensorRT), ``memory_pool``
(cudaMallocAsync pools) and ``metrics``.
"""
