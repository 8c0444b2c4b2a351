"""``serve --accept``: a model whose engine fails acceptance on this machine is refused like an unverified one."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_serve_accept_refuses_the_models_that_fail_acceptance(accept_repo) -> None:
    from model_factory.measure.client import embed_texts
    from model_factory.serving.server import ServerOptions, start_verified_server

    repo, policy = accept_repo
    server, report = start_verified_server(repo, ServerOptions(0, 0, 0), policy, accept=True)
    try:
        # All three verify (two trusted keys); only the good one computes the right answer here.
        assert report.served == ("good",)
        for name in ("swapped", "int8"):
            assert report.refused[name].startswith("acceptance failed on this machine (onnxruntime (")
            assert "below the gate 0.99" in report.refused[name]
        assert "model.int8.onnx" in report.refused["int8"] and "first departs from FP32 at" in report.refused["int8"]
        assert report.engines == {"good": "onnxruntime (model.onnx) on cpu"}
        assert embed_texts(server.http_url, "good", ["accepted and served"]).shape == (1, 384)
        index = {m["name"]: m.get("state") for m in server.model_status()}
        assert index.get("good") == "READY" and index.get("swapped") != "READY" and index.get("int8") != "READY"
    finally:
        assert server.stop() == 0


def test_serve_reports_engine_and_device_without_accept(accept_repo) -> None:
    from model_factory.serving.server import ServerOptions, start_verified_server

    repo, policy = accept_repo
    server, report = start_verified_server(repo, ServerOptions(0, 0, 0), policy)
    try:
        assert set(report.served) == {"good", "swapped", "int8"}  # verification alone lets them all through
        # From the backend's own metric labels: engine flavour and where it computes.
        assert report.engines == {m: "onnxruntime on cpu" for m in report.served}
    finally:
        assert server.stop() == 0
