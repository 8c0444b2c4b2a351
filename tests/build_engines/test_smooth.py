"""Smoothing down_proj's input for dynamic INT8: an exact fold in the FP32 graph, found only where the MLP is gated."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytest.importorskip("torch")
pytest.importorskip("onnxruntime_genai")


def _fp32(tmp_path: Path, family: str) -> tuple[Path, Path]:
    from generative_models import make_causal_lm

    from model_factory.build_engines.causal_lm import run_builder

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src = make_causal_lm(family, tmp_path / family, vocab_size=512)
    return src, run_builder(src, tmp_path / f"{family}-fp32", "fp32")


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "phi3"])
def test_the_smoothed_fp32_graph_answers_as_the_original(tmp_path, family):
    """Each layer's scale goes into up_proj's columns and down_proj's rows: the logits are the original's up to float
    rounding, though the weights moved and the simulated INT8 error of down_proj fell."""
    import onnx
    from onnx import numpy_helper

    from model_factory.build_engines.smooth import down_folds, logits_drift, smoothed_fp32

    src, fp32 = _fp32(tmp_path, family)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 512, 48).tolist() for _ in range(3)]
    graph, chosen = smoothed_fp32(src, fp32, tmp_path / "smoothed", batches, 16)
    layers = onnx.load(str(fp32), load_external_data=False)
    folds, why = down_folds(layers)
    assert why == "" and sorted(folds) == [0, 1]  # the tiny models' two layers
    assert [c.layer for c in chosen] == [0, 1]
    assert all(c.error_after <= c.error_before for c in chosen)
    scaled = [c for c in chosen if c.alpha is not None]
    assert scaled and all(c.error_after < c.error_before for c in scaled)
    before = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(fp32)).graph.initializer}
    after = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(graph)).graph.initializer}
    fold = folds[scaled[0].layer]
    s = after[fold.down_weight][:, 0] / before[fold.down_weight][:, 0]
    assert not np.allclose(s, 1.0)
    np.testing.assert_allclose(after[fold.up_weight] * s[None, :], before[fold.up_weight], rtol=1e-5, atol=1e-7)
    assert logits_drift(fp32, graph, 16, batches[1]) < 1e-4  # a sample the identity check did not read


@pytest.mark.parametrize("family", ["gpt2", "nemotron"])
def test_an_mlp_that_is_not_gated_has_no_smoothed_step(tmp_path, family):
    """GPT-2's act(fc1) -> fc2 and Nemotron's relu²(up) -> down: no exact fold, said by name."""
    from model_factory.build_engines.smooth import smoothable

    _src, fp32 = _fp32(tmp_path, family)
    why = smoothable(fp32)
    assert why and ("not a gated MLP" in why or "not foldable" in why)


def test_a_smoothed_result_is_recorded_apart_from_the_float_matmuls():
    from model_factory.build_engines.lm_quantize import GenerativeAccuracy, GenerativeResult

    row = GenerativeResult("int8", "dynamic", 0.95, 27.0, 25.0, 1.08, 0.5, 26, 256, True, smoothed=("down_proj",),
                           per_row=("down_proj",))
    d = json.loads(json.dumps(row.row()))  # as accuracy.json holds it
    assert d["smoothed"] == ["down_proj"] and d["per_row"] == ["down_proj"]
    assert d["float_matmuls"] == [] and d["float_nodes"] == []  # down_proj is in integers
    table = GenerativeAccuracy("m", "h", 26, "", "c", 32, 0.8, 1.1, (row,)).render(width=200)
    assert "smoothed: down_proj, per row: down_proj" in table
