"""Request ids and decision events on the real server (``serve --events FILE``): a request's id, the client's
or its X-Request-ID header, is found in the events and comes back as the response id; no event holds an input
text; a flood of bad requests writes a bounded number of events and the server keeps serving."""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.integration

RATE = 4.0  # events a second per instance; burst 5x
SECRET_TEXTS = ["the vault code is seven nine four", "a patient record mentions a rare allergy"]


@pytest.fixture(scope="module")
def server(minilm_repository, tmp_path_factory):
    from model_factory.serving.server import ServerOptions, TritonServer

    events = tmp_path_factory.mktemp("events") / "events.jsonl"
    srv = TritonServer(minilm_repository, options=ServerOptions(0, 0, 0, events_file=events, events_rate=RATE))
    srv.start()
    srv.events_path = events
    yield srv
    srv.stop()


def _post(server, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/minilm/infer", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _texts(texts, **extra) -> dict:
    return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts), 1], "data": list(texts)}],
            "outputs": [{"name": "embedding"}], **extra}


def _events(server, until=None, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        path: Path = server.events_path
        lines = path.read_text().splitlines() if path.exists() else []
        events = [json.loads(line) for line in lines]
        if until is None or any(until(e) for e in events) or time.monotonic() > deadline:
            return events
        time.sleep(0.2)


def test_the_client_id_is_in_the_window_event_and_comes_back_in_the_response(server) -> None:
    status, answer = _post(server, _texts(SECRET_TEXTS, id="order-4711"))
    assert status == 200 and answer["id"] == "order-4711"  # the KServe response id
    events = _events(server, lambda e: "order-4711" in e.get("request_ids", ()))
    grouped = [e for e in events if e["event"] == "window_grouped" and "order-4711" in e["request_ids"]]
    assert grouped, events
    e = grouped[0]
    assert e["model"] == "minilm" and e["sequences"] == 2 and sum(e["groups"]) == 2
    assert e["computed_tokens"] >= e["real_tokens"] > 0 and e["padding_ratio"] >= 1.0


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_x_request_id_header_names_the_refusal_with_its_reason_and_input_hash(server, protocol) -> None:
    rid = f"hdr-{protocol}-1"
    long_text = " ".join(["word"] * 400)
    if protocol == "http":
        status, answer = _post(server, _texts([long_text]), headers={"X-Request-ID": rid})
        assert status == 400
    else:
        import tritonclient.grpc as tg
        from tritonclient.utils import InferenceServerException

        client = tg.InferenceServerClient(server.grpc_url)
        inp = tg.InferInput("text", [1, 1], "BYTES")
        inp.set_data_from_numpy(np.array([[long_text.encode()]], dtype=object))
        with pytest.raises(InferenceServerException, match="over this model's limit"):
            client.infer("minilm", [inp], headers={"x-request-id": rid})
        client.close()
    events = _events(server, lambda e: e.get("request_id") == rid)
    (refused,) = [e for e in events if e.get("request_id") == rid]
    assert refused["event"] == "input_refused" and refused["id_source"] == "header"
    assert "402 tokens, over this model's limit of 128" in refused["reason"]
    assert len(refused["input_hash"]) == 16


def test_a_truncated_text_is_a_long_input_event(server) -> None:
    text = " ".join(["river"] * 300)
    status, _ = _post(server, _texts([text], id="cut-1", parameters={"long_inputs": "truncate"}))
    assert status == 200
    events = _events(server, lambda e: e.get("request_id") == "cut-1")
    (e,) = [e for e in events if e.get("request_id") == "cut-1"]
    assert e["event"] == "long_input" and e["action"] == "truncated" and e["dropped_tokens"] == [302 - 128]


def test_no_event_holds_an_input_text(server) -> None:
    text = server.events_path.read_text()
    assert text.strip()
    for sent in SECRET_TEXTS + ["word word word", "river river"]:
        assert sent not in text
    for word in ("vault", "allergy"):
        assert word not in text


def test_a_flood_of_bad_requests_writes_a_bounded_count_and_the_server_keeps_serving(server) -> None:
    before = len(_events(server))
    start = time.monotonic()
    bad = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": ["   "]}]}  # an empty text
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda _: _post(server, bad)[0], range(400)))
    elapsed = time.monotonic() - start
    assert codes.count(400) == 400
    time.sleep(1.5)
    events = _events(server)[before:]
    refused = [e for e in events if e["event"] == "input_refused"]
    instances = 2  # the recipe's instance_count: each instance has its own bucket
    bound = instances * (5 * RATE + RATE * (elapsed + 1.5)) + 2
    assert 0 < len(refused) <= bound < 400, (len(refused), bound, elapsed)
    assert sum(e.get("dropped", 0) for e in events) > 0  # what was dropped is said
    status, answer = _post(server, _texts(["still serving"]))
    assert status == 200 and len(answer["outputs"][0]["data"]) == 384
    from model_factory.measure.bench import scrape_metrics

    deadline = time.monotonic() + 10
    while True:
        dropped = sum(s.value for s in scrape_metrics(server.metrics_url) if s.name == "model_factory_events_dropped_total")
        if dropped > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert dropped >= 400 - len(refused) - instances * 5 * RATE  # the rest counted (sent at the next window)
