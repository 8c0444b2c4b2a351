"""``model-factory serve --openai-port`` serves a text-generation model through the OpenAI API beside Triton,
accepted on this machine first (``--accept``: its golden continuations), and stops both on SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.generative_repository import layout_generative_model, write_continuations

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLI = str(Path(sys.executable).parent / "model-factory")


def test_serve_accepts_then_serves_the_openai_api_and_stops_with_triton(tiny_llm, tmp_path):
    hf, onnx_dir = tiny_llm
    repo = tmp_path / "repo"
    vdir = layout_generative_model(hf, onnx_dir, repo, "llm", memory_budget_mib=128, max_active_sequences=4)
    write_continuations(vdir, hf, [[5, 6, 7, 8], [40] * 9], max_tokens=8)
    proc = subprocess.Popen([CLI, "serve", "--allow-unsigned", "--accept", "--http-port", "0", "--grpc-port", "0",
                             "--metrics-port", "0", "--watch-interval", "0", "--no-cost-cache", "--openai-port", "0",
                             str(repo)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = []
        for line in proc.stdout:
            out.append(line)
            if "Ctrl-C to stop" in line:
                break
        url = next(m.group(1) for line in out if (m := re.search(r"OpenAI\s+(http://\S+)/v1", line)))
        banner = next(line for line in out if line.startswith("  llm: "))  # what it runs on, never "unknown"
        assert "unknown" not in banner and "onnxruntime" in banner, banner
        models = json.loads(urllib.request.urlopen(f"{url}/v1/models", timeout=10).read())
        assert [m["id"] for m in models["data"]] == ["llm"]
        req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(
            {"model": "llm", "prompt": [5, 6, 7, 8], "max_tokens": 8, "min_tokens": 8}).encode(),
            headers={"Content-Type": "application/json"})
        body = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12}
        # serve hands the frontend Triton's metrics port: the endpoint picker's /metrics (test_pool_metrics_serving).
        metrics = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
        assert 'vllm:num_requests_running{model_name="llm"}' in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    assert "tritonserver stopped (exit code 0)" in rest
