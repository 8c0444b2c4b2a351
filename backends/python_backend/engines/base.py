"""The one interface every inference engine offers the backend.

An engine runs one padded group at a time: ``run(feeds, profile)`` takes a batch
``{input name: array}`` (all inputs, padded to the group's longest) and the index
of the optimization profile that covers the group's length, and returns
``{output name: array}`` on the host, complete. Engines that take any shape
(ONNX Runtime) ignore ``profile``.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np


class EngineError(RuntimeError):
    """An engine cannot load or cannot run a group; the message says which and why."""


@runtime_checkable
class Engine(Protocol):
    """What the backend needs from an engine (ONNX Runtime, TensorRT)."""

    @property
    def input_names(self) -> Sequence[str]:
        """Names of the inputs ``run`` expects, in the model's order."""
        ...

    @property
    def output_names(self) -> Sequence[str]:
        """Names of the outputs ``run`` returns, in the model's order."""
        ...

    def run(self, feeds: dict[str, np.ndarray], profile: int = 0) -> dict[str, np.ndarray]:
        """Run one group; the arrays returned are on the host and safe to keep."""
        ...

    def close(self) -> None:
        """Release the engine's resources; the engine is unusable afterwards."""
        ...
