"""A GGUF's blocks read as MatMulNBits' terms (build_engines/gguf_blocks.py), held to gguf-py's own dequantization."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from model_factory.build_engines.gguf_blocks import dequantize, read_blocks, split_blocks, to_uint8  # noqa: E402


def _quantized(kind: str, rows: int = 24, cols: int = 256, seed: int = 0):
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    raw = gguf.quants.quantize(w, qtype)
    return raw, gguf.quants.dequantize(raw, qtype).reshape(rows, cols)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q5_0"])
def test_integer_zero_point_types_are_exact_in_both_forms(kind):
    raw, ref = _quantized(kind)
    blocks = read_blocks(kind, raw, *ref.shape)
    assert blocks.integer_zero_points and blocks.block == 32
    assert np.array_equal(dequantize(blocks), ref)
    codes, scales, zps = to_uint8(blocks)  # the 8-bit form: the same values, byte for byte
    assert np.array_equal(((codes.astype(np.float32) - zps[..., None]) * scales[..., None]).reshape(ref.shape), ref)


def test_q8_0_codes_and_scales_are_the_blocks_bytes():
    raw, ref = _quantized("Q8_0", rows=2, cols=64)
    blocks = read_blocks("Q8_0", raw, 2, 64)
    first = raw.reshape(-1, 34)[0]
    assert np.array_equal(blocks.codes[0, 0], (first[2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8))
    assert blocks.scales[0, 0] == np.float32(first[:2].view(np.float16)[0]) and blocks.zero_points[0, 0] == 128


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_1"])
def test_min_types_are_exact_with_a_float_zero_point_and_close_in_8_bits(kind):
    raw, ref = _quantized(kind)
    blocks = read_blocks(kind, raw, *ref.shape)
    assert not blocks.integer_zero_points
    assert np.abs(dequantize(blocks) - ref).max() <= 1e-6 * np.abs(ref).max()
    codes, scales, zps = to_uint8(blocks)
    got = ((codes.astype(np.float32) - zps[..., None].astype(np.float32)) * scales[..., None]).reshape(ref.shape)
    step = np.repeat(blocks.scales, 32, axis=1)  # the type's own step per weight
    bound = 1 / 32 if kind == "Q4_1" else 1 / 16  # k >= 16 (4-bit codes) or 8 (5-bit): error <= step/(2k)
    assert np.all(np.abs(got - ref) <= bound * step + 1e-6)


def test_split_blocks_keeps_the_values():
    raw, ref = _quantized("Q8_0")
    assert np.array_equal(dequantize(split_blocks(read_blocks("Q8_0", raw, *ref.shape), 16)), ref)


def test_k_quants_of_the_real_gemma_gguf_are_exact():
    """Q4_K / Q6_K (gguf-py writes no K-quants): the Gemma 3 270M file's own tensors, where it is installed."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gemma3_model import PACKAGE, available

    if available() is not None:
        pytest.skip(available())
    import importlib
    import tempfile

    pkg = importlib.import_module(PACKAGE)
    with tempfile.TemporaryDirectory() as tmp:
        reader = gguf.GGUFReader(str(pkg.assemble(Path(tmp) / pkg.MODEL_NAME)))
        seen = set()
        for t in reader.tensors:
            kind = t.tensor_type.name
            if kind in ("Q4_K", "Q6_K", "Q5_0", "Q8_0") and kind not in seen:
                seen.add(kind)
                cols, rows = int(t.shape[0]), int(t.shape[1])
                ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(rows, cols)
                got = dequantize(read_blocks(kind, t.data, rows, cols))
                assert np.abs(got - ref).max() <= 1e-6 * np.abs(ref).max(), kind
        del reader
    assert {"Q4_K", "Q6_K"} <= seen
