"""A real Triton server (the bundled one) on a packaged MiniLM repository, started once per module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def minilm_repository(minilm_recipe, minilm_export):
    """The FP32 MiniLM packaged into a repository (cost model measured at load, as in production)."""
    from model_factory.build.repository import package_model

    package_model(minilm_recipe, {"model.onnx": minilm_export.onnx_path}, tokenizer_dir=minilm_export.tokenizer_dir)
    return minilm_recipe.repository.path


@pytest.fixture(scope="session")
def triton(minilm_repository):
    """The running server; stopped (and its exit code checked by a test) at the end of the session."""
    from model_factory.serving.server import ServerOptions, TritonServer

    server = TritonServer(minilm_repository, options=ServerOptions(0, 0, 0)).start()
    yield server
    server.stop()
