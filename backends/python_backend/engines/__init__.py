"""Inference engines behind one interface (``base.Engine``): ``onnxruntime`` (CPU), ``tensorrt`` (a plan on
the GPU) and ``torch`` (the export's TorchScript trace on the GPU or CPU).

Each module imports its heavy dependency when an engine is made, so importing this package needs none.
"""
