"""Dummy inputs built from the model's declared inputs, for the warm-up and the cost model.

Every engine input gets an array of its declared Triton dtype and dims (the batch
axis first): ``n`` rows, and ``length`` for each dynamic (``-1``) axis, so an image
CNN gets FP32 ``(n, 3, 64, 64)`` and an encoder INT64 ``(n, length)``. Values are
ones: a valid token id, a full attention mask, a finite float, ``True``. An engine
input the configuration does not declare (BERT's ``token_type_ids`` on a model
served from text) is taken as token-shaped INT64 zeros, as requests fill it.

Pure numpy: this module is copied into the Triton model folder and runs inside
the Python-backend stub. The cost-model warm-up (``model.py``) calls
:func:`sample_feeds`; anything else that needs representative inputs should too.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .settings import Settings

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
        feeds[name] = np.ones(sample_shape(spec.dims, n, length), dtype=dtype)
    return feeds
