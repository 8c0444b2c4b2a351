"""Fixtures for the quantize / accuracy / engine tests.

The FP32 export comes from the session fixture ``minilm_export`` (tests/conftest.py);
quantizing it (FP16 + INT8 with the mixed-precision search, about a minute on two
cores) and compiling its engines happen once per session here.
"""

from __future__ import annotations

import pytest

from precision_helpers import minilm_precision_recipe, tiny_model


@pytest.fixture(scope="session")
def precision_recipe(tmp_path_factory):
    return minilm_precision_recipe(tmp_path_factory.mktemp("precision"))


@pytest.fixture(scope="session")
def quantized(precision_recipe, minilm_export):
    """FP16 and INT8 MiniLM (INT8 with the mixed-precision search), scored on held-out sentences."""
    from model_factory.build_engines.quantize import quantize_model

    return quantize_model(precision_recipe, minilm_export)


@pytest.fixture(scope="session")
def tensorrt_flavour():
    from model_factory.build_engines.tensorrt import tensorrt_available

    flavour = tensorrt_available()
    if flavour is None:
        pytest.skip("neither tensorrt nor tensorrt_rtx is installed (pip install 'model-factory[tensorrt-rtx]')")
    return flavour


@pytest.fixture(scope="session")
def engines(precision_recipe, quantized, tensorrt_flavour):
    """Real FP32/FP16/INT8 plans compiled from the quantized models (ahead of time on a CPU machine)."""
    from model_factory.build_engines.tensorrt import build_engines

    return build_engines(precision_recipe, quantized.models)


@pytest.fixture()
def tiny():
    return tiny_model()
