"""The families beyond the zoo's seven: each built by the exporter and checked token-identical to transformers.

A tiny random-weight model of each (tests/generative_models.py, ``MORE_FAMILIES``) in the form transformers 5 saves
it, exported FP32 with the builder and checked as the export stage checks (greedy tokens up to the first near-tie,
the logits' error relative to their scale). The whole build (quantize, package, serve) is the zoo's seven and the
real Gemma 3 270M (tests/build/test_gemma3.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# family -> make_causal_lm's sizes (partial rotary needs a rotary half that is a multiple of 8: head 64 at 0.5)
EXPORTED = {"gemma2": {}, "gemma3_text": {}, "granite": {}, "ernie4_5": {},
            "phi": {"hidden": 128, "heads": 2, "kv_heads": 2, "intermediate": 256},
            "nemotron": {"hidden": 128, "heads": 2, "kv_heads": 1, "intermediate": 256}}


def test_nested_rope_parameters_are_flattened_for_the_builder():
    from model_factory.build_engines.causal_lm import flatten_rope_for_builder

    cfg = SimpleNamespace(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    flatten_rope_for_builder(cfg)
    assert cfg.rope_parameters == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert cfg.rope_theta == 1e6 and cfg.rope_local_base_freq == 1e4
    flat = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert flatten_rope_for_builder(flat).rope_parameters == {"rope_type": "default", "rope_theta": 1e4}


def _export_check(folder: Path, out: Path) -> dict:
    from model_factory.build_engines import causal_lm as C
    from model_factory.build_engines.lm_graph import head_dim_of
    from model_factory.recipe.causal_lm import eos_token_ids

    cfg = json.loads((folder / "config.json").read_text())
    C.run_builder(folder, out, "fp32")
    model, tok = C.load_torch_model(folder)
    eos = eos_token_ids(folder, cfg)
    reference, prefill = C.torch_continuations(model, tok, C.SAMPLE_PROMPTS, eos)
    return C.check_graph(out / "model.onnx", head_dim_of(cfg), reference, prefill, eos)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(EXPORTED))
def test_each_family_exports_token_identical_to_transformers(tmp_path, family):
    pytest.importorskip("onnxruntime_genai")
    from generative_models import make_causal_lm

    from model_factory.recipe.causal_lm import FAMILIES

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    assert family in FAMILIES
    folder = make_causal_lm(family, tmp_path / family, **EXPORTED[family])
    check = _export_check(folder, tmp_path / "onnx")
    assert check["greedy_identical"], check["prompts"]
    assert check["relative_logits_error"] < 1e-3, check


@pytest.mark.slow
def test_gemma3_scaled_global_rope_keeps_the_local_layers_plain(tmp_path):
    """Gemma 3 (1B and up) scales its global layers' RoPE (linear, factor 8) and not its sliding ones'; the builder,
    given one flat rope_parameters, would scale both caches: each is rewritten from transformers' own."""
    pytest.importorskip("onnxruntime_genai")
    from generative_models import make_causal_lm

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = make_causal_lm("gemma3_text", tmp_path / "g3")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"]["full_attention"] = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    check = _export_check(folder, tmp_path / "onnx")
    assert check["greedy_identical"] and check["relative_logits_error"] < 1e-3, check


@pytest.mark.slow
def test_gemma3_in_transformers_4s_config_form_exports_too(tmp_path):
    """The 4.x form (rope_theta, rope_local_base_freq, sliding_window_pattern; no nested rope_parameters), as
    optimum-intel and older tools write it, builds and checks the same."""
    pytest.importorskip("onnxruntime_genai")
    from generative_models import make_causal_lm

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = make_causal_lm("gemma3_text", tmp_path / "g3")
    cfg = json.loads((folder / "config.json").read_text())
    for key in ("rope_parameters", "layer_types"):
        cfg.pop(key, None)
    cfg.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling=None, sliding_window_pattern=2)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    check = _export_check(folder, tmp_path / "onnx")
    assert check["greedy_identical"] and check["relative_logits_error"] < 1e-3, check
