"""Giving freed memory back to the system between build stages.

A build holds a model's weights several times over its life (the torch module, an exporter's
proto, ONNX Runtime sessions, TensorRT's builder); each stage frees what it no longer needs, but
glibc keeps freed heap memory for reuse and the next stage's peak then adds to it.
:func:`release_memory` collects garbage and asks glibc to return free pages (``malloc_trim``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from functools import lru_cache


@lru_cache(maxsize=1)
def _malloc_trim():  # noqa: ANN202 - a ctypes function or None
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


def release_memory() -> None:
    """Collect garbage, then return the heap's free pages to the system where the C library can."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
