"""Measurement the product ships: the Triton client helpers, the ``bench`` load generator and its
concurrency ``sweep``, and the release ``report`` (one self-contained HTML page per model version)."""
