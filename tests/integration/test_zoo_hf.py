"""The Hugging Face half of the model zoo, end to end on the real Triton server.

Four tiny random-init models made in the test (tests/zoo_models.py; no downloads): a BERT-style
encoder with ``token_type_ids`` (embeddings), a DistilBERT sequence classifier (no
``token_type_ids``; logits, probabilities and a label file), a BERT token classifier (per-token
logits) and a BERT cross-encoder reranker (query + passage in, one score out). Each is built at
FP32/FP16/INT8 with its task's gate, packaged as one deployment per precision, served by one
server for the whole module, queried over HTTP and gRPC and compared with the transformers model,
and sent a bad request that is answered 400 for itself alone.
"""

from __future__ import annotations

import concurrent.futures
import json
import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zoo_models  # noqa: E402

PRECISIONS = ("fp32", "fp16", "int8")
TEXTS = ["John lives in Paris.", "The quarterly report shows revenue grew by twelve percent.",
         "Please restart the router and wait two minutes before trying to connect again, then call us."]
PAIRS = [("restart the router", TEXTS[2]), ("restart the router", TEXTS[0]), ("revenue growth", TEXTS[1])]
# Largest difference from the transformers model, relative to the output's magnitude.
TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2, "int8": 0.15}
# A fixed cost model: the deployments load without the warm-up measurement (the grouping is tested elsewhere).
FIXED_COST = {"cost_model": "0.0005,2e-7,1e-9"}
# The queue's wait before Triton sheds a request (``shed_by = "age"``; default 300 ms). Twelve deployments share
# one server here, and on a loaded 2-core CI runner a lone request waited past 300 ms: CI shed single requests
# three times (encoder-int8-http, reranker-fp16-grpc, and a good request beside a bad one, ner-grpc). These tests
# compare answers, so they give the queue 30 s; shedding by age is tested in test_shed_by_age.py.
QUEUE = {"batching.queue_budget_ms": 30_000}


def deployment(name: str, precision: str) -> str:
    return name if precision == "fp32" else f"{name}-{precision}"


@dataclasses.dataclass
class Zoo:
    server: object
    models: dict
    repo: Path


@pytest.fixture(scope="module")
def zoo(tmp_path_factory, minilm_recipe):
    """Every zoo model built (FP32/FP16/INT8, gate per task), one deployment per precision, one server."""
    from model_factory.build.pipeline import build
    from model_factory.recipe import load_recipe
    from model_factory.build.repository import config_parameters, package_model, read_config
    from model_factory.serving.server import ServerOptions, TritonServer

    root = tmp_path_factory.mktemp("zoo")
    tokenizer_source = minilm_recipe.source.path
    models = {}
    for make in zoo_models.MAKERS:
        member = make(root, tokenizer_source)
        recipe = load_recipe(member.recipe, {**member.overrides, **QUEUE})
        result = build(recipe, parameters=FIXED_COST)
        assert result.accuracy is not None and result.accuracy["passed"], result.accuracy
        for precision in ("fp16", "int8"):  # one deployment per precision: [repository] serve
            served = dataclasses.replace(recipe, name=deployment(recipe.name, precision),
                                         repository=dataclasses.replace(recipe.repository, serve=precision))
            packaged = package_model(served, result.artifacts, tokenizer_dir=recipe.work_dir / "export" / "tokenizer",
                                     parameters=FIXED_COST)
            params = config_parameters(read_config(packaged.model_dir))
            assert (params["precision"], params["onnx_file"]) == (precision, f"model.{precision}.onnx")
        models[member.name] = (member, recipe, result)
    repo = root / "model_repository"
    server = TritonServer(repo, options=ServerOptions(0, 0, 0)).start()
    yield Zoo(server, models, repo)
    assert server.stop() == 0


_REFERENCES: dict = {}


def _reference(member, texts_or_pairs) -> dict[str, list[np.ndarray]]:
    """The transformers model's outputs, one sample at a time (unpadded), as the task defines them."""
    key = (member.name, tuple(texts_or_pairs))
    if key not in _REFERENCES:
        _REFERENCES[key] = _compute_reference(member, texts_or_pairs)
    return _REFERENCES[key]


def _compute_reference(member, texts_or_pairs) -> dict[str, list[np.ndarray]]:
    import torch
    import transformers

    folder = str(member.folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    cls = {"embedding": "AutoModel", "classification": "AutoModelForSequenceClassification",
           "token-classification": "AutoModelForTokenClassification",
           "reranker": "AutoModelForSequenceClassification"}[member.task]
    model = getattr(transformers, cls).from_pretrained(folder, local_files_only=True).eval()
    out: dict[str, list[np.ndarray]] = {}
    for sample in texts_or_pairs:
        args = sample if isinstance(sample, tuple) else (sample,)
        enc = tok(*args, truncation=True, max_length=64, return_tensors="pt")
        if not member.token_type_ids:
            enc.pop("token_type_ids", None)
        with torch.no_grad():
            res = model(**enc)
        if member.task == "embedding":
            mask = enc["attention_mask"].unsqueeze(-1).float()
            emb = (res.last_hidden_state * mask).sum(1) / mask.sum(1)
            out.setdefault("embedding", []).append(torch.nn.functional.normalize(emb, dim=1)[0].numpy())
        elif member.task == "reranker":
            out.setdefault("score", []).append(res.logits[0, :1].numpy())
        else:
            out.setdefault("logits", []).append(res.logits[0].numpy())
            out.setdefault("probabilities", []).append(torch.softmax(res.logits, -1)[0].numpy())
        out.setdefault("input_ids", []).append(enc["input_ids"][0].numpy())
        out.setdefault("token_type_ids", []).append(enc.get("token_type_ids", enc["input_ids"] * 0)[0].numpy())
    return out


def _client(protocol: str, zoo: Zoo):
    import tritonclient.grpc as tg
    import tritonclient.http as th

    if protocol == "grpc":
        return tg, tg.InferenceServerClient(zoo.server.grpc_url)
    # tritonclient.http's 60 s defaults: on a loaded 2-core CI runner a request queued behind the other
    # instances' work once outlasted them (geventhttpclient's get_socket failed); the gRPC client has no such bound.
    return th, th.InferenceServerClient(zoo.server.http_url, connection_timeout=600.0, network_timeout=600.0)


def _bytes_input(module, name: str, values) -> object:
    t = module.InferInput(name, [len(values), 1], "BYTES")
    t.set_data_from_numpy(np.array([[v.encode()] for v in values], dtype=np.object_))
    return t


def _text_inputs(module, task: str, samples) -> list:
    if task == "reranker":
        return [_bytes_input(module, "query", [q for q, _ in samples]),
                _bytes_input(module, "passage", [p for _, p in samples])]
    return [_bytes_input(module, "text", samples)]


def _close(got: np.ndarray, want: np.ndarray, precision: str, magnitude: float | None = None) -> None:
    """``got`` within the precision's tolerance of ``want``, relative to the output's magnitude: ``want``'s own, or
    ``magnitude`` (the largest over all samples: a reranker's one score per pair can sit near 0 for one pair)."""
    scale = max(float(np.abs(want).max()) if magnitude is None else magnitude, 1e-3)
    assert got.shape == want.shape
    assert float(np.abs(got - want).max()) <= TOLERANCE[precision] * scale, (got, want)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", ["encoder", "sentiment", "ner", "reranker"])
def test_text_requests_match_transformers(zoo, name, precision, protocol) -> None:
    """One request per sample (the tagger's logits come back at each request's own length, unpadded)."""
    member, recipe, _ = zoo.models[name]
    samples = PAIRS if member.task == "reranker" else TEXTS
    ref = _reference(member, samples)
    outputs = [o.name for o in recipe.outputs if o.name != "last_hidden_state"]
    module, client = _client(protocol, zoo)
    try:
        scores = []
        for i, sample in enumerate(samples):
            result = client.infer(deployment(name, precision),
                                   _text_inputs(module, member.task, [sample]),
                                   outputs=[module.InferRequestedOutput(o) for o in outputs])
            for o in outputs:
                # A scalar score is compared at the scale of the scores over every pair: on a CPU without integer
                # dot products INT8 serves the 7-bit weight form (half the weights' resolution), whose error on a
                # pair scored near 0 is large against that one score, yet it keeps the ranking its gate scores.
                magnitude = max(float(np.abs(r).max()) for r in ref[o]) if member.task == "reranker" else None
                _close(result.as_numpy(o)[0], ref[o][i], precision, magnitude)
            if member.task == "reranker":
                scores.append(float(result.as_numpy("score")[0][0]))
            if member.task == "token-classification":
                assert result.as_numpy("logits").shape == (1, len(ref["input_ids"][i]), len(zoo_models.NER_LABELS))
            if member.task == "classification" and precision != "int8":
                assert int(np.argmax(result.as_numpy("logits")[0])) == int(np.argmax(ref["logits"][i]))
        if scores:  # the reranker's ranking of the pairs, what its accuracy gate scores, is transformers' own
            assert list(np.argsort(scores)) == list(np.argsort([float(r[0]) for r in ref["score"]])), scores
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("name", ["encoder", "reranker"])
def test_token_ids_with_token_type_ids(zoo, name, protocol) -> None:
    """The id path: input_ids + attention_mask + token_type_ids (a reranker's pair tokenized by the client)."""
    member, _, _ = zoo.models[name]
    samples = PAIRS if member.task == "reranker" else TEXTS
    ref = _reference(member, samples)
    output = "score" if member.task == "reranker" else "embedding"
    if member.task == "reranker":
        assert ref["token_type_ids"][0].max() == 1  # a pair: the passage's tokens are type 1
    module, client = _client(protocol, zoo)
    try:
        for i in range(len(samples)):
            ids = ref["input_ids"][i][None].astype(np.int64)
            inputs = []
            for key, arr in (("input_ids", ids), ("attention_mask", np.ones_like(ids)),
                             ("token_type_ids", ref["token_type_ids"][i][None].astype(np.int64))):
                t = module.InferInput(key, list(arr.shape), "INT64")
                t.set_data_from_numpy(arr)
                inputs.append(t)
            result = client.infer(name, inputs, outputs=[module.InferRequestedOutput(output)])
            _close(result.as_numpy(output)[0], ref[output][i], "fp32")
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_classification_extension_returns_labels(zoo, protocol) -> None:
    """class_count on the classifier's logits: Triton answers score:index:label from the packaged label file."""
    member, _, _ = zoo.models["sentiment"]
    ref = _reference(member, TEXTS[:1])["logits"][0]
    assert (zoo.repo / "sentiment" / "labels.txt").read_text().split() == list(zoo_models.SENTIMENT)
    module, client = _client(protocol, zoo)
    try:
        result = client.infer("sentiment", _text_inputs(module, "classification", TEXTS[:1]),
                              outputs=[module.InferRequestedOutput("logits", class_count=2)])
        top = [v.decode() if isinstance(v, bytes) else v for v in result.as_numpy("logits").ravel()]
    finally:
        client.close()
    assert len(top) == 2
    parsed = [t.split(":") for t in top]
    order = np.argsort(-ref)
    assert [int(p[1]) for p in parsed] == list(order)
    assert [p[2] for p in parsed] == [zoo_models.SENTIMENT[i] for i in order]
    np.testing.assert_allclose([float(p[0]) for p in parsed], ref[order], atol=1e-4)


def test_a_batch_of_texts_per_request(zoo) -> None:
    """Several texts in one request: the tagger pads only to the request's longest text, the rest are exact."""
    member, _, _ = zoo.models["ner"]
    ref = _reference(member, TEXTS)
    module, client = _client("http", zoo)
    try:
        got = client.infer("ner", _text_inputs(module, "token-classification", TEXTS)).as_numpy("logits")
    finally:
        client.close()
    lengths = [len(ids) for ids in ref["input_ids"]]
    assert got.shape == (3, max(lengths), len(zoo_models.NER_LABELS))
    for i, n in enumerate(lengths):
        _close(got[i, :n], ref["logits"][i], "fp32")


def _ids_inputs(module, ids: np.ndarray) -> list:
    out = []
    for key in ("input_ids", "attention_mask"):
        t = module.InferInput(key, list(ids.shape), "INT64")
        t.set_data_from_numpy(ids)
        out.append(t)
    return out


BAD = {  # one malformed request per model, and the message the client gets
    "encoder": (lambda m: [_bytes_input(m, "text", [""])], "empty"),
    "sentiment": (lambda m: [_bytes_input(m, "text", ["ok", "  "])], "empty"),
    "ner": (lambda m: _ids_inputs(m, np.ones((1, 65), np.int64)), "exceeds the maximum 64"),
    "reranker": (lambda m: [_bytes_input(m, "query", ["only a query"])], "passage"),
}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("name", ["encoder", "sentiment", "ner", "reranker"])
def test_bad_request_is_answered_alone(zoo, name, protocol) -> None:
    from tritonclient.utils import InferenceServerException

    member, _, _ = zoo.models[name]
    make_bad, message = BAD[name]
    module, _ = _client(protocol, zoo)
    samples = PAIRS if member.task == "reranker" else TEXTS

    def call(inputs):
        _, client = _client(protocol, zoo)
        try:
            return client.infer(name, inputs)
        finally:
            client.close()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        bad = pool.submit(call, make_bad(module))
        good = [pool.submit(call, _text_inputs(module, member.task, [s])) for s in samples]
        outcomes = [None if (e := f.exception()) is None else f"{type(e).__name__}: {e}" for f in good]
        with pytest.raises(InferenceServerException) as info:
            bad.result()
    status = str(info.value.status())
    assert ("400" in status) if protocol == "http" else ("INVALID_ARGUMENT" in status), (status, info.value.message())
    if message:
        assert message in info.value.message()
    assert outcomes == [None] * len(samples)


def test_accept_scores_each_task_with_its_own_metric(zoo) -> None:
    """Acceptance data written by build, replayed through the served engine, scored by the task's metrics."""
    from model_factory.serving.acceptance import accept_model

    want = {"encoder": ("cosine", ()), "sentiment": ("top1", ("logits_cosine",)),
            "ner": ("token_top1", ()), "reranker": ("ranking", ("correlation",))}
    for name, (metric, extra) in want.items():
        result = accept_model(zoo.repo / name)
        assert result.passed, (name, result.reason)
        primary = next(o for o in result.outputs if o.name == result.primary_output)
        assert (result.metric, primary.metric) == (metric, metric), name
        assert tuple(k for k, _ in primary.extra) == extra and result.score == primary.gate_score >= 0.999
        assert (result.engine, result.device) == ("onnxruntime", "cpu")
def test_label_file_is_signed_with_the_model(zoo, tmp_path) -> None:
    """labels.txt sits beside config.pbtxt, inside the signed unit: a changed label fails verification."""
    import shutil

    from model_factory.demo import write_key_policy
    from model_factory.signing import SignerConfig, generate_keypair, load_policy, sign_model_version
    from model_factory.signing import verify_repository

    repo = tmp_path / "repo"
    shutil.copytree(zoo.repo / "sentiment", repo / "sentiment")
    keys = generate_keypair(tmp_path / "keys")
    sign_model_version(repo / "sentiment", 1, SignerConfig(private_key=keys.private_key, password=None))
    policy = load_policy(write_key_policy(tmp_path / "policy.toml", [keys.public_key], require_provenance=False))
    assert [r.ok for r in verify_repository(repo, policy)] == [True]
    (repo / "sentiment" / "labels.txt").write_text("positive\nnegative\n")  # labels swapped
    [result] = verify_repository(repo, policy)
    assert not result.ok and "labels.txt changed" in " ".join(result.reasons)


def test_token_classifier_int8_engine_builds(zoo, tmp_path) -> None:
    """The heads go through the engine stage too: the tagger's INT8 Q/DQ graph with its per-token output
    becomes a strongly typed plan (ahead of time on this CPU with TensorRT-RTX; running it needs a GPU)."""
    from model_factory.build_engines.tensorrt import build_engines, plan_header_problems, tensorrt_available

    if tensorrt_available() is None:
        pytest.skip("neither tensorrt nor tensorrt_rtx is installed (pip install 'model-factory[tensorrt-rtx]')")
    _, recipe, result = zoo.models["ner"]
    [engine] = build_engines(recipe, {"int8": result.artifacts["model.int8.onnx"]}, out_dir=tmp_path / "engines")
    meta = json.loads(engine.metadata_path.read_text())
    assert meta["precision"] == "int8" and meta["strongly_typed"]
    assert {o["name"] for o in meta["outputs"]} == {"logits"} and len(meta["profiles"]) == 2
    assert plan_header_problems(engine.plan_path) in ([], None)


def test_readme_client_snippet_runs_against_the_zoo(zoo) -> None:
    """README's standard-client example, run as written (only the server address differs)."""
    import re

    snippet = next(b for b in re.findall(r"```python\n(.*?)```", zoo_models.README.read_text(), re.S)
                   if 'class_count=2' in b)
    scope: dict = {}
    exec(snippet.replace("localhost:8000", zoo.server.http_url.removeprefix("http://")), scope)  # noqa: S102
    scope["client"].close()
    top = [v.decode() for v in scope["top"].ravel()]
    assert len(top) == 2 and {t.split(":")[2] for t in top} == set(zoo_models.SENTIMENT)
    assert scope["scores"].shape == (2, 1) and scope["scores"].dtype == np.float32
