"""Index-like inputs are checked against the model's own bounds before any engine sees them."""

from __future__ import annotations

import numpy as np
import pytest

from model_factory.backend.requests.input_bounds import (BoundsError, check_bounds, format_bounds, parse_bounds,
                                                sample_value)
from model_factory.backend.requests.items import RequestError, check_items, items_from_tensors
from model_factory.backend.requests.samples import WarmupError, sample_feeds, warm_up
from model_factory.backend.settings import parse_settings

BERT_BOUNDS = {"input_ids": (0, 99), "token_type_ids": (0, 1), "attention_mask": (0, 1)}


def _config(inputs, params=None):
    return {"name": "m", "max_batch_size": 8, "input": inputs,
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [-1]}],
            "parameters": {k: {"string_value": v} for k, v in {"max_sequence_length": "16",
                                                                "sequence_buckets": "8,16", **(params or {})}.items()}}


def _int(name, optional=False):
    return {"name": name, "data_type": "TYPE_INT64", "dims": [-1], "optional": optional}


BERT = _config([_int("input_ids"), _int("attention_mask"), _int("token_type_ids", True)],
               {"input_bounds": format_bounds(BERT_BOUNDS)})
GENERIC = _config([_int("ids"), _int("pos")], {"input_bounds": format_bounds({"ids": (0, 49), "pos": (0, 15)})})


def test_the_parameter_round_trips_and_a_bad_one_is_refused_at_load() -> None:
    assert parse_bounds(format_bounds(BERT_BOUNDS)) == BERT_BOUNDS
    assert parse_bounds("") == {}
    for bad in ("{", "[1, 2]", '{"a": [3, 1]}', '{"a": [0]}', '{"a": [0, true]}', '{"a": [0, 1.5]}'):
        with pytest.raises(BoundsError):
            parse_bounds(bad)
    with pytest.raises(BoundsError, match="input_bounds"):
        parse_settings(_config([_int("ids")], {"input_bounds": '{"ids": [5, 1]}'}))


def test_settings_carry_the_bounds_and_the_vocabulary_bounds_input_ids() -> None:
    assert parse_settings(BERT).input_bounds == BERT_BOUNDS
    s = parse_settings(_config([_int("input_ids"), _int("attention_mask")], {"vocab_size": "300"}))
    assert s.input_bounds == {"input_ids": (0, 299)}


@pytest.mark.parametrize("values,where,value", [([0, 5, 0], [0, 1], 5), ([0, -1, 0], [0, 1], -1),
                                                 ([1, 1, 2**62], [0, 2], 2**62)])
def test_a_token_type_outside_the_table_names_input_position_and_range(values, where, value) -> None:
    s = parse_settings(BERT)
    ids = np.asarray([[10, 11, 12]], np.int64)
    with pytest.raises(RequestError) as info:
        items_from_tensors({"input_ids": ids, "attention_mask": np.ones_like(ids),
                            "token_type_ids": np.asarray([values], np.int64)}, s)
    msg = str(info.value)
    assert f"input 'token_type_ids' holds {value} at position {where}" in msg and "0..1" in msg


def test_a_mask_of_seven_and_a_negative_id_are_refused_and_good_values_pass() -> None:
    s = parse_settings(BERT)
    ids = np.asarray([[10, 11, 12], [13, 14, 15]], np.int64)
    with pytest.raises(RequestError, match=r"'attention_mask' holds 7 at position \[1, 2\].*0\.\.1 \(0 or 1\)"):
        items_from_tensors({"input_ids": ids, "attention_mask": np.asarray([[1, 1, 1], [1, 1, 7]])}, s)
    with pytest.raises(RequestError, match=r"'input_ids' holds -3 at position \[0, 0\]; allowed values are 0\.\.99"):
        items_from_tensors({"input_ids": -3 * np.ones_like(ids), "attention_mask": np.ones_like(ids)}, s)
    items = items_from_tensors({"input_ids": ids, "attention_mask": np.ones_like(ids),
                                "token_type_ids": np.asarray([[0, 1, 1], [0, 0, 0]])}, s)
    assert len(items) == 2


def test_generic_indices_and_positions_are_bounded_and_the_message_never_says_send_text() -> None:
    s = parse_settings(GENERIC)
    ok = np.arange(6, dtype=np.int64)[None]
    assert len(items_from_tensors({"ids": ok * 9, "pos": ok}, s)) == 1
    with pytest.raises(RequestError, match=r"'ids' holds 50 at position \[0, 5\]; allowed values are 0\.\.49"):
        items_from_tensors({"ids": ok * 10, "pos": ok}, s)
    with pytest.raises(RequestError, match=r"'pos' holds -1"):
        items_from_tensors({"ids": ok, "pos": ok - 1}, s)
    with pytest.raises(RequestError) as info:
        items_from_tensors({"ids": np.zeros((1, 17), np.int64), "pos": np.zeros((1, 17), np.int64)}, s)
    assert "text" not in str(info.value) and "exceeds the maximum 16" in str(info.value)


def test_tokenized_items_are_checked_too() -> None:
    s = parse_settings(BERT)
    check_items([{"input_ids": np.asarray([5, 99]), "attention_mask": np.ones(2, np.int64)}], s)
    with pytest.raises(RequestError, match=r"row 1: input 'input_ids' holds 100"):
        check_items([{"input_ids": np.asarray([5])}, {"input_ids": np.asarray([5, 100])}], s)


def test_check_ignores_inputs_without_bounds_and_unsigned_values_compare_without_wrapping() -> None:
    assert check_bounds("x", np.asarray([10**6]), BERT_BOUNDS) is None
    assert "holds 18446744073709551615" in check_bounds("input_ids", np.asarray([2**64 - 1], np.uint64), BERT_BOUNDS)


def test_warm_up_feeds_take_values_the_model_accepts() -> None:
    s = parse_settings(_config([_int("input_ids"), _int("attention_mask"), _int("token_type_ids")],
                               {"input_bounds": format_bounds({"token_type_ids": (0, 0), "input_ids": (0, 9)})}))
    feeds = sample_feeds(s, ["input_ids", "attention_mask", "token_type_ids"], 2, 4)
    assert feeds["token_type_ids"].max() == 0 and feeds["input_ids"].min() == 1 and feeds["attention_mask"].min() == 1
    assert sample_value("pos", {"pos": (3, 7)}) == 3 and sample_value("pos", {}) == 1


class _Engine:
    """A tiny engine over numpy (the ONNX Runtime engine is exercised by the build and server tests)."""

    input_names = ("input_ids", "attention_mask", "token_type_ids")
    flavour = "numpy"

    def __init__(self, rows: int) -> None:
        self.table = np.zeros((rows, 2), np.float32)

    def run(self, feeds, profile=0):
        return {"y": self.table[feeds["token_type_ids"]]}  # raises IndexError past the table


def test_warm_up_runs_each_bucket_and_fails_in_one_line_with_the_fix() -> None:
    from model_factory.backend.batching.grouping import profile_for_length

    inputs = [_int("input_ids"), _int("attention_mask"), _int("token_type_ids")]
    warm_up(_Engine(1), parse_settings(_config(inputs, {"input_bounds": '{"token_type_ids":[0,0]}'})),
            profile_for_length)
    # Without bounds the feeds are ones: row 1 of a one-row table does not exist.
    with pytest.raises(WarmupError) as info:
        warm_up(_Engine(1), parse_settings(_config(inputs)), profile_for_length)
    msg = str(info.value)
    assert "\n" not in msg and "fails its warm-up" in msg and "IndexError" in msg and "Fix:" in msg
