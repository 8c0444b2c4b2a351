"""accept replays a text-generation model's golden continuations through the runtime served here."""

from __future__ import annotations

import json

from click.testing import CliRunner

from model_factory.serving.acceptance import accept_model
from model_factory.serving.generative_acceptance import agreement
from tests.generative_repository import layout_generative_model, write_continuations


def test_agreement_counts_up_to_each_near_tie():
    prompts = [{"tokens": [1, 2, 3, 4], "near_tie": None}, {"tokens": [5, 6, 7], "near_tie": 1}]
    assert agreement([[1, 2, 9, 4], [5, 0, 0]], prompts) == (3 / 5, 5)


def test_golden_continuations_pass_and_a_changed_one_fails_with_exit_1(tiny_llm, tmp_path):
    from model_factory.cli.main import main as cli

    hf, onnx_dir = tiny_llm
    repo = tmp_path / "repo"
    vdir = layout_generative_model(hf, onnx_dir, repo, "llm")
    data = write_continuations(vdir, hf, [[5, 6, 7], [9] * 20, list(range(30, 60))], max_tokens=12)
    result = accept_model(repo / "llm")
    assert result.passed, result.reason
    assert result.metric == "token_agreement" and result.score == 1.0 and result.samples == 3
    assert CliRunner().invoke(cli, ["accept", str(repo)]).exit_code == 0

    for p in data["prompts"]:  # the runtime now disagrees with every reference from the second token on
        p["tokens"][1:] = [(t + 1) % 2048 for t in p["tokens"][1:]]
        p["near_tie"] = None
    (vdir / "acceptance" / "continuations.json").write_text(json.dumps(data))
    result = accept_model(repo / "llm")
    assert not result.passed and "below the gate 0.99" in result.reason
    assert CliRunner().invoke(cli, ["accept", str(repo)]).exit_code == 1


def test_a_gpu_instance_is_accepted_where_it_loads_and_nowhere_else(tiny_llm, tmp_path):
    """A KIND_GPU text-generation model replays its continuations on the GPU as the backend loads it; on a machine
    where that does not load (this CPU-only one) it fails naming the fix, unless its recipe allows the CPU."""
    import pytest
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from model_factory.backend.memory.pool import cuda_device_count

    if cuda_device_count() > 0:
        pytest.skip("checks a GPU instance on a machine without a GPU")
    hf, onnx_dir = tiny_llm
    repo = tmp_path / "repo"
    vdir = layout_generative_model(hf, onnx_dir, repo, "llm")
    write_continuations(vdir, hf, [[5, 6, 7], list(range(30, 60))], max_tokens=8)
    config_file = repo / "llm" / "config.pbtxt"
    config = text_format.Parse(config_file.read_text(), model_config_pb2.ModelConfig())
    config.instance_group[0].kind = model_config_pb2.ModelInstanceGroup.KIND_GPU
    config_file.write_text(text_format.MessageToString(config))
    result = accept_model(repo / "llm")
    assert not result.passed and "does not load here (GPU instance)" in result.reason
    assert "cuda:0" in result.reason and "allow_cpu_fallback = true" in result.reason
    config.parameters["cpu_fallback"].string_value = "true"
    config_file.write_text(text_format.MessageToString(config))
    result = accept_model(repo / "llm")
    assert result.passed and result.device == "cpu", result.reason
