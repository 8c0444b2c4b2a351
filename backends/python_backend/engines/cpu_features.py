"""Which INT8 kernels the ONNX Runtime CPU engine runs here, on which weights: integer, or Q/DQ in float.

ONNX Runtime fuses an INT8 Q/DQ graph into integer kernels (``MatMulIntegerToFloat`` ...). On a CPU with
an integer dot-product instruction (x86: AVX-512 VNNI, AVX-VNNI, AMX-INT8; Arm: the dot-product ``asimddp``
or the matrix ``i8mm`` extension) they accumulate in 32 bits and ran MiniLM's INT8 model 1.6-1.8x faster
than FP32 within the accuracy gate. Without one (AVX2 only) the u8 x s8 kernels add each pair of products
into a 16-bit sum that saturates with 8-bit weights (5 of 40 outputs of one MatMul off by up to 5.6 on an
AVX2-only EPYC): there integer kernels run only on the 7-bit weight form ``model.int8.w7.onnx``, where a pair
cannot exceed 16 bits (``build_engines/int8_7bit.py``; written by the build only when it passes the gate).

The choice (:func:`choose_int8_kernels`), from the configuration parameter ``int8_kernels`` (recipe
``[repository] int8_kernels``), overridden by the environment variable :data:`INT8_KERNELS_ENV`
(``serve --int8-kernels``, which ``accept`` applies too):

* ``auto`` (default): the fastest form that passed the gate on this CPU: integer on 8-bit weights where the CPU
  has dot products; elsewhere integer on the 7-bit form when the package has it; else the package's FP32 model
  (``model.onnx``, which packaging adds beside an INT8 model that has no 7-bit form), since Q/DQ simulated in
  float does FP32's arithmetic plus the Q/DQ's and is never faster than FP32; else (an older package with
  neither) Q/DQ simulated in float, and serve says FP32 is the faster choice.
* ``integer``: the same integer forms; on a CPU without dot products and no 7-bit form, refused with the
  reason (8-bit weights there would compute wrong values).
* ``integer-7bit``: integer kernels on the 7-bit form on any CPU (refused without the file).
* ``simulated``: Q/DQ as float arithmetic, as the quantize gate scored it and TensorRT computes it.

The 8-bit weights never meet integer kernels on a CPU without dot products.
"""

from __future__ import annotations

import os
from pathlib import Path

INT8_KERNELS = ("auto", "integer", "integer-7bit", "simulated")
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


class Int8Refused(ValueError):
    """Integer kernels asked for where only a form the package lacks would compute right."""


def choose_int8_kernels(requested: str = "auto", flags: frozenset[str] | None = None,
                        seven_bit: bool = False, fp32: bool = False) -> tuple[str, str, str]:
    """``(kernels, weights, why)``: ``integer``, ``simulated`` or ``fp32`` (no INT8 kernels: the package's FP32
    model); ``8-bit``, ``7-bit`` or ``fp32`` (the file to run); the reason, for the load log.

    ``seven_bit``: whether the package holds the 7-bit weight form (``model.int8.w7.onnx``); ``fp32``: whether it
    holds the FP32 model (``model.onnx``), which ``auto`` serves on a CPU without integer dot products when there
    is no 7-bit form (an explicit choice is never replaced by it). The environment
    variable (``serve --int8-kernels``) wins over ``requested`` (the configuration's). Raises
    :class:`Int8Refused` for integer kernels that would need a 7-bit form the package lacks, ValueError for an
    unknown choice.
    """
    forced = os.environ.get(INT8_KERNELS_ENV, "").strip().lower()
    if forced and forced != "auto":
        if forced not in INT8_KERNELS:
            raise ValueError(f"{INT8_KERNELS_ENV}={forced!r}: use {', '.join(INT8_KERNELS)}")
        choice, source = forced, f"forced by {INT8_KERNELS_ENV}={forced}"
    else:
        if requested not in INT8_KERNELS:
            raise ValueError(f"int8_kernels={requested!r}: use {', '.join(INT8_KERNELS)}")
        choice, source = requested, f"int8_kernels = {requested} in the model configuration"
    if choice == "simulated":
        return "simulated", "8-bit", source
    found = integer_dot_product(flags)
    missing = ("the package has no model.int8.w7.onnx (built before it existed, or its 7-bit weights missed the "
               "accuracy gate). Fix: serve --int8-kernels simulated (or auto), serve the model's fp32 build, or "
               "rebuild it")
    if choice == "integer-7bit":
        if not seven_bit:
            raise Int8Refused(f"integer kernels on 7-bit weights ({source}) refused: {missing}")
        return "integer", "7-bit", f"{source}: integer kernels on the 7-bit weights of model.int8.w7.onnx"
    if found:
        why = source if choice == "integer" else f"the CPU has integer dot products ({', '.join(found)})"
        return "integer", "8-bit", why
    if seven_bit:
        why = source if choice == "integer" else "no integer dot-product instruction (VNNI/AMX/asimddp/i8mm)"
        return "integer", "7-bit", (f"{why}: integer kernels on the 7-bit weights of model.int8.w7.onnx, whose "
                                    "16-bit pair sums cannot saturate (the build's gate scored them)")
    if choice == "auto" and fp32:
        return "fp32", "fp32", (
            "no integer dot-product instruction (VNNI/AMX/asimddp/i8mm) on this CPU and no 7-bit weight form in the "
            "package (its 7-bit weights missed the accuracy gate): ONNX Runtime's int8 kernels would saturate on 8-bit "
            "weights here, and Q/DQ simulated in float is FP32's arithmetic plus the Q/DQ's, so the FP32 model the "
            "package carries for this case (model.onnx) serves instead: the fastest form that passes here")
    if choice == "integer":
        raise Int8Refused(f"integer INT8 kernels ({source}) refused on this CPU: it has no integer dot-product "
                          "instruction (VNNI/AMX/asimddp/i8mm), so ONNX Runtime's kernels sum pairs into 16 bits and "
                          f"saturate on 8-bit weights (wrong outputs), and {missing}")
    return "simulated", "8-bit", (
        "no integer dot-product instruction (VNNI/AMX/asimddp/i8mm) on this CPU and no 7-bit weight form in the "
        "package: ONNX Runtime's int8 kernels would saturate on 8-bit weights here, so Q/DQ runs in float, which is "
        "not faster than FP32 (MiniLM: 0.6-1.0x FP32, benchmarks/RESULTS.md): serve fp32 on this CPU for speed")
