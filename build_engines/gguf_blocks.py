"""A GGUF tensor's quantized blocks read as MatMulNBits' terms: codes, a scale and a zero point per block.

llama.cpp's block types (``ggml-common.h``; gguf-py's ``gguf.quants`` dequantizes them) all dequantize as
``scale * (code - zero_point)`` per block of a row, which is MatMulNBits' own formula. Read without going through
float, each type's blocks become ``(codes, scales, zero_points)`` exactly:

| type | block | code bits | value | here |
| --- | --- | --- | --- | --- |
| Q8_0 | 32 | 8 (int8) | d·q | code q+128, zero point 128, scale d |
| Q4_0 | 32 | 4 | d·(q−8) | code q, zero point 8 |
| Q5_0 | 32 | 5 | d·(q−16) | code q, zero point 16 |
| Q6_K | 16 (of 256) | 6 | d·sc·(q−32) | code q, zero point 32, scale d·sc (sc int8) |
| Q4_1 / Q5_1 | 32 | 4 / 5 | d·q + m | zero point −m/d (a float) |
| Q4_K / Q5_K | 32 (of 256) | 4 / 5 | d·sc·q − dmin·m | scale d·sc, zero point dmin·m/(d·sc) (a float) |

A float zero point is exact only where MatMulNBits takes one: ONNX Runtime 1.32's CPU kernel does at 4 bits and
refuses it at 8 (``matmul_nbits.cc``: "does not support 8-bit weights with floating-point zero points"), so the
min types are exact in the 4-bit form alone; in the 8-bit form their zero point is rounded (:func:`to_uint8`).

:func:`dequantize` recomputes the values from these terms as MatMulNBits does; the tests hold it to
``gguf.quants.dequantize``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256
# The block types carried, with (block, code bits, exact integer zero point or None for a float one).
CARRIED = {"Q8_0": (32, 8, 128), "Q4_0": (32, 4, 8), "Q5_0": (32, 5, 16), "Q6_K": (16, 6, 32),
           "Q4_1": (32, 4, None), "Q5_1": (32, 5, None), "Q4_K": (32, 4, None), "Q5_K": (32, 5, None)}
FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class Blocks:
    """One weight (``rows`` outputs × ``cols`` inputs) as MatMulNBits' terms: value = scale·(code − zero point).

    ``codes`` [rows, blocks, block] (uint8), ``scales`` [rows, blocks] (float32), ``zero_points`` [rows, blocks]
    (float32: whole numbers where the type's zero point is one, ``integer_zero_points`` then)."""

    gguf_type: str
    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray
    code_bits: int
    integer_zero_points: bool

    @property
    def block(self) -> int:
        return int(self.codes.shape[2])

    @property
    def rows(self) -> int:
        return int(self.codes.shape[0])


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, n: int) -> np.ndarray:
    """Q4_0/Q5_0's ``qs[16]`` per block of 32: element j in the low nibble of byte j, element j+16 in its high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, 32)


def _fifth_bit(qh: np.ndarray, n: int) -> np.ndarray:
    bits = np.ascontiguousarray(qh).view(np.uint32).reshape(n, 1) >> np.arange(32, dtype=np.uint32).reshape(1, 32)
    return ((bits & 1).astype(np.uint8) << 4).reshape(n, 32)


def _safe_zero_points(scale: np.ndarray, offset: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """value = scale·code − offset as scale'·(code − zp): zp = offset/scale; a zero scale keeps scale 1, zp = offset
    (its codes are 0 then in llama.cpp's quantizers, so the value −offset is kept)."""
    zero = scale == 0
    s = np.where(zero, np.float32(1), scale).astype(np.float32)
    return s, (offset / s).astype(np.float32)


def read_blocks(gguf_type: str, raw: np.ndarray, rows: int, cols: int) -> Blocks:
    """A tensor's bytes (``rows`` × its row bytes, as ``gguf.GGUFReader`` gives them) as MatMulNBits' terms."""
    if gguf_type not in CARRIED:
        raise ValueError(f"no MatMulNBits form for {gguf_type}")
    block, bits, zp = CARRIED[gguf_type]
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1)
    if gguf_type in ("Q4_K", "Q5_K", "Q6_K"):
        n = rows * cols // QK_K
        b = raw.reshape(n, -1)
        if gguf_type == "Q6_K":
            ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], b[:, 208:210]
            low = np.concatenate([ql.reshape(n, 2, 1, 64) & 0x0F, ql.reshape(n, 2, 1, 64) >> 4], axis=2)
            high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
            codes = (low.reshape(n, 2, 4, 32) | (high << 4)).reshape(n, 16, 16)
            scales = _f16(d) * np.ascontiguousarray(sc).view(np.int8).astype(np.float32)
            zps = np.full(scales.shape, 32, np.float32)
        else:
            from gguf.quants import Q4_K

            d, dmin, sc_raw = _f16(b[:, 0:2]), _f16(b[:, 2:4]), b[:, 4:16]
            sc, m = Q4_K.get_scale_min(np.ascontiguousarray(sc_raw))
            qs = b[:, -128:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
            codes = (qs & 0x0F).reshape(n, 8, 32)
            if gguf_type == "Q5_K":
                qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
                codes = codes | ((qh & 1) << 4)
            scales, zps = _safe_zero_points(d * sc.astype(np.float32), dmin * m.astype(np.float32))
    else:
        n = rows * cols // 32
        b = raw.reshape(n, -1)
        d = _f16(b[:, 0:2])
        if gguf_type == "Q8_0":
            codes = (np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.int16) + 128).astype(np.uint8)
            scales, zps = d, np.full(d.shape, 128, np.float32)
        elif gguf_type == "Q4_0":
            codes, scales, zps = _nibbles(b[:, 2:], n), d, np.full(d.shape, 8, np.float32)
        elif gguf_type == "Q5_0":
            codes = _nibbles(b[:, 6:], n) | _fifth_bit(b[:, 2:6], n)
            scales, zps = d, np.full(d.shape, 16, np.float32)
        else:  # Q4_1, Q5_1: d·q + m
            m = _f16(b[:, 2:4])
            codes = _nibbles(b[:, 4:], n) if gguf_type == "Q4_1" else _nibbles(b[:, 8:], n) | _fifth_bit(b[:, 4:8], n)
            scales, zps = _safe_zero_points(d, -m)
    nb = cols // block
    return Blocks(gguf_type, codes.reshape(rows, nb, block).astype(np.uint8), scales.reshape(rows, nb).astype(np.float32),
                  zps.reshape(rows, nb).astype(np.float32), bits, zp is not None)


def dequantize(b: Blocks) -> np.ndarray:
    """The [rows, cols] float32 values MatMulNBits computes from these terms: (code − zero point) · scale."""
    return ((b.codes.astype(np.float32) - b.zero_points[..., None]) * b.scales[..., None]).reshape(b.rows, -1)


def split_blocks(b: Blocks, block: int) -> Blocks:
    """The same values in blocks of ``block`` (a divisor of the block): each scale and zero point repeated."""
    if block == b.block:
        return b
    k = b.block // block
    return Blocks(b.gguf_type, b.codes.reshape(b.rows, -1, block), np.repeat(b.scales, k, axis=1),
                  np.repeat(b.zero_points, k, axis=1), b.code_bits, b.integer_zero_points)


def to_uint8(b: Blocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """8-bit codes, scales and uint8 zero points for the same values.

    Exact for a type whose zero point is a whole number (the codes as they are). A float zero point (Q4_1, Q5_1,
    Q4_K, Q5_K) is rounded, after the codes are stretched by the largest whole k per block that keeps code and zero
    point within 0..255 (an offset added to both where the zero point is negative): the error is at most
    scale/(2k) per weight, 1/32 of the type's own step at 4 bits, 1/16 at 5."""
    if b.integer_zero_points:
        return b.codes, b.scales, b.zero_points.astype(np.uint8)
    top = (1 << b.code_bits) - 1
    zp = b.zero_points.astype(np.float64)
    best_k = np.ones(zp.shape, np.int64)
    best_o = np.zeros(zp.shape, np.int64)
    found = np.zeros(zp.shape, bool)
    for k in range(255 // top, 0, -1):
        o = np.maximum(0, np.ceil(-k * zp)).astype(np.int64)
        ok = ~found & (o + k * top <= 255) & (np.round(k * zp) + o <= 255)
        best_k, best_o, found = np.where(ok, k, best_k), np.where(ok, o, best_o), found | ok
    if not found.all():
        raise ValueError(f"{b.gguf_type}: a block's zero point {zp[~found].flat[0]:.4g} has no 8-bit form")
    codes = b.codes.astype(np.int64) * best_k[..., None] + best_o[..., None]
    zps = np.round(best_k * zp) + best_o
    return codes.astype(np.uint8), (b.scales / best_k).astype(np.float32), zps.astype(np.uint8)
