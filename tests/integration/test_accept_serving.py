"""``serve --accept``: a model whose engine fails acceptance on this machine is refused like an unverified one."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_serve_accept_refuses_the_models_that_fail_acceptance(accept_repo) -> None:
    from model_factory.measure.client import embed_texts
    from model_factory.serving.server import ServerOptions, start_verified_server

    from model_factory.backend.engines.cpu_features import integer_dot_product

    repo, policy = accept_repo
    # Without integer dot products `auto` would serve (and accept) the FP32 model packaged beside the clipped INT8
    # one: the INT8 graph itself is then replayed with Q/DQ in float, as its gate scored it.
    kernels = None if integer_dot_product() else "simulated"
    server, report = start_verified_server(repo, ServerOptions(0, 0, 0, int8_kernels=kernels), policy, accept=True)
    try:
        # All three verify (two trusted keys); only the good one computes the right answer here.
        assert report.served == ("good",)
        for name in ("swapped", "int8"):
            assert report.refused[name].startswith("acceptance failed on this machine (onnxruntime (")
            assert "below the gate 0.99" in report.refused[name]
        assert "model.int8.onnx" in report.refused["int8"] and "first departs from FP32 at" in report.refused["int8"]
        assert list(report.engines) == ["good"]
        assert report.engines["good"].startswith("onnxruntime (model.onnx) on cpu, ")
        assert " per instance" in report.engines["good"]
        assert embed_texts(server.http_url, "good", ["accepted and served"]).shape == (1, 384)
        index = {m["name"]: m.get("state") for m in server.model_status()}
        assert index.get("good") == "READY" and index.get("swapped") != "READY" and index.get("int8") != "READY"
    finally:
        assert server.stop() == 0


def test_serve_reports_engine_and_device_without_accept(accept_repo) -> None:
    """Engines, threads, and a plain note where INT8 is simulated in float (FP32 is faster there)."""
    from model_factory.backend.engines.loading import available_cpus
    from model_factory.serving.server import ServerOptions, start_verified_server

    repo, policy = accept_repo
    server, report = start_verified_server(repo, ServerOptions(0, 0, 0, int8_kernels="simulated"), policy)
    try:
        assert set(report.served) == {"good", "swapped", "int8"}  # verification alone lets them all through
        # From the backend's own metric labels: engine flavour, where it computes, its threads.
        cores = available_cpus()
        own = max(1, cores // 2)
        threads = f"{own} thread{'' if own == 1 else 's'} per instance" + (f" ({cores} for a lone request)" if cores > 1 else "")
        assert report.engines == {m: f"onnxruntime on cpu, {threads}" for m in report.served}
        assert list(report.notes) == ["int8"]
        assert "FP32 is the faster choice here" in report.notes["int8"] and 'serve = "fp32"' in report.notes["int8"]
    finally:
        assert server.stop() == 0
