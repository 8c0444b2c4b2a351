"""Dummy inputs built from the model's declared inputs, for the warm-up and the cost model.

Every engine input gets an array of its declared Triton dtype and dims (the batch
axis first): ``n`` rows, and ``length`` for each dynamic (``-1``) axis, so an image
CNN gets FP32 ``(n, 3, 64, 64)`` and an encoder INT64 ``(n, length)``. Values are
ones (a valid token id, a full attention mask, a finite float, ``True``), except where an integer
input's bounds (``input_bounds``) exclude 1: there its lowest allowed value (a token-type table of
one row takes only 0). An engine
input the configuration does not declare (BERT's ``token_type_ids`` on a model
served from text) is taken as token-shaped INT64 zeros, as requests fill it.

Pure numpy: this module is copied into the Triton model folder and runs inside
the Python-backend stub. The cost-model warm-up (``model.py``) calls
:func:`sample_feeds`; anything else that needs representative inputs should too.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .input_bounds import sample_value
from ..settings import Settings

# Triton's configuration dtypes, as numpy reads them in the stub (TYPE_STRING is text: never an engine input).
NUMPY_DTYPES = {
    "TYPE_FP64": np.float64, "TYPE_FP32": np.float32, "TYPE_FP16": np.float16,
    "TYPE_INT64": np.int64, "TYPE_INT32": np.int32, "TYPE_INT16": np.int16, "TYPE_INT8": np.int8,
    "TYPE_UINT64": np.uint64, "TYPE_UINT32": np.uint32, "TYPE_UINT16": np.uint16, "TYPE_UINT8": np.uint8,
    "TYPE_BOOL": np.bool_, "TYPE_STRING": np.object_,
}


def sample_shape(dims: Sequence[int], n: int, length: int) -> tuple[int, ...]:
    """``(n, *dims)`` with every dynamic (``-1``) axis set to ``length``."""
    return (int(n),) + tuple(int(length) if d == -1 else int(d) for d in dims)


def sample_feeds(settings: Settings, engine_input_names: Sequence[str], n: int, length: int) -> dict[str, np.ndarray]:
    """One batch of ``n`` dummy rows for every engine input, dynamic axes ``length`` long."""
    if n < 1 or length < 1:
        raise ValueError(f"sample_feeds needs n >= 1 and length >= 1, got n={n}, length={length}")
    feeds = {}
    for name in engine_input_names:
        spec = settings.input(name)
        if spec is None:  # an input requests may omit and the backend fills with zeros (token_type_ids)
            feeds[name] = np.zeros((n, length), dtype=np.int64)
            continue
        dtype = NUMPY_DTYPES.get(spec.data_type)
        if dtype is None or dtype is np.object_:
            raise ValueError(f"input '{name}' has the type {spec.data_type}, which an engine cannot take")
        value = sample_value(name, settings.input_bounds) if np.dtype(dtype).kind in "iu" else 1
        feeds[name] = np.full(sample_shape(spec.dims, n, length), value, dtype=dtype)
    return feeds


class WarmupError(RuntimeError):
    """The engine fails on inputs its configuration declares (the model is refused at load)."""


def warm_up(engine, settings: Settings, profile_for_length) -> None:
    """Run one row per sequence bucket (one run for a model without a sequence axis) through ``engine``.

    The same feeds the cost model's warm-up uses; a failure raises :class:`WarmupError` in one line that
    names the engine and the fix, so serve, accept and build refuse the model alike.
    """
    names = engine.input_names
    lengths = settings.sequence_buckets if settings.sequence_inputs else settings.sequence_buckets[:1]
    for length in lengths:
        try:
            engine.run(sample_feeds(settings, names, 1, length), profile_for_length(length, settings.sequence_buckets))
        except Exception as exc:  # whatever the engine raises, the verdict is the same: it cannot serve
            detail = " ".join(f"{type(exc).__name__}: {exc}".split())
            raise WarmupError(
                f"{settings.model_name} fails its warm-up (1 x {length} of the declared inputs, values "
                f"{ {k: list(v) for k, v in settings.input_bounds.items()} or 'ones'}) on "
                f"{getattr(engine, 'flavour', type(engine).__name__)}: {detail[:400]}. Fix: declare only "
                "the inputs the model reads and their ranges ([[inputs]] range = [low, high] in the recipe), "
                "then rebuild") from None
