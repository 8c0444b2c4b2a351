"""On the real Triton server: the cost model learns from traffic, and a restart starts from what it learned."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TEXTS = ["A man is playing a guitar.", "The weather is lovely today, isn't it?",
         "Triton batches requests of different lengths together when the inputs are ragged, and the backend "
         "splits each window into groups by a cost model it keeps learning from its own launches."]


def test_learned_constants_survive_a_restart_outside_the_repository(minilm_repository, tmp_path):
    from model_factory.measure import bench
    from model_factory.measure.client import embed_texts
    from model_factory.serving.server import COST_CACHE_ENV, ServerOptions, TritonServer

    cache = tmp_path / "cost-cache"
    def files():  # (the stub drops the shim's bytecode cache, so folders' times change; files must not)
        return {p: p.stat().st_mtime_ns for p in minilm_repository.rglob("*") if p.is_file()}

    before = files()
    server = TritonServer(minilm_repository, ["minilm"], ServerOptions(0, 0, 0), log_file=tmp_path / "first.log",
                          env={COST_CACHE_ENV: str(cache)}).start()
    try:
        assert not server.load_errors, server.load_errors
        # Concurrent clients: a request alone in its window runs on borrowed cores (idle_cores), which the cost
        # model does not learn from; under load the windows hold several requests and every launch is timed.
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda _: embed_texts(server.http_url, "minilm", TEXTS), range(48)))
        samples = bench.settled_scrape(server.metrics_url, "minilm")
        timed = bench.metric_total(samples, "model_factory_cost_model_timings_total", model="minilm")
        assert timed and timed >= 12
        assert bench.metric_total(samples, "model_factory_cost_model_modelled_seconds_total", model="minilm",
                                  plan="singles") > 0
    finally:
        assert server.stop() == 0
    log = (tmp_path / "first.log").read_text()
    assert "short warm-up" in log and "cost model learned from" in log and "saved to" in log
    [saved] = list(cache.glob("minilm-*.json"))
    state = json.loads(saved.read_text())
    assert state["estimator"]["timings"] >= 12 and state["flavour"] == "onnxruntime"
    # Nothing was written into the (signed) repository.
    assert files() == before

    server = TritonServer(minilm_repository, ["minilm"], ServerOptions(0, 0, 0), log_file=tmp_path / "again.log",
                          env={COST_CACHE_ENV: str(cache)}).start()
    try:
        assert not server.load_errors, server.load_errors
        assert embed_texts(server.http_url, "minilm", TEXTS[:1]).shape == (1, 384)
    finally:
        assert server.stop() == 0
    again = (tmp_path / "again.log").read_text()
    assert "learned before on this device" in again and "no warm-up sweep" in again
    assert "short warm-up" not in again
