"""Calibration / held-out data: readers, the split, and encoding through the model's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from model_factory.build_engines.calibration import (
    HELDOUT_EVERY,
    InputEncoder,
    batches,
    read_samples,
    split_data,
)
from model_factory.errors import FactoryError
from model_factory.recipe import QuantizationSpec

INT64 = np.dtype(np.int64)
BERT_INPUTS = {"input_ids": INT64, "attention_mask": INT64, "token_type_ids": INT64}


def _txt(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


# --------------------------------------------------------------------------- readers


def test_txt_one_sample_per_line_blank_lines_skipped(tmp_path):
    s = read_samples(_txt(tmp_path / "c.txt", ["first one", "", "  second one  ", "   "]))
    assert s.texts == ("first one", "second one")
    assert s.is_text and len(s) == 2
    assert len(s.digest) == 64


def test_jsonl_reads_text_field(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"text": "a sentence", "label": 1}) + "\n\n" + json.dumps({"text": "another"}) + "\n")
    assert read_samples(p).texts == ("a sentence", "another")


@pytest.mark.parametrize("line, needle", [("{not json", "line 2 is not JSON"),
                                          (json.dumps({"label": 3}), "line 2 has no non-empty string field"),
                                          (json.dumps(["text"]), "line 2 has no non-empty string field")])
def test_jsonl_bad_line_names_the_line(tmp_path, line, needle):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"text": "ok"}) + "\n" + line + "\n")
    with pytest.raises(FactoryError, match=needle):
        read_samples(p)


def test_npz_tensors(tmp_path):
    p = tmp_path / "c.npz"
    np.savez(p, input_ids=np.ones((5, 7), np.int64), attention_mask=np.ones((5, 7), np.int64))
    s = read_samples(p)
    assert not s.is_text and len(s) == 5
    assert len(set(s.keys())) == 1  # identical rows share one identity
    assert len(s.select([0, 2])) == 2


def test_npz_disagreeing_sample_counts(tmp_path):
    p = tmp_path / "c.npz"
    np.savez(p, input_ids=np.ones((5, 7), np.int64), attention_mask=np.ones((4, 7), np.int64))
    with pytest.raises(FactoryError, match="disagree on the number of samples"):
        read_samples(p)


def test_missing_file_says_what_to_give(tmp_path):
    with pytest.raises(FactoryError, match=r"does not exist.*\.txt.*\.jsonl.*\.npz"):
        read_samples(tmp_path / "nope.txt")


def test_unknown_suffix(tmp_path):
    p = tmp_path / "c.csv"
    p.write_text("a,b\n")
    with pytest.raises(FactoryError, match="suffix '.csv'"):
        read_samples(p)


def test_empty_file_is_an_error(tmp_path):
    with pytest.raises(FactoryError, match="holds no samples"):
        read_samples(_txt(tmp_path / "c.txt", ["", "  "]))


# --------------------------------------------------------------------------- the split


def test_no_data_at_all_is_an_error_never_random_data():
    with pytest.raises(FactoryError) as exc:
        split_data(QuantizationSpec(), need_calibration=False)
    msg = str(exc.value)
    assert "quantization.calibration_data" in msg and "heldout_data" in msg
    assert "Random inputs are never used" in msg


def test_int8_without_calibration_data_is_an_error(tmp_path):
    held = _txt(tmp_path / "h.txt", ["a held-out sentence"])
    with pytest.raises(FactoryError, match="int8 needs calibration data"):
        split_data(QuantizationSpec(heldout_data=held), need_calibration=True)


def test_split_without_heldout_file_is_deterministic_and_disjoint(tmp_path):
    lines = [f"sentence number {i}" for i in range(23)] + ["sentence number 4"]  # a duplicate of a held-out one
    calib = _txt(tmp_path / "c.txt", lines)
    a = split_data(QuantizationSpec(calibration_data=calib), need_calibration=True)
    b = split_data(QuantizationSpec(calibration_data=calib), need_calibration=True)
    assert a.heldout.texts == b.heldout.texts and a.calibration.texts == b.calibration.texts
    assert a.heldout.texts == tuple(f"sentence number {i}" for i in range(HELDOUT_EVERY - 1, 23, HELDOUT_EVERY))
    assert not set(a.heldout.texts) & set(a.calibration.texts)
    assert "sentence number 4" not in a.calibration.texts  # the duplicate was not left in calibration
    assert a.overlap == 0
    assert "every 5th sample" in a.note


def test_heldout_samples_also_in_calibration_are_dropped(tmp_path):
    calib = _txt(tmp_path / "c.txt", ["alpha", "beta", "gamma"])
    held = _txt(tmp_path / "h.txt", ["beta", "delta", "epsilon"])
    s = split_data(QuantizationSpec(calibration_data=calib, heldout_data=held), need_calibration=True)
    assert s.heldout.texts == ("delta", "epsilon")
    assert "1 sample(s) also in the calibration data were dropped" in s.note


def test_heldout_entirely_inside_calibration_is_an_error(tmp_path):
    calib = _txt(tmp_path / "c.txt", ["alpha", "beta"])
    held = _txt(tmp_path / "h.txt", ["beta"])
    with pytest.raises(FactoryError, match="every held-out sample"):
        split_data(QuantizationSpec(calibration_data=calib, heldout_data=held), need_calibration=True)


def test_sample_caps(tmp_path):
    calib = _txt(tmp_path / "c.txt", [f"c{i}" for i in range(50)])
    held = _txt(tmp_path / "h.txt", [f"h{i}" for i in range(30)])
    s = split_data(QuantizationSpec(calibration_data=calib, heldout_data=held, max_calibration_samples=7,
                                    max_heldout_samples=3), need_calibration=True)
    assert len(s.calibration) == 7 and len(s.heldout) == 3


def test_text_and_tensor_files_do_not_mix(tmp_path):
    calib = _txt(tmp_path / "c.txt", ["alpha"])
    held = tmp_path / "h.npz"
    np.savez(held, input_ids=np.ones((2, 3), np.int64))
    with pytest.raises(FactoryError, match="different kinds"):
        split_data(QuantizationSpec(calibration_data=calib, heldout_data=held), need_calibration=True)


# --------------------------------------------------------------------------- encoding


def test_texts_go_through_the_models_tokenizer_padded_to_one_length(minilm_recipe, tmp_path):
    # The model folder holds the same tokenizer files that the export stage saves.
    enc = InputEncoder(BERT_INPUTS, minilm_recipe.source.path, max_length=16)
    texts = ["short", "a much longer sentence with quite a few more words in it than the first one has"]
    feeds = enc.encode(read_samples(_txt(tmp_path / "c.txt", texts)))
    assert set(feeds) == set(BERT_INPUTS)
    assert {v.shape for v in feeds.values()} == {(2, 16)}  # one length; truncated at max_length
    assert all(v.dtype == np.int64 for v in feeds.values())
    assert feeds["input_ids"][0, 0] == 101 and feeds["attention_mask"][0].sum() == 3  # [CLS] short [SEP]
    assert feeds["attention_mask"][1].sum() == 16


def test_text_data_for_a_model_without_tokenizer(tmp_path):
    enc = InputEncoder({"x": np.dtype(np.float32)}, None, max_length=8)
    with pytest.raises(FactoryError, match="ships no tokenizer.*npz"):
        enc.encode(read_samples(_txt(tmp_path / "c.txt", ["hello"])))


def test_npz_missing_an_input(tmp_path):
    p = tmp_path / "c.npz"
    np.savez(p, input_ids=np.ones((2, 3), np.int32))
    enc = InputEncoder(BERT_INPUTS, None, max_length=8)
    with pytest.raises(FactoryError, match=r"lacks arrays for the model inputs \['attention_mask', 'token_type_ids'\]"):
        enc.encode(read_samples(p))


def test_npz_cast_to_the_model_dtypes(tmp_path):
    p = tmp_path / "c.npz"
    np.savez(p, input_ids=np.ones((3, 4), np.int32), attention_mask=np.ones((3, 4), np.int32),
             token_type_ids=np.zeros((3, 4), np.int32))
    feeds = InputEncoder(BERT_INPUTS, None, max_length=8).encode(read_samples(p))
    assert all(v.dtype == np.int64 and v.shape == (3, 4) for v in feeds.values())


def test_batches_cover_every_sample_once():
    feeds = {"a": np.arange(10), "b": np.arange(10) * 2}
    got = list(batches(feeds, 4))
    assert [len(b["a"]) for b in got] == [4, 4, 2]
    assert np.array_equal(np.concatenate([b["b"] for b in got]), feeds["b"])


# --------------------------------------------------------------------------- reranker pairs


def _pairs(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"query": q, "passage": p}) + "\n" for q, p in rows))
    return path


def test_jsonl_query_passage_pairs_are_read_as_pairs(tmp_path):
    s = read_samples(_pairs(tmp_path / "p.jsonl", [("q1", "first passage"), ("q1", "second"), ("q2", "third")]))
    assert s.is_pairs and len(s) == 3 and s.groups() == ["q1", "q1", "q2"]
    assert s.keys()[0] == "q1\0first passage"


@pytest.mark.parametrize("lines, needle", [
    (['{"query": "q"}'], '"passage"'),
    (['{"query": "q", "passage": "p"}', '{"text": "t"}'], "mixes single texts and query/passage pairs"),
])
def test_bad_pair_lines_are_named(tmp_path, lines, needle):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(FactoryError, match=needle) as info:
        read_samples(path)
    assert "Fix:" in str(info.value)


def test_pairs_and_texts_do_not_mix_across_files(tmp_path):
    spec = QuantizationSpec(calibration_data=_pairs(tmp_path / "c.jsonl", [("q", "p"), ("q", "p2")]),
                            heldout_data=_txt(tmp_path / "h.txt", ["a text"]))
    with pytest.raises(FactoryError, match="pairs"):
        split_data(spec, need_calibration=True)


def test_pairs_are_tokenized_as_pairs_with_token_type_ids(minilm_recipe, tmp_path):
    enc = InputEncoder(BERT_INPUTS, minilm_recipe.source.path, max_length=32)
    feeds = enc.encode(read_samples(_pairs(tmp_path / "p.jsonl", [("short query", "a passage"), ("q", "p")])))
    # [CLS] short query [SEP] a passage [SEP]: the passage's tokens (and its [SEP]) are type 1.
    assert feeds["token_type_ids"][0].tolist()[:7] == [0, 0, 0, 0, 1, 1, 1]
    assert feeds["attention_mask"][0].sum() == 7 and list(feeds["input_ids"][0][[0, 3, 6]]) == [101, 102, 102]
