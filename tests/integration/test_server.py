"""End to end on the real Triton server: HTTP and gRPC clients, outputs vs PyTorch, per-request errors."""

from __future__ import annotations

import concurrent.futures
import urllib.request

import numpy as np
import pytest

pytestmark = pytest.mark.integration

TEXTS = ["A man is playing a guitar.", "The weather is lovely today, isn't it?",
         "Triton batches requests of different lengths together when the inputs are ragged."]


@pytest.fixture(scope="module")
def torch_reference(minilm_recipe):
    """Mean-pooled, normalized MiniLM embeddings from PyTorch (the sentence-transformers recipe)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    path = str(minilm_recipe.source.path)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    with torch.no_grad():
        enc = tok(TEXTS, padding=True, truncation=True, max_length=128, return_tensors="pt")
        hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        emb = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1)
    return emb.numpy(), enc


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_text_round_trip_matches_pytorch(triton, torch_reference, protocol) -> None:
    from model_factory.measure.client import embed_texts

    url = triton.http_url if protocol == "http" else triton.grpc_url
    emb = embed_texts(url, "minilm", TEXTS, protocol=protocol)
    assert emb.shape == (3, 384) and emb.dtype == np.float32
    assert cosine(emb, torch_reference[0]).min() > 0.9999


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_token_id_round_trip(triton, torch_reference, protocol) -> None:
    from model_factory.measure.client import infer_ids

    _, enc = torch_reference
    url = triton.http_url if protocol == "http" else triton.grpc_url
    # One request per sentence, unpadded, as a client would send them.
    for i in range(len(TEXTS)):
        n = int(enc["attention_mask"][i].sum())
        out = infer_ids(url, "minilm", enc["input_ids"][i: i + 1, :n].numpy(),
                        enc["attention_mask"][i: i + 1, :n].numpy(), protocol=protocol,
                        outputs=("embedding", "last_hidden_state"))
        assert out["last_hidden_state"].shape == (1, n, 384)
        assert cosine(out["embedding"][0], torch_reference[0][i]) > 0.9999


def test_concurrent_mixed_lengths_are_batched_and_correct(triton, torch_reference) -> None:
    """Many concurrent requests of different lengths: each answer is its own sentence's embedding."""
    from model_factory.measure.client import embed_texts

    texts = [TEXTS[i % 3] + " word" * (i % 7) for i in range(24)]
    expected = {t: embed_texts(triton.http_url, "minilm", [t])[0] for t in set(texts)}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda t: embed_texts(triton.http_url, "minilm", [t])[0], texts))
    for t, e in zip(texts, got):
        assert cosine(e, expected[t]) > 0.99999


def test_bad_requests_get_invalid_argument_and_server_keeps_serving(triton) -> None:
    import tritonclient.grpc as tg
    import tritonclient.http as th
    from tritonclient.utils import InferenceServerException

    from model_factory.measure.client import embed_texts, infer_ids

    too_long = np.ones((1, 129), dtype=np.int64)
    with pytest.raises(InferenceServerException) as info:
        infer_ids(triton.http_url, "minilm", too_long, too_long)
    assert "400" in str(info.value.status()) and "exceeds the maximum 128" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        infer_ids(triton.grpc_url, "minilm", too_long, too_long, protocol="grpc")
    assert "INVALID_ARGUMENT" in str(info.value.status())
    # Wrong dtype is refused by Triton itself, before the backend.
    client = th.InferenceServerClient(triton.http_url)
    try:
        bad = th.InferInput("input_ids", [1, 4], "FP32")
        bad.set_data_from_numpy(np.ones((1, 4), np.float32))
        with pytest.raises(InferenceServerException):
            client.infer("minilm", [bad])
        empty = th.InferInput("text", [1, 1], "BYTES")
        empty.set_data_from_numpy(np.array([[b""]], dtype=object))
        with pytest.raises(InferenceServerException, match="empty"):
            client.infer("minilm", [empty])
    finally:
        client.close()
    # A bad request in the same window as good ones fails alone.
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(infer_ids, triton.grpc_url, "minilm", too_long, too_long, "grpc")]
        futures += [pool.submit(embed_texts, triton.grpc_url, "minilm", [t], "grpc") for t in TEXTS * 2]
        outcomes = [f.exception() for f in futures]
    assert isinstance(outcomes[0], tg.InferenceServerException)
    assert all(o is None for o in outcomes[1:])
    assert embed_texts(triton.http_url, "minilm", ["still serving"]).shape == (1, 384)


def test_metrics_endpoint_is_up(triton) -> None:
    with urllib.request.urlopen(triton.metrics_url, timeout=5) as r:
        body = r.read().decode()
    assert 'nv_inference_request_success{model="minilm"' in body
    # Our backend's own metrics (docs/metrics.md), after the requests of the earlier tests.
    for name in ("model_factory_computed_tokens_total", "model_factory_groups_total",
                 "model_factory_cost_model_a_seconds"):
        assert name in body, name


def test_a_lone_client_borrows_the_idle_cores(triton, torch_reference) -> None:
    """Two CPU instances split the cores; a request alone in its window runs on every core (idle_cores).

    Deterministic on a busy machine too: a run borrows when no other instance of the server is computing, as the
    shared ledger says, and an instance marks itself computing for its whole ``execute()``, which may still be
    ending (the response already sent) when the client's next request reaches the other instance. So each request
    is sent once the ledger shows no instance computing, as a lone client's next request finds it when the server
    is not slowed by other work; then every one of them borrows, and each borrow is counted.
    """
    import time

    from model_factory.backend.batching.idle_cores import RUNTIME_DIR_ENV, BusyLedger, ledger_path
    from model_factory.backend.engines.loading import available_cpus
    from model_factory.measure import bench
    from model_factory.measure.client import embed_texts

    cores = available_cpus()
    if cores < 2:
        pytest.skip(f"one usable core here: nothing to lend")
    info = [s.labels for s in bench.scrape_metrics(triton.metrics_url) if s.name == "model_factory_engine_info"]
    assert info and all(x["threads"] == str(max(1, cores // 2)) and x["wide_threads"] == str(cores) for x in info)
    # The ledger the instances share (named after their parent, the server); probed as process id 1, which no
    # instance is: its check covers every instance's byte and the borrowers' byte 0.
    path = ledger_path({RUNTIME_DIR_ENV: str(triton.work_dir)}, triton.process.pid)
    assert path.is_file(), f"no ledger at {path}"
    probe = BusyLedger(path, me=1)

    def borrowed() -> float:
        return bench.metric_total(bench.scrape_metrics(triton.metrics_url), "model_factory_borrowed_core_runs_total",
                                  model="minilm") or 0.0

    def wait_idle() -> None:
        deadline = time.monotonic() + 10
        while probe.others_busy():
            assert time.monotonic() < deadline, "an instance kept computing for 10 s with no request in flight"
            time.sleep(0.01)

    try:
        time.sleep(1.5)  # counters are flushed about once a second
        before = borrowed()
        for text in TEXTS:  # one client, one request at a time
            wait_idle()
            emb = embed_texts(triton.grpc_url, "minilm", [text], protocol="grpc")[0]
            expected = torch_reference[0][TEXTS.index(text)]
            assert float(cosine(emb, expected)) > 0.9999
        wait_idle()
        deadline = time.monotonic() + 10
        while borrowed() - before < len(TEXTS) and time.monotonic() < deadline:
            time.sleep(0.3)
        assert borrowed() - before == len(TEXTS)
        # The other side of the decision: while another instance computes (the probe holds an instance's byte),
        # a lone request keeps its own share of the cores.
        with probe.busy():
            embed_texts(triton.grpc_url, "minilm", [TEXTS[0]], protocol="grpc")
        time.sleep(1.5)
        assert borrowed() - before == len(TEXTS)
    finally:
        probe.close()


def test_clean_shutdown(minilm_repository) -> None:
    """A separate server instance: SIGTERM ends it with exit code 0."""
    from model_factory.serving.server import ServerOptions, TritonServer

    server = TritonServer(minilm_repository, options=ServerOptions(0, 0, 0)).start()
    assert server.ready_models == ["minilm"]
    assert server.stop() == 0
