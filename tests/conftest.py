"""Shared fixtures: the MiniLM recipe, its ONNX export and a packaged repository (built once per session)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

EXAMPLE = Path(__file__).resolve().parents[1] / "model_factory" / "examples" / "minilm.toml"


def has_gpu() -> bool:
    """True when an NVIDIA GPU is visible (GPU tests skip otherwise)."""
    return Path("/dev/nvidia0").exists()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU; run benchmarks/gpu_checks.sh on a GPU machine")
    if not has_gpu():
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def minilm_recipe(tmp_path_factory):
    """The shipped MiniLM recipe, with its repository in a temporary folder (FP32 only)."""
    from model_factory.recipe import load_recipe

    root = tmp_path_factory.mktemp("minilm")
    return load_recipe(EXAMPLE, {"repository.path": str(root / "model_repository"), "precisions": ["fp32"]})


@pytest.fixture(scope="session")
def minilm_export(minilm_recipe):
    """The FP32 ONNX export of MiniLM (about 15 s, once per session)."""
    from model_factory.build_engines.export import export_model

    return export_model(minilm_recipe)
