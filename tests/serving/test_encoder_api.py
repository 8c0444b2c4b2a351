"""The encoder routes of the OpenAI frontend against a stand-in for Triton's KServe ``infer`` (no server): what they
send (rows split by max_batch_size, token ids grouped by length, the request id header, the long-input parameters)
and how they map Triton's answers (400 with the backend's message, 503 with Retry-After)."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from model_factory.serving.encoder_models import EncoderModel
from model_factory.serving.openai_api import OpenAIFrontend

pytest.importorskip("aiohttp")

DIMS = 4


class FakeTriton:
    """Answers KServe infer: a text's vector is [len(text), row, 0, 1] (binary output), ids' [sum(ids), row, 0, 1];
    the text "bad" gets the backend's 400 naming its row in the call, "busy" Triton's 503. Every call is kept."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict, dict]] = []
        self.loop = asyncio.new_event_loop()
        self.port = 0
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        from aiohttp import web

        async def infer(request):
            body = json.loads(await request.read())
            self.calls.append((request.match_info["model"], body, dict(request.headers)))
            inputs = {t["name"]: t for t in body["inputs"]}
            if "text" in inputs or "query" in inputs:
                rows = inputs["text"]["data"] if "text" in inputs else inputs["passage"]["data"]
                if "bad" in rows:
                    return web.json_response({"error": f"text[{rows.index('bad')}] is bad, said the backend"},
                                             status=400)
                if "busy" in rows:
                    return web.json_response({"error": "Exceeds maximum queue size"}, status=503)
                sizes = [len(r) for r in rows]
            else:
                shape = inputs["input_ids"]["shape"]
                ids = np.asarray(inputs["input_ids"]["data"]).reshape(shape)
                sizes = [int(r.sum()) for r in ids]
            out = np.array([[s, i, 0, 1] for i, s in enumerate(sizes)], dtype="<f4")
            cut = np.zeros((len(sizes), 1), dtype="<i8")
            wanted = [o["name"] for o in body["outputs"]]
            tensors, blobs = [], b""
            for name in wanted:
                arr = cut if name == "truncated_tokens" else (out if name == "embedding" else out[:, :1])
                dtype = "INT64" if name == "truncated_tokens" else "FP32"
                tensors.append({"name": name, "datatype": dtype, "shape": list(arr.shape),
                                "parameters": {"binary_data_size": arr.nbytes}})
                blobs += arr.tobytes()
            head = json.dumps({"model_name": request.match_info["model"], "outputs": tensors}).encode()
            return web.Response(body=head + blobs, headers={"Inference-Header-Content-Length": str(len(head))},
                                content_type="application/octet-stream")

        async def serve():
            app = web.Application()
            app.router.add_post("/v2/models/{model}/infer", infer)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]

        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(serve())
        ready.set()
        self.loop.run_forever()


@pytest.fixture(scope="module")
def frontend():
    fake = FakeTriton()
    encoders = {"e": EncoderModel("e", "embedding", max_batch=4, dimensions=DIMS, normalized=True),
                "r": EncoderModel("r", "reranker", max_batch=4),
                "c": EncoderModel("c", "classification", max_batch=4, labels=("neg", "pos"))}
    with OpenAIFrontend(f"127.0.0.1:{fake.port}", {}, encoders=encoders) as front:
        yield front, fake


def _post(url: str, body: dict, headers: dict | None = None):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def test_rows_over_max_batch_go_as_several_calls_joined_in_order(frontend) -> None:
    front, fake = frontend
    fake.calls.clear()
    texts = ["a" * (i + 1) for i in range(10)]
    status, headers, body = _post(f"{front.url}/v1/embeddings", {"model": "e", "input": texts},
                                  {"X-Request-ID": "many-1"})
    assert status == 200 and headers["X-Request-ID"] == "many-1"
    assert [d["embedding"][0] for d in body["data"]] == [float(i + 1) for i in range(10)]
    assert sorted(len(c[1]["inputs"][0]["data"]) for c in fake.calls) == [2, 4, 4]  # max_batch 4
    assert all(c[2]["X-Request-ID"] == "many-1" for c in fake.calls)
    assert all(c[1]["outputs"] == [{"name": "embedding", "parameters": {"binary_data": True}},
                                   {"name": "truncated_tokens", "parameters": {"binary_data": True}}]
               for c in fake.calls)


def test_token_ids_are_grouped_by_length(frontend) -> None:
    front, fake = frontend
    fake.calls.clear()
    ids = [[1, 2], [5], [3, 4], [7, 8, 9]]
    status, _, body = _post(f"{front.url}/v1/embeddings", {"model": "e", "input": ids, "encoding_format": "float"})
    assert status == 200
    assert [d["embedding"][0] for d in body["data"]] == [3.0, 5.0, 7.0, 24.0]
    assert sorted(c[1]["inputs"][0]["shape"] for c in fake.calls) == [[1, 1], [1, 3], [2, 2]]
    assert body["usage"]["prompt_tokens"] == 8


def test_long_input_parameters_reach_triton(frontend) -> None:
    front, fake = frontend
    fake.calls.clear()
    assert _post(f"{front.url}/v1/embeddings", {"model": "e", "input": "x", "truncate": True})[0] == 200
    assert fake.calls[-1][1]["parameters"] == {"truncate": True}
    assert _post(f"{front.url}/rerank", {"query": "q", "texts": ["x"], "truncate": True})[0] == 200
    assert fake.calls[-1][1]["parameters"] == {"truncate": True}
    assert [t["name"] for t in fake.calls[-1][1]["inputs"]] == ["query", "passage"]


def test_the_backends_refusal_is_a_400_and_shedding_a_503(frontend) -> None:
    front, _ = frontend
    status, headers, body = _post(f"{front.url}/v1/embeddings", {"model": "e", "input": ["ok", "bad"]},
                                  {"X-Request-ID": "bad-1"})
    assert status == 400 and headers["X-Request-ID"] == "bad-1"
    assert body["error"]["message"] == "text[1] is bad, said the backend"
    texts = ["ok"] * 6 + ["bad"]  # the seventh row, the third of the second call (max_batch 4)
    status, _, body = _post(f"{front.url}/v1/embeddings", {"model": "e", "input": texts})
    assert status == 400 and body["error"]["message"] == "text[6] is bad, said the backend"
    status, headers, body = _post(f"{front.url}/v1/embeddings", {"model": "e", "input": "busy"})
    assert status == 503 and headers["Retry-After"] == "1" and body["error"]["type"] == "server_busy"
    status, _, body = _post(f"{front.url}/predict", {"inputs": "bad"})
    assert status == 400 and body == {"error": "text[0] is bad, said the backend", "error_type": "Validation"}


def test_a_body_that_is_not_json_and_an_unknown_model(frontend) -> None:
    front, _ = frontend
    req = urllib.request.Request(f"{front.url}/v1/embeddings", data=b"{nope",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 400
    status, _, body = _post(f"{front.url}/v1/embeddings", {"model": "c", "input": "x"})
    assert status == 404 and "use one of e" in body["error"]["message"]


def test_models_lists_the_encoders_with_their_task(frontend) -> None:
    front, _ = frontend
    listed = json.loads(urllib.request.urlopen(f"{front.url}/v1/models", timeout=30).read())["data"]
    assert [(m["id"], m["task"]) for m in listed] == [("c", "classification"), ("e", "embedding"), ("r", "reranker")]


def test_an_inference_server_out_of_reach_is_a_503() -> None:
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    encoders = {"e": EncoderModel("e", "embedding", max_batch=4, dimensions=DIMS)}
    with OpenAIFrontend(f"127.0.0.1:{port}", {}, encoders=encoders) as front:
        status, headers, body = _post(f"{front.url}/v1/embeddings", {"model": "e", "input": "x"})
    assert status == 503 and "cannot be reached" in body["error"]["message"] and headers["Retry-After"] == "1"


def test_concurrent_requests_each_get_their_own_vectors(frontend) -> None:
    """Sent at once over the frontend's kept-alive loopback connections: each answer holds its own texts' vectors."""
    from concurrent.futures import ThreadPoolExecutor

    front, fake = frontend
    fake.calls.clear()
    batches = [["x" * (k + 1)] * (1 + k % 3) for k in range(24)]
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda b: _post(f"{front.url}/v1/embeddings", {"model": "e", "input": b}), batches))
    assert all(status == 200 for status, _, _ in answers)
    assert [[d["embedding"][0] for d in body["data"]] for _, _, body in answers] == \
        [[float(len(b[0]))] * len(b) for b in batches]
    assert sum(len(c[1]["inputs"][0]["data"]) for c in fake.calls) == sum(len(b) for b in batches)


def test_truncated_tokens_is_asked_for_only_where_the_frontend_cannot_count_the_cut() -> None:
    """A model whose limit the frontend knows: refuse and truncate count usage here (min(tokens, limit) a text), so
    Triton is asked for the embedding alone; chunk still asks the backend what it dropped."""
    from model_factory.serving.encoder_api import long_input_mode

    fake = FakeTriton()
    model = EncoderModel("t", "embedding", max_batch=4, dimensions=DIMS, max_length=8, long_inputs="truncate")
    assert [long_input_mode(p, model) for p in (None, {"truncate": False}, {"long_inputs": "chunk"})] == \
        ["truncate", "refuse", "chunk"]
    with OpenAIFrontend(f"127.0.0.1:{fake.port}", {}, encoders={"t": model}) as front:
        asked = []
        for extra in ({}, {"truncate": True}, {"truncate": False}, {"long_inputs": "chunk"}):
            fake.calls.clear()
            assert _post(f"{front.url}/v1/embeddings", {"model": "t", "input": ["a", "b"], **extra})[0] == 200
            asked.append([o["name"] for o in fake.calls[-1][1]["outputs"]])
    assert asked == [["embedding"]] * 3 + [["embedding", "truncated_tokens"]]
