"""AWQ-style scaling: folded exactly (the FP32 model is unchanged) and never worse than plain rounding."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["llama", "gemma", "phi3", "gemma2", "gemma3_text", "granite", "phi", "nemotron",
                                    "ernie4_5"])
def test_scales_fold_exactly_and_lower_the_rounding_error(tmp_path, family):
    from generative_models import make_causal_lm

    from model_factory.build_engines.awq import search_scales

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = make_causal_lm(family, tmp_path / family, vocab_size=512)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model.eval()
    ids = torch.randint(0, 512, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    chosen = search_scales(model, family, [ids[0].tolist()], block=32)
    with torch.no_grad():
        after = model(ids).logits
    assert torch.allclose(before, after, atol=2e-4, rtol=1e-4)  # an exact fold, up to float rounding
    # q/k/v, gate/up and down in a gated MLP; Phi's one norm feeds q/k/v and fc1 (no group for fc2), Nemotron's
    # down_proj reads relu²(up): no exact fold there
    per_layer = {"phi": 1, "nemotron": 2}.get(family, 3)
    assert len(chosen) == per_layer * model.config.num_hidden_layers
    assert all(c.error_scaled <= c.error_rtn for c in chosen)
    assert all(0.0 <= c.alpha <= 1.0 for c in chosen)


def test_fake_quant_is_symmetric_block_rounding():
    from model_factory.build_engines.awq import fake_quant

    w = torch.tensor([[1.0, -0.5, 0.25, 7.0] * 8])
    q = fake_quant(w, block=32)
    assert torch.allclose(q.abs().max(), torch.tensor(7.0))
    assert len(torch.unique(q)) <= 16


@pytest.mark.parametrize("family,norms", [
    ("llama", {"input_layernorm": 3, "post_attention_layernorm": 2}),
    ("gemma3_text", {"input_layernorm": 3, "pre_feedforward_layernorm": 2}),  # post_attention_layernorm feeds no linear
    ("phi3", {"input_layernorm": 1, "post_attention_layernorm": 1})])
def test_groups_are_read_from_the_module_graph(tmp_path, family, norms):
    """Each group's norm is the one whose output the projections read, whatever its name (Gemma 2/3's MLP reads
    pre_feedforward_layernorm), and its weight's form is found on it (Gemma's 1 + w)."""
    from generative_models import make_causal_lm

    from model_factory.build_engines.awq import _norm_form, find_groups

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = transformers.AutoModelForCausalLM.from_pretrained(make_causal_lm(family, tmp_path / family, vocab_size=512))
    layer = model.model.layers[0]
    seen = {}
    layer.register_forward_pre_hook(lambda _m, a, k: seen.setdefault("s", (a, k)), with_kwargs=True)
    with torch.no_grad():
        model(torch.randint(0, 512, (1, 12)), use_cache=False)
    groups = find_groups(layer, seen["s"])
    assert {g.name: len(g.linears) for g in groups} == {**norms, "down": 1}
    x = torch.randn(3, model.config.hidden_size)
    assert _norm_form(layer.input_layernorm, x) == ("1+w" if family.startswith("gemma") else "w")
