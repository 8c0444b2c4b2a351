"""Warm-up and cost-model inputs follow the declared dtypes and dims (an image CNN gets images)."""

from __future__ import annotations

import numpy as np
import pytest

from model_factory.backend.requests.samples import sample_feeds, sample_shape
from model_factory.backend.settings import parse_settings


def _settings(inputs):
    return parse_settings({"name": "m", "max_batch_size": 8, "input": inputs,
                           "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [1]}]})


def test_image_model_gets_float_images() -> None:
    s = _settings([{"name": "pixels", "data_type": "TYPE_FP32", "dims": [3, 64, 64]}])
    feeds = sample_feeds(s, ["pixels"], 4, 32)
    assert feeds["pixels"].dtype == np.float32 and feeds["pixels"].shape == (4, 3, 64, 64)


@pytest.mark.parametrize("triton,numpy", [("TYPE_FP16", np.float16), ("TYPE_INT32", np.int32), ("TYPE_BOOL", np.bool_),
                                          ("TYPE_INT8", np.int8), ("TYPE_UINT8", np.uint8), ("TYPE_INT64", np.int64)])
def test_every_declared_dtype_and_dynamic_axes(triton, numpy) -> None:
    s = _settings([{"name": "x", "data_type": triton, "dims": [-1, 5, -1]}])
    x = sample_feeds(s, ["x"], 2, 7)["x"]
    assert x.dtype == numpy and x.shape == (2, 7, 5, 7)


def test_undeclared_engine_input_is_token_shaped_zeros() -> None:
    s = _settings([{"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1]},
                   {"name": "attention_mask", "data_type": "TYPE_INT64", "dims": [-1]}])
    feeds = sample_feeds(s, ["input_ids", "attention_mask", "token_type_ids"], 3, 9)
    assert {k: v.shape for k, v in feeds.items()} == {k: (3, 9) for k in feeds}
    assert feeds["input_ids"].min() == 1 and feeds["token_type_ids"].max() == 0


def test_text_input_and_bad_sizes_are_refused() -> None:
    s = _settings([{"name": "text", "data_type": "TYPE_STRING", "dims": [1]}])
    with pytest.raises(ValueError, match="cannot take"):
        sample_feeds(s, ["text"], 1, 4)
    with pytest.raises(ValueError, match="n >= 1"):
        sample_feeds(s, [], 0, 4)
    assert sample_shape((-1, 3), 2, 5) == (2, 5, 3)
