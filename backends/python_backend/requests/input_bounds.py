"""The allowed values of a model's index-like inputs, and the check every request goes through.

An index-like input (token ids, token types, an attention mask, position ids, any integer tensor that
feeds an embedding lookup) has a closed range of allowed values ``[low, high]``. Packaging finds them
(the recipe's ``range``, the Hugging Face config, the ONNX graph's lookup tables) and writes them as one
model parameter, ``input_bounds``: a JSON object ``{"<input>": [low, high], ...}``. The backend parses it
once (:func:`parse_bounds`, in the contract) and refuses a request holding a value outside its input's range
(:func:`check_bounds`) before anything reaches an engine: ONNX Runtime would fail the whole window on an
index past a table (a 500), and a negative index would wrap to the end of the table (a wrong answer).

Standard library and numpy only: this module runs inside the Triton stub.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

# The parameter's writer and reader live in the contract (standard library only); re-exported for callers here.
from ..contract import BOUNDS_PARAMETER as PARAMETER  # noqa: F401
from ..contract import BoundsError, bounds_from_parameters, format_bounds, parse_bounds  # noqa: F401

Bounds = Mapping[str, tuple[int, int]]


def check_bounds(name: str, values: np.ndarray, bounds: Bounds) -> str | None:
    """None when every value of input ``name`` is inside its range (or it has none), else the message.

    The message names the input, the first offending position (row, then axes) and value, and the range.
    """
    limits = bounds.get(name)
    if limits is None or values.size == 0 or values.dtype.kind not in "iu":
        return None
    low, high = limits
    # Compare in int64/uint64 space without a cast that could wrap (a uint64 above 2**63, say).
    bad = (values < low) | (values > high)
    if not bad.any():
        return None
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    value = values[where]
    return (f"input '{name}' holds {int(value)} at position {list(where)}; allowed values are {low}..{high}"
            + (" (0 or 1)" if (low, high) == (0, 1) else ""))


def sample_value(name: str, bounds: Bounds, default: int = 1) -> int:
    """A value input ``name`` accepts, for warm-up feeds: ``default`` when inside its range, else its low end."""
    limits = bounds.get(name)
    if limits is None:
        return default
    low, high = limits
    return default if low <= default <= high else low
