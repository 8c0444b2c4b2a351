"""Device memory: ``pool`` (cudaMallocAsync pools, TensorRT's async allocator, host/device copies) and
``guard`` (GPU groups split before launch when they would not fit).

Imports nothing of the package's: every other room may use it.
"""
