"""A 600-word text on the real server: refused with its length and the limit by default, truncated with the cut
said in the response and counted in /metrics, or chunked into one vector (docs/inputs.md)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

pytestmark = pytest.mark.integration

WORDS = ("the river carried silt from the mountains to the delta where farmers planted rice in the wet "
         "season and fished in the dry one while traders moved salt upstream").split()
LONG_TEXT = " ".join(WORDS[i % len(WORDS)] for i in range(600))  # 600 words, over 600 tokens


def _post(triton, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{triton.http_url}/v2/models/minilm/infer", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _text_body(texts, parameters=None, outputs=None) -> dict:
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts), 1], "data": list(texts)}]}
    if parameters:
        body["parameters"] = parameters
    if outputs:
        body["outputs"] = [{"name": n} for n in outputs]
    return body


def _outputs(answer: dict) -> dict:
    return {o["name"]: np.asarray(o["data"]).reshape(o["shape"]) for o in answer["outputs"]}


def _counter(triton, name: str, **labels) -> float:
    from model_factory.measure.bench import scrape_metrics

    return sum(s.value for s in scrape_metrics(triton.metrics_url)
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _tokens(minilm_export) -> int:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(minilm_export.tokenizer_dir / "tokenizer.json"))
    tok.no_truncation()  # the saved tokenizer truncates at 128
    return len(tok.encode(LONG_TEXT).ids)


def test_a_long_text_is_refused_by_default_naming_its_length_and_the_limit(triton, minilm_export) -> None:
    n = _tokens(minilm_export)
    assert n > 600
    status, answer = _post(triton, _text_body(["a short one", LONG_TEXT]))
    assert status == 400, answer
    assert f"text[1] is {n} tokens, over this model's limit of 128" in answer["error"]
    assert "long_inputs=truncate" in answer["error"]


def test_truncate_answers_with_the_dropped_count_in_the_response_and_the_metric(triton, minilm_export) -> None:
    import time

    n = _tokens(minilm_export)
    before = _counter(triton, "model_factory_truncated_tokens_total")
    rows_before = _counter(triton, "model_factory_long_inputs_total", action="truncated")
    status, answer = _post(triton, _text_body([LONG_TEXT, "a short one"], {"long_inputs": "truncate"},
                                              ["embedding", "truncated_tokens"]))
    assert status == 200, answer
    out = _outputs(answer)
    assert out["embedding"].shape == (2, 384)
    assert out["truncated_tokens"].reshape(-1).tolist() == [n - 128, 0]
    # text-embeddings-inference's spelling does the same; with no outputs named, truncated_tokens comes too.
    status, answer = _post(triton, _text_body([LONG_TEXT], {"truncate": True}))
    assert status == 200 and _outputs(answer)["truncated_tokens"].reshape(-1).tolist() == [n - 128]
    deadline = time.monotonic() + 10  # counters are sent about once a second
    while _counter(triton, "model_factory_truncated_tokens_total") < before + 2 * (n - 128):
        assert time.monotonic() < deadline, "truncated tokens were not counted"
        time.sleep(0.3)
    assert _counter(triton, "model_factory_truncated_tokens_total") == before + 2 * (n - 128)
    assert _counter(triton, "model_factory_long_inputs_total", action="truncated") == rows_before + 2


def test_chunk_answers_one_vector_close_to_the_truncated_one_and_unit_length(triton) -> None:
    status, answer = _post(triton, _text_body([LONG_TEXT, "a short one"], {"long_inputs": "chunk"}))
    assert status == 200, answer
    out = _outputs(answer)
    assert set(out) == {"embedding", "truncated_tokens"}  # a chunked text has no single token sequence
    assert out["embedding"].shape == (2, 384)
    assert abs(float(np.linalg.norm(out["embedding"][0])) - 1.0) < 1e-5
    assert out["truncated_tokens"].reshape(-1).tolist() == [0, 0]  # nothing unseen
    _, short = _post(triton, _text_body(["a short one"], outputs=["embedding"]))
    np.testing.assert_allclose(out["embedding"][1], _outputs(short)["embedding"][0], atol=1e-5)
    _, cut = _post(triton, _text_body([LONG_TEXT], {"long_inputs": "truncate"}, ["embedding"]))
    cos = float(out["embedding"][0] @ _outputs(cut)["embedding"][0])
    assert 0.5 < cos < 0.9999  # the same topic, but the whole text: not the first 128 tokens alone
    status, answer = _post(triton, _text_body([LONG_TEXT], {"long_inputs": "chunk"}, ["last_hidden_state"]))
    assert status == 400 and "per token" in answer["error"]
