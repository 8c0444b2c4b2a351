"""Per-request validation: each problem is named, and good requests become one item per row."""

from __future__ import annotations

import numpy as np
import pytest

from model_factory.backend.requests.items import RequestError, decode_texts, items_from_tensors, items_from_texts
from model_factory.backend.settings import SettingsError, parse_settings

CONFIG = {
    "name": "m", "max_batch_size": 8,
    "input": [{"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1], "optional": True},
              {"name": "attention_mask", "data_type": "TYPE_INT64", "dims": [-1], "optional": True},
              {"name": "text", "data_type": "TYPE_STRING", "dims": [1], "optional": True}],
    "output": [{"name": "last_hidden_state", "data_type": "TYPE_FP32", "dims": [-1, 4]},
               {"name": "embedding", "data_type": "TYPE_FP32", "dims": [4]}],
    "parameters": {"max_sequence_length": {"string_value": "16"}, "sequence_buckets": {"string_value": "8,16"}},
}


@pytest.fixture
def settings():
    return parse_settings(CONFIG)


def ids(n: int, length: int) -> dict[str, np.ndarray]:
    return {"input_ids": np.arange(n * length, dtype=np.int64).reshape(n, length) % 50,
            "attention_mask": np.ones((n, length), dtype=np.int64)}


def test_settings_parse(settings) -> None:
    assert settings.sequence_buckets == (8, 16) and settings.max_sequence_length == 16
    assert settings.sequence_outputs == frozenset({"last_hidden_state"})
    assert settings.grouping == "cost_model" and settings.cost_model is None


def test_bad_settings_are_refused_at_load() -> None:
    bad = dict(CONFIG, parameters={"grouping": {"string_value": "random"}})
    with pytest.raises(SettingsError, match="grouping"):
        parse_settings(bad)
    with pytest.raises(SettingsError, match="cost_model"):
        parse_settings(dict(CONFIG, parameters={"cost_model": {"string_value": "1,2"}}))
    with pytest.raises(SettingsError, match="cost_model_warmup"):
        parse_settings(dict(CONFIG, parameters={"cost_model_warmup": {"string_value": "long"}}))
    with pytest.raises(SettingsError, match="cost_model_online"):
        parse_settings(dict(CONFIG, parameters={"cost_model_online": {"string_value": "maybe"}}))


def test_cost_model_start_and_learning_settings(settings) -> None:
    assert settings.cost_model_warmup == "short" and settings.cost_model_online is None
    s = parse_settings(dict(CONFIG, parameters={"cost_model_warmup": {"string_value": "sweep"},
                                                "cost_model_online": {"string_value": "false"}}))
    assert s.cost_model_warmup == "sweep" and s.cost_model_online is False


def test_rows_become_items(settings) -> None:
    items = items_from_tensors(ids(3, 5), settings, vocab_size=100)
    assert len(items) == 3 and all(it["input_ids"].shape == (5,) for it in items)
    np.testing.assert_array_equal(items[1]["input_ids"], ids(3, 5)["input_ids"][1])


@pytest.mark.parametrize("tensors, message", [
    ({}, "no inputs"),
    ({"input_ids": np.zeros((1, 4), np.int64)}, "without attention_mask"),
    ({"attention_mask": np.ones((1, 4), np.int64)}, "attention_mask sent without input_ids"),
    ({"input_ids": np.zeros((1, 4), np.int32), "attention_mask": np.ones((1, 4), np.int64)}, "dtype int32"),
    ({"input_ids": np.zeros((4,), np.int64), "attention_mask": np.ones((4,), np.int64)}, "shape"),
    ({"input_ids": np.zeros((1, 4), np.int64), "attention_mask": np.ones((1, 5), np.int64)}, "different sequence lengths"),
    ({"input_ids": np.zeros((2, 4), np.int64), "attention_mask": np.ones((1, 4), np.int64)}, "batch"),
    ({"input_ids": np.zeros((1, 17), np.int64), "attention_mask": np.ones((1, 17), np.int64)}, "exceeds the maximum 16"),
    ({"input_ids": np.zeros((1, 0), np.int64), "attention_mask": np.ones((1, 0), np.int64)}, "empty sequence"),
    ({"input_ids": np.full((1, 4), 100, np.int64), "attention_mask": np.ones((1, 4), np.int64)}, "allowed values are 0..99"),
])
def test_bad_tensor_requests(settings, tensors, message) -> None:
    with pytest.raises(RequestError, match=message):
        items_from_tensors(tensors, settings, vocab_size=100)


def test_text_decoding() -> None:
    assert decode_texts(np.array([[b"hi"], ["there"]], dtype=object)) == ["hi", "there"]
    with pytest.raises(RequestError, match="not valid UTF-8"):
        decode_texts(np.array([[b"\xff\xfe"]], dtype=object))
    with pytest.raises(RequestError, match="empty"):
        decode_texts(np.array([[b"   "]], dtype=object))
    with pytest.raises(RequestError, match=r"\[batch, 1\]"):
        decode_texts(np.array([b"a", b"b"], dtype=object))


def test_text_items_use_the_tokenizer() -> None:
    class FakeEncoding:
        def __init__(self, n: int) -> None:
            self.ids, self.attention_mask, self.type_ids = list(range(n)), [1] * n, [0] * n

    class FakeTokenizer:
        def encode_batch(self, texts):
            return [FakeEncoding(len(t.split()) + 2) for t in texts]

    items = items_from_texts(["a b c", "a"], FakeTokenizer(), ("input_ids", "attention_mask", "token_type_ids"))
    assert [it["input_ids"].shape[0] for it in items] == [5, 3]
    assert items[0]["token_type_ids"].dtype == np.int64


def test_integrity_reads_once_and_refuses_changed_bytes(tmp_path, monkeypatch) -> None:
    """The backend's load-time check: verified digests from outside the repository."""
    import hashlib
    import json

    from model_factory.backend.integrity import ENV, IntegrityError, read_checked, verified_digests

    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.onnx").write_bytes(b"engine bytes")
    table = tmp_path / "verified.json"
    table.write_text(json.dumps({"m": {"1": {"1/model.onnx": hashlib.sha256(b"engine bytes").hexdigest()}}}))
    monkeypatch.delenv(ENV, raising=False)
    assert verified_digests("m", "1") is None  # served without verification: no check
    monkeypatch.setenv(ENV, str(table))
    digests = verified_digests("m", "1")
    assert read_checked(tmp_path / "m", "1/model.onnx", digests) == b"engine bytes"
    (tmp_path / "m" / "1" / "model.onnx").write_bytes(b"swapped bytes")
    with pytest.raises(IntegrityError, match="changed after verification"):
        read_checked(tmp_path / "m", "1/model.onnx", digests)
    with pytest.raises(IntegrityError, match="not covered"):
        read_checked(tmp_path / "m", "1/other.onnx", digests)
    with pytest.raises(IntegrityError, match="was not verified"):
        verified_digests("other", "1")


def test_reranker_pairs_are_tokenized_as_pairs() -> None:
    from model_factory.backend.requests.items import items_from_text_inputs

    class FakeEncoding:
        def __init__(self, pair) -> None:
            q, p = pair
            self.ids = list(range(len(q.split()) + len(p.split()) + 3))
            self.attention_mask = [1] * len(self.ids)
            self.type_ids = [0] * (len(q.split()) + 2) + [1] * (len(p.split()) + 1)

    class FakeTokenizer:
        def encode_batch(self, pairs):
            assert all(isinstance(x, tuple) for x in pairs)  # pairs reach the tokenizer as pairs
            return [FakeEncoding(x) for x in pairs]

    raw = {"query": np.array([[b"red apples"], [b"pears"]], dtype=object),
           "passage": np.array([[b"apples are red"], [b"a pear"]], dtype=object)}
    items = items_from_text_inputs(raw, FakeTokenizer(), ("input_ids", "attention_mask", "token_type_ids"))
    assert [it["token_type_ids"].tolist() for it in items] == [[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]]
    with pytest.raises(RequestError, match="'passage' is missing"):
        items_from_text_inputs({"query": raw["query"]}, FakeTokenizer(), ("input_ids",))
    with pytest.raises(RequestError, match="one query row per passage row"):
        items_from_text_inputs({"query": raw["query"], "passage": raw["passage"][:1]}, FakeTokenizer(), ("input_ids",))
    with pytest.raises(RequestError, match=r"passage\[0\] is empty"):
        items_from_text_inputs({"query": raw["query"][:1], "passage": np.array([[b" "]], dtype=object)},
                               FakeTokenizer(), ("input_ids",))


GENERIC = {
    "name": "g", "max_batch_size": 8,
    "input": [{"name": "pixels", "data_type": "TYPE_FP32", "dims": [3, 4, 4]},
              {"name": "flags", "data_type": "TYPE_BOOL", "dims": [2]}],
    "output": [{"name": "logits", "data_type": "TYPE_FP32", "dims": [10]}],
}


def test_generic_inputs_are_checked_against_declared_dtypes_and_dims() -> None:
    s = parse_settings(GENERIC)
    good = {"pixels": np.zeros((2, 3, 4, 4), np.float32), "flags": np.zeros((2, 2), np.bool_)}
    assert [sorted(i) for i in items_from_tensors(good, s)] == [["flags", "pixels"]] * 2
    with pytest.raises(RequestError, match="dtype float64, expected float32"):
        items_from_tensors(good | {"pixels": np.zeros((2, 3, 4, 4))}, s)
    with pytest.raises(RequestError, match="axis 2 is 5, expected 4"):
        items_from_tensors(good | {"pixels": np.zeros((2, 3, 5, 4), np.float32)}, s)
    with pytest.raises(RequestError, match="dtype int64, expected bool"):
        items_from_tensors(good | {"flags": np.zeros((2, 2), np.int64)}, s)
    with pytest.raises(RequestError, match="Send 'pixels', 'flags'"):
        items_from_tensors({}, s)
    assert s.pad_sequences is False and s.sequence_inputs == frozenset()


def test_padding_follows_the_parameter_or_an_attention_mask() -> None:
    assert parse_settings(CONFIG).pad_sequences is True
    assert parse_settings(dict(GENERIC, parameters={"pad_sequences": {"string_value": "true"}})).pad_sequences
    with pytest.raises(SettingsError, match="pad_sequences"):
        parse_settings(dict(GENERIC, parameters={"pad_sequences": {"string_value": "yes"}}))


def test_ids_without_a_mask_are_fine_for_a_model_that_takes_no_mask() -> None:
    s = parse_settings({"name": "ids-only", "max_batch_size": 4,
                        "input": [{"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1]}],
                        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [2]}]})
    items = items_from_tensors({"input_ids": np.ones((2, 5), np.int64)}, s)
    assert len(items) == 2 and items[0]["input_ids"].shape == (5,)
