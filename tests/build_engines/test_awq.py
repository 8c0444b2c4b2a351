"""AWQ-style scaling: folded exactly (the FP32 model is unchanged) and never worse than plain rounding."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["llama", "gemma", "phi3"])
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
    assert len(chosen) == 3 * model.config.num_hidden_layers
    assert all(c.error_scaled <= c.error_rtn for c in chosen)
    assert all(0.0 <= c.alpha <= 1.0 for c in chosen)


def test_fake_quant_is_symmetric_block_rounding():
    from model_factory.build_engines.awq import fake_quant

    w = torch.tensor([[1.0, -0.5, 0.25, 7.0] * 8])
    q = fake_quant(w, block=32)
    assert torch.allclose(q.abs().max(), torch.tensor(7.0))
    assert len(torch.unique(q)) <= 16
