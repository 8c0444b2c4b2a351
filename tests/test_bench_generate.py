"""benchmarks/bench_generate.py's own arithmetic: TTFT quantiles (OpenVINO's p50 was its maximum) and its prompts."""

from __future__ import annotations

import pytest

from benchmarks import bench_generate as bg


def test_pct_takes_a_fraction_and_refuses_a_percent():
    ttfts = [float(x) for x in range(1, 33)]
    assert bg._pct(ttfts, 0.5) == 17.0 and bg._pct(ttfts, 0.99) == 32.0 and bg._pct(ttfts, 0) == 1.0
    with pytest.raises(ValueError):
        bg._pct(ttfts, 50)


def test_openvino_cells_read_p50_below_p99(tmp_path, monkeypatch):
    import json
    import subprocess

    lines = [json.dumps({"round": 0, "level": 4, "tokens": 4 * bg.OUTPUT, "counts": [bg.OUTPUT], "wall": 2.0,
                         "ttft": [0.1, 0.2, 0.3, 0.4]})]
    (tmp_path / "ov-int8").mkdir()
    (tmp_path / "ov-int8" / "openvino_model.xml").write_text("")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "\n".join(lines), ""))
    out, _ = bg.bench_openvino("python", tmp_path, [4], tmp_path, 1, 2, "int8")
    (tps, p50, p99), = out[("openvino", "int8", 4)]
    assert (p50, p99) == (0.3, 0.4) and tps == 4 * bg.OUTPUT / 2.0


def test_prompts_keep_their_old_draw_and_gemma_style_starts_with_bos(monkeypatch):
    monkeypatch.setattr(bg, "_TOKENIZER", None)
    old = bg._prompts(2, bg.VOCAB, 7)
    import random

    rng = random.Random(7)
    assert old[0] == [rng.randrange(3, bg.VOCAB) for _ in range(bg.PROMPT)]  # the 116M Llama's prompts unchanged
    monkeypatch.setitem(bg.MODEL, "pool", [10, 11, 12])
    monkeypatch.setitem(bg.MODEL, "bos", 2)
    got = bg._prompts(3, bg.VOCAB, 7)
    assert all(len(p) == bg.PROMPT and p[0] == 2 and set(p[1:]) <= {10, 11, 12} for p in got)


def test_targets_say_not_measured_where_a_figure_is_missing_and_met_only_on_figures():
    results = {("ours", "int8kv8", 1): [(60.0, 0.1, 0.2)], ("ours", "int8kv8", 8): [(250.0, 0.5, 0.9)],
               ("openvino", "int8", 1): [(50.0, 0.1, 0.2)]}
    text = bg.targets(results, [1, 8])
    assert "- ours INT8KV8 >= 1.0x OpenVINO GenAI INT8: 1.20x / –: not measured" in text, text
    assert "- ours INT8KV8 >= 1.0x ours FP32: not measured at 1, 8 streams" in text, text
    results[("ours", "fp32", 1)] = [(20.0, 0.3, 0.4)]
    results[("ours", "fp32", 8)] = [(255.0, 0.3, 0.4)]
    results[("openvino", "int8", 8)] = [(200.0, 0.5, 0.9)]
    text = bg.targets(results, [1, 8])
    assert "- ours INT8KV8 >= 1.0x ours FP32: not met: slower than FP32 at 8 streams" in text, text
    assert "- ours INT8KV8 >= 1.0x OpenVINO GenAI INT8: 1.20x / 1.25x: met" in text, text
