"""``model-factory serve --openai-port`` serves encoders on the APIs RAG stacks call, through Triton's KServe infer.

One ``serve`` for the module, on a repository holding the session's MiniLM export (packaged, not built again) and
the zoo's random-weight reranker and sentiment classifier (FP32 exports, as tests/zoo_models.py makes them). The
``openai`` client (and LangChain's ``OpenAIEmbeddings`` where installed) drive ``/v1/embeddings`` unchanged; TEI's
``/embed``, ``/rerank`` and ``/predict`` and Cohere's ``/v1/rerank`` are called in their own shapes. Every answer
is compared with what the KServe path returns for the same inputs: the frontend adds no inference path of its own.
"""

from __future__ import annotations

import base64
import json
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import MINILM_COST

pytestmark = [pytest.mark.integration, pytest.mark.slow]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zoo_models  # noqa: E402

CLI = str(Path(sys.executable).parent / "model-factory")
TEXTS = ["A man is playing a guitar.", "The weather is lovely today, isn't it?",
         "Triton batches requests of different lengths together when the inputs are ragged."]
LONG = "word " * 300  # over MiniLM's 128 tokens
ZOO_COST = {"cost_model": "0.0005,2e-7,1e-9"}


@dataclass
class Served:
    openai: str  # http://host:port of the OpenAI frontend
    triton: str  # host:port of Triton's HTTP endpoint
    repo: Path
    events: Path


def _post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict, object]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def _zoo_member(make, root: Path, tokenizer_source: Path, repo: Path) -> None:
    from model_factory.build.repository import package_model
    from model_factory.build_engines.export import export_model
    from model_factory.recipe import load_recipe

    member = make(root, tokenizer_source)
    recipe = load_recipe(member.recipe, {"precisions": ["fp32"], "repository.path": str(repo)})
    export = export_model(recipe)
    package_model(recipe, {"model.onnx": export.onnx_path}, tokenizer_dir=export.tokenizer_dir, parameters=ZOO_COST)


@pytest.fixture(scope="module")
def served(tmp_path_factory, minilm_recipe, minilm_export):
    from model_factory.build.repository import package_model

    root = tmp_path_factory.mktemp("encoders")
    repo = root / "model_repository"
    minilm = replace(minilm_recipe, repository=replace(minilm_recipe.repository, path=repo))
    package_model(minilm, {"model.onnx": minilm_export.onnx_path}, tokenizer_dir=minilm_export.tokenizer_dir,
                  parameters={"cost_model": MINILM_COST})
    for make in (zoo_models.make_reranker, zoo_models.make_distilbert_classifier):
        _zoo_member(make, root, minilm_recipe.source.path, repo)
    events = root / "events.jsonl"
    proc = subprocess.Popen([CLI, "serve", "--allow-unsigned", "--http-port", "0", "--grpc-port", "0",
                             "--metrics-port", "0", "--watch-interval", "0", "--no-cost-cache", "--openai-port", "0",
                             "--events", str(events), str(repo)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out = []
        for line in proc.stdout:
            out.append(line)
            if "Ctrl-C to stop" in line:
                break
        text = "".join(out)
        openai_url = re.search(r"OpenAI\s+(http://\S+)/v1", text)
        triton_url = re.search(r"HTTP\s+http://(\S+)", text)
        assert openai_url and triton_url, text + proc.stderr.read() if proc.poll() is not None else text
        assert "minilm (embedding)" in text and "reranker (reranker)" in text and "sentiment (classification)" in text
        yield Served(openai_url.group(1), triton_url.group(1), repo, events)
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err


@pytest.fixture(scope="module")
def client(served):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{served.openai}/v1", api_key="unused", max_retries=0)


def kserve_embeddings(served: Served, texts) -> np.ndarray:
    from model_factory.measure.client import embed_texts

    return embed_texts(served.triton, "minilm", list(texts))


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def _tokens(served: Served, texts) -> int:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(served.repo / "minilm" / "1" / "tokenizer" / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return sum(len(e.ids) for e in tok.encode_batch(list(texts)))


@pytest.mark.parametrize("encoding_format", [None, "float", "base64"])
def test_openai_client_embeddings_equal_the_kserve_path(served, client, encoding_format) -> None:
    kwargs = {"encoding_format": encoding_format} if encoding_format else {}  # None: the client's default (base64)
    res = client.embeddings.create(model="minilm", input=TEXTS, **kwargs)
    if encoding_format == "base64":  # asked for explicitly, the client hands the text over as it came
        got = np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in res.data])
    else:  # the client's default asks for base64 and decodes it itself
        got = np.array([d.embedding for d in res.data], dtype=np.float32)
    assert got.shape == (3, 384) and [d.index for d in res.data] == [0, 1, 2]
    assert cosine(got, kserve_embeddings(served, TEXTS)).min() > 0.9999
    assert res.usage.prompt_tokens == res.usage.total_tokens == _tokens(served, TEXTS)
    one = client.embeddings.create(model="minilm", input=TEXTS[1], encoding_format="float")
    assert cosine(np.array(one.data[0].embedding), got[1]) > 0.9999


def test_token_ids_of_different_lengths_equal_the_texts(served, client) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(served.repo / "minilm" / "1" / "tokenizer" / "tokenizer.json"))
    tok.no_padding()
    ids = [e.ids for e in tok.encode_batch(TEXTS)]
    res = client.embeddings.create(model="minilm", input=ids, encoding_format="float")
    got = np.array([d.embedding for d in res.data], dtype=np.float32)
    assert cosine(got, kserve_embeddings(served, TEXTS)).min() > 0.9999
    assert res.usage.prompt_tokens == sum(map(len, ids))


def test_more_inputs_than_a_batch_are_answered_in_order(served, client) -> None:
    texts = [f"{TEXTS[i % 3]} number {i}" for i in range(150)]  # max_batch_size is 64: three infer calls
    res = client.embeddings.create(model="minilm", input=texts)
    got = np.array([d.embedding for d in res.data], dtype=np.float32)
    assert got.shape == (150, 384)
    want = np.concatenate([kserve_embeddings(served, texts[i:i + 50]) for i in range(0, 150, 50)])
    assert cosine(got, want).min() > 0.9999


def test_refusals_are_openai_errors(served, client) -> None:
    import openai

    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="x")
    with pytest.raises(openai.NotFoundError):  # a reranker is not an embedding model
        client.embeddings.create(model="reranker", input="x")
    with pytest.raises(openai.BadRequestError) as info:  # MiniLM was not trained Matryoshka-style
        client.embeddings.create(model="minilm", input="x", dimensions=128)
    assert info.value.body["param"] == "dimensions"
    assert client.embeddings.create(model="minilm", input="x", dimensions=384).data[0].embedding


def test_a_long_text_keeps_the_long_input_policy_and_the_request_id(served) -> None:
    url = f"{served.openai}/v1/embeddings"
    status, headers, body = _post(url, {"model": "minilm", "input": ["short", LONG]}, {"X-Request-ID": "emb-long-1"})
    assert status == 400 and headers["X-Request-ID"] == "emb-long-1"
    assert "over this model's limit of 128" in body["error"]["message"], body  # the backend's own message
    status, _, body = _post(url, {"model": "minilm", "input": ["short", LONG], "truncate": True})
    assert status == 200 and body["usage"]["prompt_tokens"] == _tokens(served, ["short"]) + 128
    status, _, chunked = _post(url, {"model": "minilm", "input": [LONG], "long_inputs": "chunk",
                                     "encoding_format": "float"})
    assert status == 200 and abs(np.linalg.norm(chunked["data"][0]["embedding"]) - 1) < 1e-4
    events = [json.loads(line) for line in served.events.read_text().splitlines()]
    refused = [e for e in events if e.get("event") == "input_refused" and e.get("request_id") == "emb-long-1"]
    assert refused and refused[0]["id_source"] == "header"


def test_tei_embed_equals_the_kserve_path(served) -> None:
    status, headers, body = _post(f"{served.openai}/embed", {"inputs": TEXTS}, {"X-Request-ID": "tei-embed-1"})
    assert status == 200 and headers["X-Request-ID"] == "tei-embed-1"
    assert cosine(np.array(body, dtype=np.float32), kserve_embeddings(served, TEXTS)).min() > 0.9999
    status, _, body = _post(f"{served.openai}/embed", {"inputs": LONG})
    assert status == 400 and "over this model's limit" in body["error"] and body["error_type"] == "Validation"
    status, _, body = _post(f"{served.openai}/embed", {"inputs": LONG, "truncate": True})
    assert status == 200 and len(body) == 1 and len(body[0]) == 384


def test_models_lists_the_encoders(served) -> None:
    listed = json.loads(urllib.request.urlopen(f"{served.openai}/v1/models", timeout=10).read())
    tasks = {m["id"]: m["task"] for m in listed["data"]}
    assert tasks == {"minilm": "embedding", "reranker": "reranker", "sentiment": "classification"}
    assert next(m for m in listed["data"] if m["id"] == "minilm")["dimensions"] == 384


def _kserve_scores(served: Served, query: str, docs: list[str]) -> np.ndarray:
    from model_factory.measure.client import infer_tensors

    strings = lambda values: np.array([[v.encode()] for v in values], dtype=np.object_)  # noqa: E731
    return infer_tensors(served.triton, "reranker", {"query": strings([query] * len(docs)), "passage": strings(docs)},
                         outputs=("score",))["score"][:, 0]


def test_tei_rerank_shape_and_scores(served) -> None:
    query, docs = "restart the router", TEXTS + ["Please restart the router and wait two minutes."]
    raw = _kserve_scores(served, query, docs)
    status, headers, body = _post(f"{served.openai}/rerank", {"query": query, "texts": docs, "raw_scores": True,
                                                               "return_text": True})
    assert status == 200 and "X-Request-ID" in headers
    assert [r["index"] for r in body] == list(np.argsort(-raw, kind="stable"))
    np.testing.assert_allclose([r["score"] for r in body], np.sort(raw)[::-1], rtol=1e-5, atol=1e-6)
    assert all(r["text"] == docs[r["index"]] for r in body)
    status, _, body = _post(f"{served.openai}/rerank", {"query": query, "texts": docs})
    np.testing.assert_allclose(sorted(r["score"] for r in body), sorted(1 / (1 + np.exp(-raw))), rtol=1e-5)
    assert "text" not in body[0]
    status, _, body = _post(f"{served.openai}/rerank", {"query": query, "texts": [LONG]})
    assert status == 400 and "error" in body and body["error_type"] == "Validation"  # TEI's error shape
    status, _, body = _post(f"{served.openai}/rerank", {"query": query, "texts": [LONG], "truncate": True})
    assert status == 200 and len(body) == 1


def test_cohere_rerank_shape(served) -> None:
    query, docs = "restart the router", TEXTS
    raw = _kserve_scores(served, query, docs)
    status, _, body = _post(f"{served.openai}/v1/rerank", {"model": "reranker", "query": query,
                                                            "documents": [{"text": d} for d in docs], "top_n": 2})
    assert status == 200 and body["model"] == "reranker" and len(body["results"]) == 2
    best = int(np.argmax(raw))
    assert body["results"][0]["index"] == best and body["results"][0]["document"] == {"text": docs[best]}
    assert abs(body["results"][0]["relevance_score"] - 1 / (1 + np.exp(-raw[best]))) < 1e-5
    assert body["usage"]["total_tokens"] > 0
    status, _, body = _post(f"{served.openai}/v1/rerank", {"model": "minilm", "query": query, "documents": docs})
    assert status == 404 and body["error"]["param"] == "model"


def test_tei_predict_labels_and_scores(served) -> None:
    from model_factory.measure.client import embed_texts

    logits = embed_texts(served.triton, "sentiment", TEXTS, output="logits")
    status, _, body = _post(f"{served.openai}/predict", {"inputs": TEXTS[0]})
    assert status == 200 and {r["label"] for r in body} == {"negative", "positive"}
    p = np.exp(logits[0]) / np.exp(logits[0]).sum()
    assert body[0]["label"] == ("negative", "positive")[int(np.argmax(p))]
    assert abs(body[0]["score"] - p.max()) < 1e-5
    status, _, body = _post(f"{served.openai}/predict", {"inputs": TEXTS, "raw_scores": True})
    assert status == 200 and len(body) == 3
    for row, want in zip(body, logits):
        got = {r["label"]: r["score"] for r in row}
        np.testing.assert_allclose([got["negative"], got["positive"]], want, rtol=1e-5, atol=1e-6)


def test_langchain_openai_embeddings(served) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    # check_embedding_ctx_length=False: LangChain would otherwise tokenize with tiktoken's OpenAI vocabulary
    # (downloaded on first use) and send token ids of that vocabulary, which are not this model's.
    emb = langchain_openai.OpenAIEmbeddings(model="minilm", base_url=f"{served.openai}/v1", api_key="unused",
                                            check_embedding_ctx_length=False)
    got = np.array(emb.embed_documents(TEXTS), dtype=np.float32)
    assert cosine(got, kserve_embeddings(served, TEXTS)).min() > 0.9999
    assert cosine(np.array(emb.embed_query(TEXTS[0])), got[0]) > 0.9999
