"""The two exception types of model-factory.

``FactoryError`` is the one user-facing error: bad input, a missing file, a
missing optional dependency, a failed gate. Its message names the problem and
the fix, and the CLI prints it without a traceback. Anything else that escapes
is a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class FactoryError(Exception):
    """A problem the user can fix; the message says what and how."""


class InternalError(Exception):
    """A broken invariant inside model-factory (a bug, not bad input)."""


def require(module: str, extra: str) -> ModuleType:
    """Import an optional dependency, or raise a FactoryError naming the pip extra.

    Used at the point of use, never at module import time, so the base package
    imports without torch, onnxruntime, tensorrt or CUDA.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise FactoryError(
            f"{module!r} is not installed ({exc}). Install it with: "
            f"pip install 'model-factory[{extra}]'"
        ) from exc
