"""Which INT8 kernels the ONNX Runtime CPU engine runs here: ONNX Runtime's integer ones, or Q/DQ in float.

ONNX Runtime fuses an INT8 Q/DQ graph into integer kernels (``MatMulIntegerToFloat`` ...). On a CPU with
an integer dot-product instruction (x86: AVX-512 VNNI, AVX-VNNI, AMX-INT8; Arm: the dot-product ``asimddp``
or the matrix ``i8mm`` extension) they accumulate in 32 bits and ran MiniLM's INT8 model 1.6-1.8x faster
than FP32 within the accuracy gate. Without one (AVX2 only) the u8s8 path sums pairs into 16 bits and can
saturate, so there the graph keeps its Q/DQ pairs as float arithmetic (basic graph optimizations only): the
numbers the quantize gate scored, as TensorRT computes them.

The choice: ``auto`` (default: integer where the CPU has the instructions), ``integer`` or ``simulated``,
from the configuration parameter ``int8_kernels`` (recipe ``[repository] int8_kernels``), overridden by the
environment variable :data:`INT8_KERNELS_ENV` (``serve --int8-kernels``, which ``accept`` applies too).
"""

from __future__ import annotations

import os
from pathlib import Path

INT8_KERNELS = ("auto", "integer", "simulated")
INT8_KERNELS_ENV = "MODEL_FACTORY_INT8_KERNELS"
# /proc/cpuinfo flags (x86 "flags", Arm "Features") that give 32-bit integer dot products.
INTEGER_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8", "asimddp", "i8mm")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``); empty when unreadable."""
    flags: set[str] = set()
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return frozenset(flags)


def integer_dot_product(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The integer dot-product flags this CPU has (empty: none)."""
    have = cpu_flags() if flags is None else flags
    return tuple(f for f in INTEGER_DOT_FLAGS if f in have)


def choose_int8_kernels(requested: str = "auto", flags: frozenset[str] | None = None) -> tuple[str, str]:
    """``(kernels, why)``: ``integer`` or ``simulated`` for this CPU, and the reason, for the load log.

    The environment variable (``serve --int8-kernels``) wins over ``requested`` (the configuration's).
    """
    forced = os.environ.get(INT8_KERNELS_ENV, "").strip().lower()
    if forced and forced != "auto":
        if forced not in INT8_KERNELS:
            raise ValueError(f"{INT8_KERNELS_ENV}={forced!r}: use {', '.join(INT8_KERNELS)}")
        return forced, f"forced by {INT8_KERNELS_ENV}={forced}"
    if requested not in INT8_KERNELS:
        raise ValueError(f"int8_kernels={requested!r}: use {', '.join(INT8_KERNELS)}")
    if requested != "auto":
        return requested, f"int8_kernels = {requested} in the model configuration"
    found = integer_dot_product(flags)
    if found:
        return "integer", f"the CPU has integer dot products ({', '.join(found)})"
    return "simulated", ("no integer dot-product instruction (VNNI/AMX/asimddp/i8mm) on this CPU: ONNX Runtime's "
                         "int8 kernels may saturate here, so Q/DQ runs in float, which is not faster than FP32 "
                         "(MiniLM: 0.6-1.0x FP32, benchmarks/RESULTS.md): serve fp32 on this CPU for speed")
