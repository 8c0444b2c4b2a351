"""The encoder APIs' shapes without a server: /v1/embeddings (OpenAI), /rerank and /predict (TEI), /v1/rerank
(Cohere / Jina), and the KServe infer body and binary answer the frontend sends and reads."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from model_factory.serving.encoder_models import EncoderModel
from model_factory.serving.kserve_infer import infer_body, parse_infer_response
from model_factory.serving.openai_encoders import (embeddings_request, embeddings_response, encode_vector,
                                                   shape_vectors)
from model_factory.serving.openai_protocol import OpenAIError
from model_factory.serving.tei_protocol import (class_scores, cohere_rerank_request, cohere_rerank_response,
                                                predict_request, predict_response, sigmoid, tei_embed_request,
                                                tei_embed_response, tei_error, tei_rerank_request,
                                                tei_rerank_response)

EMB = {"e": EncoderModel("e", "embedding", 64, dimensions=8, normalized=True),
       "m": EncoderModel("m", "embedding", 64, dimensions=8, normalized=True, matryoshka_dimensions=(2, 4))}
RERANK = {"r": EncoderModel("r", "reranker", 8)}
CLS = {"c": EncoderModel("c", "classification", 8, labels=("negative", "positive"))}


@pytest.mark.parametrize("given, texts, ids", [
    ("hello", ("hello",), ()), (["a", "b"], ("a", "b"), ()),
    ([1, 2, 3], (), ((1, 2, 3),)), ([[1, 2], [3]], (), ((1, 2), (3,))),
])
def test_every_input_form_of_openai(given, texts, ids):
    call = embeddings_request({"model": "e", "input": given}, EMB)
    assert (call.texts, call.token_ids, call.encoding_format, call.dimensions) == (texts, ids, "float", None)
    assert call.count == len(texts) + len(ids)


@pytest.mark.parametrize("req, status, param", [
    ({"input": "x"}, 400, "model"), ({"model": "zz", "input": "x"}, 404, "model"),
    ({"model": "r", "input": "x"}, 404, "model"),  # a reranker is not an embedding model
    ({"model": "e", "input": 3}, 400, "input"), ({"model": "e", "input": []}, 400, "input"),
    ({"model": "e", "input": ["a", 1]}, 400, "input"), ({"model": "e", "input": [[1], ["a"]]}, 400, "input"),
    ({"model": "e", "input": "  "}, 400, "input"), ({"model": "e", "input": [True]}, 400, "input"),
    ({"model": "e", "input": [-1]}, 400, "input"), ({"model": "e", "input": ["x"] * 2049}, 400, "input"),
    ({"model": "e", "input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"model": "e", "input": "x", "dimensions": 4}, 400, "dimensions"),  # not a Matryoshka model
    ({"model": "m", "input": "x", "dimensions": 3}, 400, "dimensions"),  # not one of its sizes
    ({"model": "m", "input": "x", "dimensions": 0}, 400, "dimensions"),
    ({"model": "m", "input": "x", "dimensions": "4"}, 400, "dimensions"),
    ({"model": "e", "input": "x", "truncate": "yes"}, 400, "truncate"),
    ({"model": "e", "input": "x", "long_inputs": "cut"}, 400, "long_inputs"),
    ({"model": "e", "input": [1, 2], "truncate": True}, 400, "truncate"),
])
def test_bad_embedding_requests_name_the_parameter(req, status, param):
    with pytest.raises(OpenAIError) as info:
        embeddings_request(req, EMB)
    assert info.value.status == status and info.value.param == param
    assert info.value.body()["error"]["param"] == param


def test_dimensions_where_the_model_allows_it():
    assert embeddings_request({"model": "m", "input": "x", "dimensions": 4}, EMB).dimensions == 4
    assert embeddings_request({"model": "e", "input": "x", "dimensions": 8}, EMB).dimensions is None  # its own size
    with pytest.raises(OpenAIError, match="matryoshka_dimensions"):
        embeddings_request({"model": "e", "input": "x", "dimensions": 4}, EMB)


def test_truncated_vectors_are_renormalized():
    v = np.array([[3.0, 4.0, 12.0], [0.0, 0.0, 1.0]], dtype=np.float32)
    out = shape_vectors(v, 2)
    assert out.dtype == np.float32 and out.shape == (2, 2)
    np.testing.assert_allclose(out[0], [0.6, 0.8], rtol=1e-6)
    np.testing.assert_array_equal(out[1], [0.0, 0.0])  # a zero prefix stays zero, no NaN
    assert shape_vectors(v, None) is not None and shape_vectors(v, None).shape == (2, 3)


def test_long_input_parameters_go_to_the_backend():
    assert embeddings_request({"model": "e", "input": "x", "truncate": True}, EMB).parameters == {"truncate": True}
    assert embeddings_request({"model": "e", "input": "x", "long_inputs": "chunk"}, EMB).parameters == \
        {"long_inputs": "chunk"}
    assert embeddings_request({"model": "e", "input": "x"}, EMB).parameters is None


def test_base64_is_little_endian_float32_as_the_openai_client_decodes_it():
    v = np.array([0.5, -1.25, 3.0], dtype=np.float32)
    text = encode_vector(v, "base64")
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(text), dtype="<f4"), v)
    assert encode_vector(v, "float") == [0.5, -1.25, 3.0]


def test_embeddings_response_shape():
    out = embeddings_response("e", np.eye(2, dtype=np.float32), "float", 7)
    assert out["object"] == "list" and out["model"] == "e"
    assert out["data"] == [{"object": "embedding", "index": 0, "embedding": [1.0, 0.0]},
                           {"object": "embedding", "index": 1, "embedding": [0.0, 1.0]}]
    assert out["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    json.dumps(out)  # plain JSON types only


def test_tei_rerank_is_sorted_by_sigmoid_score():
    call = tei_rerank_request({"query": "q", "texts": ["a", "b", "c"], "return_text": True}, RERANK)
    assert call.model == "r" and call.pairs == [("q", "a"), ("q", "b"), ("q", "c")]
    out = tei_rerank_response(call, np.array([[-1.0], [2.0], [0.5]], dtype=np.float32))
    assert [r["index"] for r in out] == [1, 2, 0]
    assert out[0] == {"index": 1, "score": pytest.approx(float(sigmoid(2.0))), "text": "b"}
    raw = tei_rerank_request({"query": "q", "texts": ["a", "b"], "raw_scores": True}, RERANK)
    assert tei_rerank_response(raw, np.array([[-1.0], [2.0]])) == [{"index": 1, "score": 2.0},
                                                                   {"index": 0, "score": -1.0}]
    assert tei_rerank_request({"query": "q", "texts": ["a"], "truncate": True}, RERANK).parameters == \
        {"truncate": True}


def test_cohere_rerank_top_n_and_documents():
    call = cohere_rerank_request({"model": "r", "query": "q", "documents": ["a", {"text": "b"}, "c"], "top_n": 2},
                                 RERANK)
    assert call.documents == ("a", "b", "c") and call.return_documents
    out = cohere_rerank_response(call, np.array([[0.1], [3.0], [1.0]]), 21)
    assert [r["index"] for r in out["results"]] == [1, 2]
    assert out["results"][0]["document"] == {"text": "b"} and 0 < out["results"][0]["relevance_score"] < 1
    assert out["usage"] == {"total_tokens": 21} and out["model"] == "r" and out["id"]
    bare = cohere_rerank_request({"model": "r", "query": "q", "documents": ["a"], "return_documents": False}, RERANK)
    assert "document" not in cohere_rerank_response(bare, np.array([[0.0]]), 3)["results"][0]


@pytest.mark.parametrize("fn, req, param", [
    (tei_rerank_request, {"texts": ["a"]}, "query"), (tei_rerank_request, {"query": "q", "texts": []}, "texts"),
    (tei_rerank_request, {"query": "q", "texts": ["a", ""]}, "texts"),
    (tei_rerank_request, {"query": "q", "texts": ["a"], "raw_scores": 1}, "raw_scores"),
    (tei_rerank_request, {"query": "q", "texts": ["a"], "truncation_direction": "left"}, "truncation_direction"),
    (tei_rerank_request, {"query": "q", "texts": ["a"], "model": "zz"}, "model"),
    (cohere_rerank_request, {"model": "r", "query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
    (cohere_rerank_request, {"model": "r", "query": "q", "documents": "a"}, "documents"),
    (predict_request, {"inputs": []}, "inputs"), (predict_request, {"inputs": [["a", "b"]]}, "inputs"),
    (predict_request, {"inputs": 3}, "inputs"),
])
def test_bad_rerank_and_predict_requests_name_the_parameter(fn, req, param):
    with pytest.raises(OpenAIError) as info:
        fn(req, CLS if fn is predict_request else RERANK)
    assert info.value.param == param


def test_tei_needs_a_model_name_when_several_are_served():
    two = {**RERANK, "r2": EncoderModel("r2", "reranker", 8)}
    with pytest.raises(OpenAIError, match="several reranker models") as info:
        tei_rerank_request({"query": "q", "texts": ["a"]}, two)
    assert info.value.status == 400
    assert tei_rerank_request({"query": "q", "texts": ["a"], "model": "r2"}, two).model == "r2"
    assert tei_error(info.value) == {"error": info.value.message, "error_type": "Validation"}


def test_predict_answers_labels_best_first():
    one = predict_request({"inputs": "great"}, CLS)
    out = predict_response(one, np.array([[-1.0, 2.0]]), CLS["c"].labels)
    assert [r["label"] for r in out] == ["positive", "negative"]
    assert sum(r["score"] for r in out) == pytest.approx(1.0)
    many = predict_request({"inputs": ["great", "awful"], "raw_scores": True}, CLS)
    out = predict_response(many, np.array([[-1.0, 2.0], [3.0, 0.0]]), CLS["c"].labels)
    assert out == [[{"label": "positive", "score": 2.0}, {"label": "negative", "score": -1.0}],
                   [{"label": "negative", "score": 3.0}, {"label": "positive", "score": 0.0}]]
    np.testing.assert_allclose(class_scores(np.array([[0.0]]), False), [[0.5]])  # one label: sigmoid


def test_kserve_body_and_binary_answer():
    body = infer_body({"text": ["a", "b"], "input_ids": np.array([[1, 2]], dtype=np.int64)}, ["embedding"],
                      {"truncate": True})
    assert body["inputs"][0] == {"name": "text", "shape": [2, 1], "datatype": "BYTES", "data": ["a", "b"]}
    assert body["inputs"][1] == {"name": "input_ids", "shape": [1, 2], "datatype": "INT64", "data": [1, 2]}
    assert body["outputs"] == [{"name": "embedding", "parameters": {"binary_data": True}}]
    assert body["parameters"] == {"truncate": True}
    emb = np.arange(6, dtype="<f4").reshape(2, 3)
    cut = np.array([[0], [4]], dtype="<i8")
    head = json.dumps({"outputs": [
        {"name": "embedding", "datatype": "FP32", "shape": [2, 3], "parameters": {"binary_data_size": 24}},
        {"name": "truncated_tokens", "datatype": "INT64", "shape": [2, 1], "parameters": {"binary_data_size": 16}}]})
    out = parse_infer_response(head.encode() + emb.tobytes() + cut.tobytes(), len(head.encode()))
    np.testing.assert_array_equal(out["embedding"], emb)
    np.testing.assert_array_equal(out["truncated_tokens"], cut)
    plain = json.dumps({"outputs": [{"name": "score", "datatype": "FP32", "shape": [1, 1], "data": [0.5]}]})
    assert parse_infer_response(plain.encode(), None)["score"].tolist() == [[0.5]]


def test_tei_embed_shape_normalize_and_dimensions():
    raw = {"r": EncoderModel("r", "embedding", 8, dimensions=2, normalized=False)}
    call = tei_embed_request({"inputs": "x", "normalize": True, "truncate": True}, raw)
    assert (call.model, call.texts, call.normalize, call.parameters) == ("r", ("x",), True, {"truncate": True})
    assert tei_embed_response(call, np.array([[3.0, 4.0]])) == [[pytest.approx(0.6), pytest.approx(0.8)]]
    plain = tei_embed_request({"inputs": ["x", "y"], "normalize": False}, raw)
    assert tei_embed_response(plain, np.array([[3.0, 4.0], [1.0, 0.0]])) == [[3.0, 4.0], [1.0, 0.0]]
    assert tei_embed_request({"model": "m", "inputs": "x", "dimensions": 4}, EMB).dimensions == 4
    for req, param in (({"model": "e", "inputs": "x", "normalize": False}, "normalize"),  # unit length already
                       ({"model": "e", "inputs": "x", "dimensions": 4}, "dimensions"),
                       ({"model": "e", "inputs": [["a", "b"]]}, "inputs"), ({"inputs": "x"}, "model")):
        with pytest.raises(OpenAIError) as info:
            tei_embed_request(req, EMB)
        assert info.value.param == param
