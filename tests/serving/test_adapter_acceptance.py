"""``accept`` on a LoRA adapter entry (serving/adapter_acceptance.py): listed with the models, passed when the build's
gate passed and the repository holds its base version with the bytes it was built on, failed with the reason
otherwise (another base under the same name and version, a gate that did not pass)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from model_factory.serving.acceptance import accept_repository, render


@pytest.fixture
def repo(tmp_path):
    from model_factory.backend.lora_contract import ADAPTER_SPEC, ADAPTER_WEIGHTS, AdapterSpec
    from model_factory.build_engines.lora import base_digests

    repo = tmp_path / "repo"
    base = repo / "llm" / "1"
    base.mkdir(parents=True)
    (base / "model.onnx").write_bytes(b"the base's graph")
    (base / "generation.json").write_text('{"family": "llama"}')
    vdir = repo / "support" / "1"
    vdir.mkdir(parents=True)
    np.savez(vdir / ADAPTER_WEIGHTS, **{"m.A": np.ones((4, 2), np.float32), "m.B": np.ones((2, 4), np.float32)})
    spec = AdapterSpec("support", 1, "llm", 1, base_digests(base), 2, ("m",), (vdir / ADAPTER_WEIGHTS).stat().st_size)
    (vdir / ADAPTER_SPEC).write_text(spec.to_json())
    (vdir / "accuracy.json").write_text(json.dumps({"gate": {"perplexity_ratio": 1.0004, "max_perplexity_ratio": 1.01,
                                                             "tokens": 512, "passed": True}}))
    return repo


def test_an_adapter_on_its_base_is_accepted_with_its_gate(repo) -> None:
    (result,) = accept_repository(repo, "support")
    assert result.passed and result.version == "1" and result.score == pytest.approx(1.0004)
    assert result.threshold == 1.01 and result.engine == "adapter of llm version 1" and result.samples == 512
    assert "support" in render([result])


def test_an_adapter_on_another_base_or_below_its_gate_fails_with_the_reason(repo) -> None:
    (repo / "llm" / "1" / "model.onnx").write_bytes(b"another base's graph")
    (result,) = accept_repository(repo, "support")
    assert not result.passed and "whose model.onnx differs" in result.reason and "another base" in result.reason
    (repo / "llm" / "1" / "model.onnx").write_bytes(b"the base's graph")
    accuracy = repo / "support" / "1" / "accuracy.json"
    accuracy.write_text(json.dumps({"gate": {"perplexity_ratio": 1.2, "max_perplexity_ratio": 1.01, "passed": False}}))
    (result,) = accept_repository(repo, "support")
    assert not result.passed and "gate" in result.reason and result.score == pytest.approx(1.2)
