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
