"""The model-server protocol's metrics scraped from the real server while a text-generation model runs.

The Gateway API Inference Extension's endpoint picker reads ``/metrics`` on the pool's target port, the OpenAI port
(docs/fleet.md, "LLM fleets behind an InferencePool"); each metric is checked against the protocol's definition
(gateway-api-inference-extension docs/proposals/003-model-server-protocol, as the picker reads them under vLLM's
names): queued requests are the requests not yet in the running batch, running requests those in it, KV-cache
utilization a fraction 0..1 of the cache, the LoRA info metric's labels the adapters (none here: max 0, empty lists)
and its value a recent timestamp. One server for the module, the session's tiny Llama (tests/conftest.py ``tiny_llm``,
built once per session by tests/generative_repository.py) with 2 KV slots, so that of 10 streams 2 run and the rest
wait.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.request

import pytest

from model_factory.measure.bench import parse_prometheus
from model_factory.serving.pool_metrics import VLLM_COUNTERS
from tests.generative_repository import layout_generative_model

pytestmark = pytest.mark.integration

MODEL, SLOTS, STREAMS, TOKENS = "tiny_llm", 2, 10, 1900
WAITING, RUNNING = "vllm:num_requests_waiting", "vllm:num_requests_running"
KV, KV_OLD, LORA = "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:lora_requests_info"


@pytest.fixture(scope="module")
def served(tiny_llm, tmp_path_factory):
    from model_factory.serving.openai_api import OpenAIFrontend, generative_models
    from model_factory.serving.server import ServerOptions, TritonServer

    hf, onnx_dir = tiny_llm
    repo = tmp_path_factory.mktemp("pool-metrics-repo")
    layout_generative_model(hf, onnx_dir, repo, MODEL, memory_budget_mib=256, max_active_sequences=SLOTS,
                            max_waiting_sequences=64)
    server = TritonServer(repo, options=ServerOptions(0, 0, 0)).start()
    assert not server.load_errors, server.load_errors
    frontend = OpenAIFrontend(server.http_url, generative_models(repo, server.ready_models),
                              metrics_url=server.metrics_url).start()
    yield server, frontend
    frontend.stop()
    rc = server.stop()
    assert rc == 0, server.log_tail(30)


def scrape(frontend) -> tuple[dict[str, float], dict[str, dict[str, str]], str]:
    """name -> value of the model's series, name -> its labels, and the content type, from the OpenAI port."""
    with urllib.request.urlopen(f"{frontend.url}/metrics", timeout=5) as resp:
        assert resp.status == 200
        ctype, text = resp.headers["Content-Type"], resp.read().decode()
    values, labels = {}, {}
    for s in parse_prometheus(text):
        if s.labels.get("model_name") == MODEL:
            assert s.name not in values, f"two series of {s.name} for one model: a picker reads only the first"
            values[s.name], labels[s.name] = s.value, dict(s.labels)
    return values, labels, ctype


def backend(server) -> dict[str, float]:
    """The backend's own gauges on Triton's metrics port, summed over the model's instances."""
    out: dict[str, float] = {}
    for s in parse_prometheus(urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()):
        if s.labels.get("model") == MODEL and s.name.startswith("model_factory_"):
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def _idle(values: dict[str, float]) -> bool:
    return values[WAITING] == 0 and values[RUNNING] == 0 and values[KV] == 0


def wait_idle(frontend, timeout_s: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        values = scrape(frontend)[0]
        if _idle(values) or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


def test_an_idle_server_reports_no_queue_no_batch_an_empty_cache_and_no_adapters(served):
    _, frontend = served
    values, labels, ctype = scrape(frontend)
    assert ctype.startswith("text/plain") and "version=0.0.4" in ctype  # Prometheus' text format
    assert set(values) == {WAITING, RUNNING, KV, KV_OLD, LORA, *VLLM_COUNTERS}  # the protocol's, and vLLM's counters
    assert _idle(wait_idle(frontend))
    values, labels, _ = scrape(frontend)
    assert values[KV_OLD] == values[KV] == 0
    assert values["vllm:spec_decode_num_drafts_total"] == 0  # speculation is off on this model
    assert labels[LORA] == {"model_name": MODEL, "max_lora": "0", "running_lora_adapters": "",
                            "waiting_lora_adapters": ""}
    assert abs(values[LORA] - time.time()) < 60  # the protocol's value: when it was written


class Stream:
    """One streamed completion on its own connection; ``close()`` goes away mid-stream (the server cancels it)."""

    def __init__(self, frontend) -> None:
        host, port = frontend.url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=120)
        self.first = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"}, body=json.dumps(
                {"model": MODEL, "prompt": "Copyright", "max_tokens": TOKENS, "min_tokens": TOKENS, "stream": True}))
            resp = self.conn.getresponse()
            assert resp.status == 200, resp.read()[:300]
            for line in resp:
                if line.startswith(b"data:"):
                    self.first.set()
                if line.strip() == b"data: [DONE]":
                    break
        except (OSError, http.client.HTTPException, ValueError, AttributeError) as exc:  # AttributeError: closed
            self.error = exc
        finally:
            self.done.set()

    def close(self) -> None:
        try:
            if self.conn.sock is not None:
                self.conn.sock.close()
        finally:
            self.conn.close()


def test_running_and_queued_requests_and_the_cache_follow_the_streams_then_return_to_zero(served, caplog):
    server, frontend = served
    assert _idle(wait_idle(frontend))
    streams = [Stream(frontend) for _ in range(STREAMS)]
    seen_full = seen_kv = None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(s.done.is_set() for s in streams):
            values = scrape(frontend)[0]
            # Never more in the batch than its slots, never more requests than were sent; KV a fraction.
            assert 0 <= values[RUNNING] <= SLOTS, values
            assert 0 <= values[WAITING] and values[RUNNING] + values[WAITING] <= STREAMS, values
            assert 0 <= values[KV] <= 1 and values[KV_OLD] == values[KV], values
            if values[RUNNING] == SLOTS and values[WAITING] > 0:
                seen_full = seen_full or values
                # KV use: what the running requests reserved over the budget, as the backend counts it (read again
                # until the backend's own gauges are of the same moment: both change once a second at most).
                own = backend(server)
                if own["model_factory_running_sequences"] == values[RUNNING] and seen_kv is None:
                    again = scrape(frontend)[0]
                    if again[RUNNING] == values[RUNNING] and again[KV] == values[KV]:
                        expected = own["model_factory_kv_cache_reserved_bytes"] / own["model_factory_kv_cache_budget_bytes"]
                        if abs(expected - values[KV]) < 1e-9:
                            seen_kv = values
            if seen_full and seen_kv:
                break
            time.sleep(0.1)
        assert seen_full, "never saw the batch full with requests queued behind it"
        assert seen_full[KV] > 0, seen_full  # two running requests hold cache
        assert seen_kv, "the KV use on the OpenAI port never matched the backend's reserved / budget"
        assert any(s.first.is_set() for s in streams), "the running requests streamed no token"
    finally:
        for s in streams:
            s.close()  # the clients go away: running and waiting sequences are dropped
        for s in streams:
            s.thread.join(timeout=30)
    values = wait_idle(frontend)
    assert _idle(values), values
    assert values[KV_OLD] == 0
    own = backend(server)
    assert own["model_factory_running_sequences"] == own["model_factory_waiting_sequences"] == 0
    # The clients that went away mid-stream ended their streams quietly (no handler traceback from the frontend).
    errors = [r.getMessage() for r in caplog.records if r.name.startswith("aiohttp") and r.levelno >= logging.ERROR]
    assert not errors, errors


def test_without_tritons_metrics_port_the_frontend_answers_503_not_an_idle_pod(served):
    """A picker must not read an unreadable backend as an idle one."""
    from model_factory.serving.openai_api import OpenAIFrontend

    server, frontend = served
    with OpenAIFrontend(server.http_url, frontend.models, metrics_url="http://127.0.0.1:9/metrics") as lost:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{lost.url}/metrics", timeout=10)
        assert err.value.code == 503
