"""The torch engine behind the real Triton server: a tiny BERT built with export.torchscript = true (an
ExportedProgram, model.pt2), served with engine=torch on a CPU instance, answers match ONNX Runtime on the
same export, and the version accepts."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def torch_served(tmp_path_factory, minilm_recipe):
    """(server, version folder): the tiny BERT packaged by the pipeline and served with engine=torch."""
    from tiny_torch_models import save_tiny_bert

    from model_factory.build.pipeline import build
    from model_factory.recipe import parse_recipe
    from model_factory.serving.server import ServerOptions, TritonServer

    root = tmp_path_factory.mktemp("torch-served")
    folder = save_tiny_bert(root / "tiny-bert", minilm_recipe.source.path)
    recipe = parse_recipe({
        "model": {"name": "tiny-torch", "version": 1},
        "source": {"kind": "huggingface", "path": str(folder)},
        "export": {"torchscript": True},
        "shapes": {"max_batch": 8, "max_sequence_length": 64, "sequence_buckets": [16, 64]},
        "repository": {"path": str(root / "model_repository"), "instance_kind": "cpu"},
        # Held-out text for the acceptance data (the tiny BERT has MiniLM's tokenizer).
        "quantization": {"heldout_data": str(Path(__file__).resolve().parents[2] / "model_factory" / "examples"
                                             / "heldout.txt")},
    }, root)
    # A fixed cost model: nothing to measure at load, so the server is ready in a couple of seconds.
    result = build(recipe, parameters={"engine": "torch", "cost_model": "1e-4,1e-8,1e-11"})
    assert (result.version_dir / "model.pt2").is_file() and not (result.version_dir / "model.torchscript.pt").exists()
    server = TritonServer(recipe.repository.path, options=ServerOptions(0, 0, 0)).start()
    yield server, result.version_dir
    server.stop()


def test_engine_torch_answers_like_onnxruntime(torch_served) -> None:
    from model_factory.backend.engines.onnxruntime import OnnxRuntimeEngine
    from model_factory.measure.client import infer_ids

    server, version_dir = torch_served
    assert server.ready_models == ["tiny-torch"]
    log = server.log_file.read_text(errors="replace")
    assert "tiny-torch serves fp32 on torch (model.pt2)" in log, server.log_tail()
    assert "ExportedProgram on cpu" in log and "TorchScript" not in log
    ort = OnnxRuntimeEngine(version_dir / "model.onnx")
    rng = np.random.default_rng(0)
    requests = [rng.integers(1000, 30000, (1, n)) for n in (3, 17, 64, 9, 40, 1, 25, 12)]

    def ask(ids: np.ndarray) -> dict[str, np.ndarray]:
        return infer_ids(server.grpc_url, "tiny-torch", ids, np.ones_like(ids), protocol="grpc",
                         outputs=("embedding", "last_hidden_state"))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # mixed lengths in one window
        answers = list(pool.map(ask, requests))
    for ids, got in zip(requests, answers):
        want = ort.run({"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)})
        assert got["last_hidden_state"].shape == (1, ids.shape[1], 32)
        np.testing.assert_allclose(got["last_hidden_state"], want["last_hidden_state"], atol=1e-4)
        np.testing.assert_allclose(got["embedding"], want["embedding"], atol=1e-5)
    with pytest.raises(Exception):  # an id outside the vocabulary (30522, written by the package) fails alone
        ask(np.array([[5, 30522]]))
    assert ask(requests[0])["embedding"].shape == (1, 32)


def test_metadata_records_the_torch_engine(torch_served) -> None:
    import json

    _, version_dir = torch_served
    meta = json.loads(Path(version_dir / "metadata.json").read_text())
    assert meta["engines"] == ["model.pt2"] and "model.pt2" in meta["files"]
    assert meta["build"]["export"]["torchscript"]["file"] == "model.pt2"


def test_the_exported_program_accepts_on_the_cpu(torch_served) -> None:
    from model_factory.serving.acceptance import accept_model

    _, version_dir = torch_served
    result = accept_model(version_dir.parent)
    assert result.passed, result.reason
    assert (result.engine, result.file, result.device) == ("torch", "model.pt2", "cpu") and result.score > 0.9999
