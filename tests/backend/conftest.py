"""Make ``model_factory.backend`` importable before the project is installed.

pyproject maps ``backends/python_backend`` to ``model_factory.backend``. After
``pip install -e .`` the import just works; before that, this shim loads the folder
as that package (only if the normal import fails).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

_BACKEND = Path(__file__).resolve().parents[2] / "backends" / "python_backend"


def _load_backend_package() -> None:
    try:
        importlib.import_module("model_factory.backend")
        return
    except ImportError:
        pass
    import model_factory

    spec = importlib.util.spec_from_file_location(
        "model_factory.backend",
        _BACKEND / "__init__.py",
        submodule_search_locations=[str(_BACKEND)],
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["model_factory.backend"] = module
    spec.loader.exec_module(module)
    model_factory.backend = module  # type: ignore[attr-defined]


_load_backend_package()


@pytest.fixture
def cuda_device() -> int:
    """Device 0, or skip the test with the reason when there is no CUDA device."""
    from model_factory.backend.memory.pool import cuda_device_count

    if cuda_device_count() < 1:
        pytest.skip("needs a CUDA device (cuda-bindings installed and a driver with a GPU)")
    return 0


@pytest.fixture(scope="session")
def tiny_llm_int8_cache(tiny_llm, tmp_path_factory):
    """tiny_llm's FP32 graph with its KV cache in INT8 (scales fitted on three prompts): FP32 weights, so outputs
    are batch-independent and two attention kernels (or KV layouts) differ by float rounding alone. Read-only."""
    import shutil

    import numpy as np

    from model_factory.build_engines.kv_int8 import fit_kv_scales, quantize_kv_cache

    _hf, onnx_dir = tiny_llm
    folder = tmp_path_factory.mktemp("kv8") / "g"
    shutil.copytree(onnx_dir, folder)
    rng = np.random.default_rng(1)
    quantize_kv_cache(folder / "model.onnx",
                      fit_kv_scales(onnx_dir / "model.onnx", 16, [rng.integers(3, 2000, n).tolist() for n in (5, 17, 40)]))
    return folder / "model.onnx"
