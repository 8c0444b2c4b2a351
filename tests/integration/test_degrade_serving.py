"""Degrade before shedding on the real server: a burst that the plain model sheds (503) is answered, partly by
INT8, on the model packaged with ``degrade_to = "int8"``; each response says its precision and /metrics counts
the degraded ones. A package whose INT8 failed its gate refuses to degrade, in one line."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[2] / "model_factory" / "examples"
TEXT = "degrade before shedding " * 12
BURST = 40  # requests sent at once: past the plain model's queue (4 batches of 4) and its two windows in flight


def _recipe(root: Path, name: str, **repository):
    from model_factory.recipe import load_recipe

    recipe = load_recipe(EXAMPLES / "minilm.toml", {
        "repository.path": str(root / "repo"), "precisions": ["fp32", "int8"],
        "quantization.calibration_data": str(EXAMPLES / "calibration.txt"),
        "quantization.heldout_data": str(EXAMPLES / "heldout.txt"), "quantization.min_accuracy": 0.99,
        # Small batches: the signed ("auto" fallback) bound is 4 x 4 = 16 requests, 32 with degrade_to.
        "shapes.max_batch": 4, "batching.preferred_batch_sizes": [2, 4],
        # Shed by count, at once: a burst past the bound is what degrading answers instead (by age, the default, the
        # burst waits its turn and nothing is shed here).
        "batching.shed_by": "count"})
    return replace(recipe, name=name, repository=replace(recipe.repository, **repository))


@pytest.fixture(scope="module")
def degrade_repo(tmp_path_factory, minilm_export):
    """``plain`` (FP32 only), ``degrading`` (FP32 + INT8 that passed its gate, degrade_to = "int8") and
    ``failed_gate`` (the same INT8 under a gate above its score: a package made by hand, since packaging refuses it).
    INT8 comes from the real quantize stage (with its 7-bit form for CPUs without VNNI, when it passes)."""
    from model_factory.build.repository import package_model
    from model_factory.build_engines.golden import write_acceptance_data
    from model_factory.build_engines.quantize import quantize_model

    root = tmp_path_factory.mktemp("degrade")
    recipe = _recipe(root, "degrading", degrade_to="int8")
    quantized = quantize_model(recipe, minilm_export)  # raises when INT8 misses the gate
    int8 = quantized.models["int8"]
    artifacts = {"model.onnx": minilm_export.onnx_path, "model.int8.onnx": int8}
    seven = int8.parent / "model.int8.w7.onnx"
    if seven.is_file():
        artifacts[seven.name] = seven
    extra = [quantized.report_path]
    # No cost_model constants: with them the server would derive a bound of ~0.3 s of their (fast) work; without,
    # the signed fallback bound stays (4 batches of 4 = 16, 32 with degrade_to) and the backend times its engines.
    cost: dict[str, str] = {}
    golden = write_acceptance_data(recipe, minilm_export.onnx_path, minilm_export.tokenizer_dir, root / "golden")
    kw = dict(tokenizer_dir=minilm_export.tokenizer_dir, parameters=cost, acceptance_dir=golden)
    package_model(_recipe(root, "plain"), {"model.onnx": minilm_export.onnx_path}, **kw)
    package_model(recipe, artifacts, extra_files=extra, **kw)
    score = quantized.report.result("int8").gate_score
    failed = root / "failed" / "accuracy.json"
    failed.parent.mkdir()
    replace(quantized.report, min_accuracy=min(1.0, score + 0.001)).write(failed)
    package_model(_recipe(root, "failed_gate"), artifacts, extra_files=[failed],
                  **{**kw, "parameters": {**cost, "degrade_to": "int8"}})
    return root / "repo", score


def _burst(url: str, model: str) -> list[tuple[int, str | None]]:
    """BURST requests released together; (HTTP status, precision said or None) per request."""
    body = json.dumps({"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": [TEXT]}],
                       "outputs": [{"name": "embedding"}] + ([{"name": "precision"}] if model != "plain" else [])
                       }).encode()
    gate = threading.Barrier(BURST)

    def one(_: int) -> tuple[int, str | None]:
        req = urllib.request.Request(f"http://{url}/v2/models/{model}/infer", data=body,
                                     headers={"Content-Type": "application/json"})
        gate.wait()
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                out = {o["name"]: o for o in json.loads(r.read())["outputs"]}
                assert np.asarray(out["embedding"]["data"]).size == 384
                return r.status, (out["precision"]["data"][0] if "precision" in out else None)
        except urllib.error.HTTPError as e:
            return e.code, None

    with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
        return list(pool.map(one, range(BURST)))


def _degraded_count(metrics_url: str, model: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    pattern = rf'^model_factory_degraded_requests_total{{[^}}]*model="{model}"[^}}]*precision="int8"[^}}]*}} (\S+)$'
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))


def test_a_burst_the_plain_model_sheds_is_answered_partly_by_int8_and_said(degrade_repo, tmp_path) -> None:
    from model_factory.serving.server import ServerOptions, TritonServer

    repo, score = degrade_repo
    events = tmp_path / "events.jsonl"
    server = TritonServer(repo, ["plain", "degrading"], ServerOptions(0, 0, 0, events_file=events),
                          log_file=tmp_path / "triton.log").start()
    try:
        plain = _burst(server.http_url, "plain")
        degrading = _burst(server.http_url, "degrading")
        import time

        time.sleep(2.5)  # the backend sends its counters about once a second
        counted = _degraded_count(server.metrics_url, "degrading")
    finally:
        assert server.stop() == 0
    shed_plain = sum(1 for status, _ in plain if status == 503)
    shed_degrading = sum(1 for status, _ in degrading if status == 503)
    said = [p for status, p in degrading if status == 200]
    assert {s for s, _ in plain + degrading} <= {200, 503}
    assert shed_plain > 0, plain  # without degrading the burst is shed in part
    assert shed_degrading < shed_plain, (shed_degrading, shed_plain)
    assert set(said) <= {"fp32", "int8"} and "int8" in said, said  # each response says which precision answered
    assert counted == said.count("int8")  # and /metrics counts exactly those
    assert score >= 0.99
    # The decisions, as events: the load (with the gate score that allows it) and the degraded windows.
    said_events = [json.loads(line) for line in events.read_text().splitlines()]
    ready = [e for e in said_events if e["event"] == "degrade_ready"]
    assert ready and all(e["precision"] == "int8" and e["gate_score"] >= e["min_accuracy"] for e in ready)
    assert any(e["event"] == "degraded" and e["precision"] == "int8" for e in said_events)


def test_a_package_whose_int8_failed_its_gate_never_degrades_and_says_why_in_one_line(degrade_repo, tmp_path):
    """The backend refuses the load and ``accept`` the package: one line naming the gate, never an INT8 answer."""
    from model_factory.serving.acceptance import accept_model
    from model_factory.serving.server import ServerOptions, TritonServer

    repo, _score = degrade_repo
    server = TritonServer(repo, [], ServerOptions(0, 0, 0), log_file=tmp_path / "triton.log").start()
    try:
        why = server.load_model("failed_gate")
    finally:
        assert server.stop() == 0
    assert why is not None and "cannot degrade to int8: it failed its accuracy gate" in why, why
    verdict = accept_model(repo / "failed_gate", layers=False)
    assert not verdict.passed
    assert verdict.reason.startswith("degrade_to int8: cannot degrade to int8: it failed its accuracy gate")
    assert "\n" not in verdict.reason
    ok = accept_model(repo / "degrading", layers=False)  # the passing one is accepted, its INT8 engine too
    assert ok.passed, ok.reason
    assert ok.degrade["precision"] == "int8" and ok.degrade["score"] >= ok.threshold
    from model_factory.serving.acceptance import render

    assert f"degrade_to int8: {ok.degrade['file']}, {ok.metric} {ok.degrade['score']}" in render([ok])
