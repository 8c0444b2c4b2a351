"""A user's own local Hugging Face encoder folder: recipe → `model-factory build` → served → answered."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

pytestmark = pytest.mark.integration

HELDOUT = Path(__file__).resolve().parents[2] / "model_factory" / "examples" / "heldout.txt"


@pytest.fixture(scope="module")
def tiny_bert_folder(tmp_path_factory, minilm_recipe) -> Path:
    """A small random BERT saved with save_pretrained(), with MiniLM's tokenizer files beside it."""
    import torch
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("own") / "tiny-bert"
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    BertModel(config).eval().save_pretrained(folder)
    src = minilm_recipe.source.path
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(src / name, folder / name)
    return folder


def test_own_hf_folder_builds_and_serves(tiny_bert_folder: Path, tmp_path: Path) -> None:
    from model_factory.cli.main import main
    from model_factory.measure.client import embed_texts
    from model_factory.serving.server import ServerOptions, start_verified_server

    recipe = tmp_path / "tiny.toml"
    recipe.write_text(f"""
[model]
name = "tiny-bert"
version = 3

[source]
kind = "huggingface"
path = "{tiny_bert_folder}"

[shapes]
max_batch = 8
max_sequence_length = 64
sequence_buckets = [16, 64]

[quantization]
heldout_data = "{HELDOUT}"
""")
    result = CliRunner().invoke(main, ["build", str(recipe)])
    assert result.exit_code == 0, result.output
    repo = tmp_path / "model_repository"
    assert (repo / "tiny-bert" / "3" / "model.onnx").is_file()
    # build wrote acceptance data from the held-out file; serve --accept replays it through the engine first.
    assert (repo / "tiny-bert" / "3" / "acceptance" / "outputs.json").is_file()
    server, report = start_verified_server(repo, ServerOptions(0, 0, 0), policy=None, allow_unsigned=True,
                                           accept=True)
    try:
        assert report.served == ("tiny-bert",) and report.refused == {}
        assert list(report.engines) == ["tiny-bert"]
        assert report.engines["tiny-bert"].startswith("onnxruntime (model.onnx) on cpu, ")
        emb = embed_texts(server.grpc_url, "tiny-bert", ["hello there", "a much longer sentence " * 10],
                          protocol="grpc")
        assert emb.shape == (2, 32)
        np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, rtol=1e-5)
    finally:
        assert server.stop() == 0


def test_serve_refuses_unverified_repository_without_a_policy(tmp_path: Path) -> None:
    from model_factory.cli.main import main

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text('name: "m"\n')
    result = CliRunner().invoke(main, ["serve", str(tmp_path)])
    assert result.exit_code != 0
    assert "refusing to serve without verification" in result.output and "--policy" in result.output
    assert "Traceback" not in result.output
