"""The builds a text-generation precision tries (the gate's ladder) and the builder options each gets."""

from __future__ import annotations

from model_factory.build_engines.lm_quantize import ACCURACY_LEVEL, _builder_options, _ladder, uses_blockwise, wide_head


def test_int8_weight_only_quantizes_activations_per_block_in_the_kernel():
    """Level 1 (float activations) made ONNX Runtime dequantize every 8-bit weight each call: 20x slower than FP32."""
    assert ACCURACY_LEVEL["int8"] == 4 and _builder_options("int8", "weight_only", 32, ())["accuracy_level"] == 4


def test_a_large_vocabulary_keeps_the_int4_lm_head_at_8_bits_from_the_first_build():
    gemma3 = {"model_type": "gemma3_text", "vocab_size": 262144, "tie_word_embeddings": True}
    assert wide_head("int4", gemma3) and not wide_head("int8", gemma3)
    assert not wide_head("int4", {"model_type": "llama", "vocab_size": 32000})
    assert _ladder("int4", "awq", True, True, head8=True) == [
        ("awq", ("last_matmul:int8",)), ("awq", ("last_matmul:int8", "mixed_layers:int8"))]
    assert _ladder("int4", "rtn", False, True, head8=True) == [("rtn", ("last_matmul:int8",))]
    tied = _builder_options("int4", "awq", 32, ("last_matmul:int8",), tied=True)
    # the head at 8 bits cannot share the embedding's 4-bit table: the embedding gets one of its own
    assert tied["shared_embeddings"] == "false" and tied["op_types_to_quantize"] == "MatMul/Gather"
    assert "shared_embeddings" not in _builder_options("int4", "awq", 32, ("last_matmul:int8",), tied=False)


def test_int4_is_written_by_the_factory_unless_asked_symmetric():
    """rtn and awq go through lm_blockwise (zero points, searched scales); int4_symmetric, k_quant and GPT-2 (its
    Conv1D are Gemms) keep the builder's quantizer."""
    assert uses_blockwise("int4", "awq", False, "gemma3_text") and uses_blockwise("int4", "rtn", False, "llama")
    assert not uses_blockwise("int4", "awq", True, "llama")
    assert not uses_blockwise("int4", "k_quant", False, "llama")
    assert not uses_blockwise("int4", "rtn", False, "gpt2")
    assert not uses_blockwise("int8", "weight_only", False, "llama")
    # its embedding gets an 8-bit table of its own, so a tied model's head alone can go to 8 bits (the stage passes
    # tied=False to the ladder for it)
    assert _ladder("int4", "awq", True, False) == [
        ("awq", ()), ("awq", ("last_matmul:int8",)), ("awq", ("last_matmul:int8", "mixed_layers:int8"))]


def test_dynamic_int8_scales_down_per_row_then_smooths_then_keeps_down_then_o_in_float_then_weight_only():
    """On Gemma 3 270M all-INT8 dynamic missed the gate (perplexity ratio 1.29) and down_proj in float passed it
    (1.0998); down_proj's activations scaled per row and per 256 inputs (row_int8.py) passed it too (1.081), and is
    tried first, then the same with its input smoothed (build_engines/smooth.py), before down_proj goes to float."""
    from model_factory.build_engines.row_int8 import ROW_DOWN
    from model_factory.build_engines.smooth import SMOOTH_DOWN

    assert _ladder("int8", "dynamic", True, True) == [
        ("dynamic", ()), ("dynamic", (ROW_DOWN,)), ("dynamic", (SMOOTH_DOWN, ROW_DOWN)), ("dynamic", ("down_proj",)),
        ("dynamic", ("down_proj", "o_proj")), ("weight_only", ())]
    # no gated MLP (or no calibration text): no smoothed step
    assert _ladder("int8", "dynamic", True, True, smooth=False) == [
        ("dynamic", ()), ("dynamic", (ROW_DOWN,)), ("dynamic", ("down_proj",)), ("dynamic", ("down_proj", "o_proj")),
        ("weight_only", ())]
    assert _ladder("int8", "dynamic", False, True) == [("dynamic", ())]


def test_a_small_tied_vocabulary_keeps_the_shared_4_bit_table():
    assert _ladder("int4", "rtn", True, True) == [("rtn", ()), ("rtn", ("mixed_layers:int8",))]


def test_the_gate_times_each_precision_beside_fp32(tmp_path):
    """The gate table's tokens/s: one stream decoding on the build machine and one launch of 32 streams, FP32 timed
    beside each; kept out of accuracy.json."""
    import os
    import sys
    from pathlib import Path

    import pytest

    pytest.importorskip("onnxruntime_genai")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from generative_models import make_causal_lm

    from model_factory.build_engines.causal_lm import Continuation, run_builder
    from model_factory.build_engines.lm_quantize import GenerativeAccuracy, GenerativeResult, Scorer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src = make_causal_lm("llama", tmp_path / "llama", vocab_size=512)
    fp32 = run_builder(src, tmp_path / "fp32", "fp32")
    int4 = run_builder(src, tmp_path / "int4", "int4", {"block_size": 32, "accuracy_level": 4})
    reference = [Continuation("x", (1, 2, 3, 4), tuple(range(5, 21)), None)]
    scorer = Scorer(fp32, 16, [list(range(1, 40))], reference)
    speed, speed_fp32, many, many_fp32 = scorer.speed(int4)
    assert speed > 0 and speed_fp32 > 0 and many > 0 and many_fp32 > 0
    row = GenerativeResult("int4", "rtn", 1.0, 2.0, 2.0, 1.0, 0.0, 1, 16, True, tokens_per_s=speed,
                           tokens_per_s_fp32=speed_fp32, tokens_per_s_rows=many, tokens_per_s_rows_fp32=many_fp32)
    table = GenerativeAccuracy("m", "h", 1, "", None, 0, 0.8, 1.1, (row,)).render(width=200)
    assert f"{speed:.1f} (fp32 {speed_fp32:.1f}); 32 streams {many:.0f} (fp32 {many_fp32:.0f})" in table
    assert not {"tokens_per_s", "tokens_per_s_rows", "tokens_per_s_rows_fp32"} & set(row.row())  # not signed
