"""Inference engines behind one interface (``base.Engine``) and how a version's engine is loaded.

``onnxruntime`` (CPU, or ONNX Runtime's CUDA provider), ``tensorrt`` (a plan on the GPU), ``torch`` (the
export's TorchScript trace on the GPU or CPU); ``loading`` (which engine a version serves with on this
instance, its bytes checked against the verified digests, the tokenizer and warm-up), ``cpu_features``
(the INT8 kernels this CPU runs right), ``quiet_start`` (a rollout's switch loads at the lowest priority).

Each engine module imports its heavy dependency when an engine is made, so importing this package needs
none. Imports: ``requests``, ``batching``, ``memory``.
"""
