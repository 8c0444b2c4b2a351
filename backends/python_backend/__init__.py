"""The code that runs inside Triton's Python backend.

This package is copied into every model version folder as ``mf_backend/`` and
imported by the stub there, so it uses only relative imports among itself and
imports nothing else from ``model_factory``. Heavy dependencies (onnxruntime,
tokenizers, tensorrt, cuda, onnx) are imported where used.

At the top, what Triton calls and what every room shares:
``model`` (Triton's entry points for encoders, thin) and ``generate_model`` (the decoupled
text-generation model: engine loop, response thread); ``contract`` (the model parameters packaging
writes and this backend reads, and the version folder's file names: one definition for both sides,
standard library only); ``settings`` (those parameters parsed once); ``integrity`` (every file a load
reads checked against the digests ``serve`` verified).

The rooms, each saying in its ``__init__`` what it owns; arrows run from the entry points down,
and a room imports only the rooms below it (``tests/test_import_graph.py`` checks it):

    generation/   continuous batching, KV cache, sampling, the INT8 attention kernel
    operations/   metrics, events, tracing, shadow, degrade, sandbox, orphan watch
    engines/      ONNX Runtime, TensorRT, torch; loading a version's engine
    batching/     the encoders' windows, grouping, cost model, idle cores, deferred responses
    requests/     a request's inputs decoded and checked, bounds, long inputs, tokenizer
    memory/       the device memory pool and guard
"""
