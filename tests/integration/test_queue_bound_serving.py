"""On the real server: serve derives the queue bound on this machine and Triton serves with it; the signed
config.pbtxt is left as signed."""

from __future__ import annotations

import json
import urllib.request

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_serve_loads_the_bound_it_derived_here_and_the_signed_bytes_stay(minilm_repository, tmp_path):
    from model_factory.build.repository import read_config
    from model_factory.serving.queue_bound import derived_config
    from model_factory.serving.server import ServerOptions, start_verified_server

    config_file = minilm_repository / "minilm" / "config.pbtxt"
    signed_bytes = config_file.read_bytes()
    signed = read_config(minilm_repository / "minilm")
    server, report = start_verified_server(minilm_repository, ServerOptions(0, 0, 0), None, allow_unsigned=True,
                                           log_file=tmp_path / "triton.log")
    try:
        assert "minilm" in report.served, report.refused
        cost = report.queue_costs["minilm"]  # measured in the child process, on the engine the backend serves
        assert all(x >= 0 for x in cost) and sum(cost) > 0
        want = int(derived_config(signed, cost)["dynamic_batching"]["default_queue_policy"]["max_queue_size"])
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/minilm/config", timeout=10) as r:
            served = json.loads(r.read())
        assert int(served["dynamic_batching"]["default_queue_policy"]["max_queue_size"]) == want
        assert want != signed.dynamic_batching.default_queue_policy.max_queue_size  # not the signed fallback
        # The stub watch's reload carries the same configuration.
        assert server.load_model("minilm") is None
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/minilm/config", timeout=10) as r:
            assert int(json.loads(r.read())["dynamic_batching"]["default_queue_policy"]["max_queue_size"]) == want
    finally:
        assert server.stop() == 0
    assert config_file.read_bytes() == signed_bytes


def test_a_restart_reads_the_cost_it_measured_before(minilm_repository, tmp_path):
    from model_factory.serving.queue_bound import cached_cost, cost_file
    from model_factory.serving.server import ServerOptions, start_verified_server

    cache = tmp_path / "cost-cache"
    costs = []
    for start in range(2):
        server, report = start_verified_server(minilm_repository, ServerOptions(0, 0, 0), None, allow_unsigned=True,
                                               log_file=tmp_path / f"triton-{start}.log", cost_cache=cache)
        try:
            assert "minilm" in report.served, report.refused
            costs.append(report.queue_costs["minilm"])
        finally:
            assert server.stop() == 0
    kept = cached_cost(cost_file(cache, minilm_repository / "minilm"))
    # Two measurements never time alike to the last bit: the same floats mean the restart read the first one's.
    assert costs[0] == costs[1] == kept
