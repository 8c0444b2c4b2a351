"""The sampler's draw compiled (``kernels/sampling.cc``), loaded with ctypes: the same draw as numpy's path in
``sampling.sample_token``, in two passes over a row instead of five or more.

Over Gemma 3's 262,144 tokens numpy's draw reads and writes the 1 MiB row five times (maximum, subtract, scale, exp,
the blocks' sums) and once more for each top-p check (what each draw costs a token: benchmarks/RESULTS.md, "sampling";
docs/generation.md, "The engine loop"). The kernel reads the row once for its blocks' maxima and once for the
blocks' sums of the weights in play, never storing the probabilities; top-k's candidates come from the maxima, and
top-p's check sums only the blocks that reach the drawn token's logit. The library is compiled on the host by
``int8_attention.library``'s rules (``g++ -O3 -march=native``, the same cache and ownership checks); where it cannot
be (no compiler, a CPU without AVX2) :func:`load` says why and the sampler keeps numpy's draw. Both draw exactly from
the same distribution (``tests/backend/test_sampling_draw.py`` checks each); a seeded stream's tokens agree between
them until a uniform lands within float rounding of a boundary, or top-p rejects a draw one of them judges at its edge.

ctypes releases the GIL for the call, so a draw does not hold other Python threads (the frontend, the cancel watch).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Callable

import numpy as np

SOURCE = Path(__file__).resolve().parent / "kernels" / "sampling.cc"
LIBRARY_NAME = "libmf_sampling.so"
BLOCK = 256  # tokens a block of the kernel's maxima (its kBlock; sampling.top_ids reads them in blocks of this)
_STATE = 5  # the kernel's kStateSize
MAX_REJECTIONS = 64  # top-p's draws before the most likely token is taken (a bound, not a figure ever reached)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why: str | None = None  # why the kernel is not used, once load failed
_local = threading.local()

_f32p = ctypes.c_void_p
_ARGS = (_f32p, ctypes.c_int64, ctypes.c_float, ctypes.c_int64, ctypes.c_double, ctypes.c_double, _f32p, _f32p,
         _f32p, _f32p)
_AGAIN_ARGS = (_f32p, ctypes.c_int64, ctypes.c_float, ctypes.c_double, ctypes.c_double, _f32p, _f32p, _f32p)


def load(isa: str = "native") -> str | None:
    """Compiles (first use on this host: a second or two, then cached) and loads the kernel; None when it is in use,
    else why not (the caller logs it; numpy's draw is kept). Called at the model's load, not on a request's path.
    ``isa`` "avx2": the AVX2 build on a host with AVX-512 too (a test checks it there)."""
    global _lib, _why
    with _lock:
        if _lib is not None or _why is not None:
            return _why
        from .int8_attention import KernelUnavailable, library

        try:
            lib = ctypes.CDLL(str(library(SOURCE, isa=isa, name=LIBRARY_NAME)))
        except (KernelUnavailable, OSError) as e:
            _why = f"the sampling kernel is not used ({e}): numpy's draw"
            return _why
        lib.mf_sample.argtypes = _ARGS
        lib.mf_sample.restype = ctypes.c_int64
        lib.mf_sample_again.argtypes = _AGAIN_ARGS
        lib.mf_sample_again.restype = ctypes.c_int64
        lib.mf_log_normalizer.argtypes = (_f32p, ctypes.c_int64, _f32p)
        lib.mf_log_normalizer.restype = ctypes.c_double
        _lib = lib
        return None


def loaded() -> bool:
    """Whether :func:`load` has loaded the kernel (the draw then uses it)."""
    return _lib is not None


def unload() -> None:
    """Back to numpy's draw (tests compare the two)."""
    global _lib, _why
    with _lock:
        _lib, _why = None, None


class _Scratch:
    """A thread's buffers for rows of up to ``size`` tokens, and their addresses."""

    def __init__(self, size: int) -> None:
        blocks = -(-size // BLOCK)
        self.size = size
        self.bmax = np.empty(blocks, dtype=np.float32)
        self.bsum = np.empty(blocks, dtype=np.float64)
        self.work = np.empty(size, dtype=np.float32)
        self.state = np.empty(_STATE, dtype=np.float64)
        self.pointers = (self.bmax.ctypes.data, self.bsum.ctypes.data, self.work.ctypes.data, self.state.ctypes.data)


def _scratch(size: int) -> _Scratch:
    s = getattr(_local, "scratch", None)
    if s is None or s.size < size:
        s = _local.scratch = _Scratch(size)
    return s


def draw(x: np.ndarray, temperature: float, top_k: int, top_p: float, uniform: Callable[[], float]) -> int | None:
    """``sampling.sample_token``'s draw on the kernel: the token, or None where nothing in ``x`` is finite (or a
    logit is NaN): the caller takes the argmax. ``x``: one contiguous float32 row."""
    lib = _lib
    n = x.size
    s = _scratch(n)
    bmax, bsum, work, state = s.pointers
    ptr = x.__array_interface__["data"][0]
    inv_temp = min(1.0 / temperature, 1e30)
    k = int(top_k) if top_k and top_k < n else 0
    token = lib.mf_sample(ptr, n, inv_temp, k, top_p, uniform(), bmax, bsum, work, state)
    rejections = 0
    while token == -2:
        rejections += 1
        if rejections >= MAX_REJECTIONS:
            return int(np.argmax(x))  # a bound, not a path taken: the most likely token is in every nucleus
        token = lib.mf_sample_again(ptr, n, inv_temp, top_p, uniform(), bmax, bsum, state)
    return None if token < 0 else int(token)


def log_normalizer(x: np.ndarray) -> tuple[float, np.ndarray]:
    """``log(sum(exp(x)))`` of one contiguous float32 row (NaN where no logit is finite, or one is NaN or +inf), and
    its 256-token blocks' maxima (for ``sampling.top_ids``; this thread's buffer, valid until its next call)."""
    s = _scratch(x.size)
    lse = _lib.mf_log_normalizer(x.__array_interface__["data"][0], x.size, s.pointers[0])
    return float(lse), s.bmax[:-(-x.size // BLOCK)]
