"""``model-factory bench`` on a text-generation model: streams over generate_stream, TTFT/ITL/tokens per concurrency.

The timing arithmetic on given events; then the real server with the tests' tiny Llama (factory-built): a sweep at
1 and 4 streams written as JSON and read back, and a one-slot model with a one-place queue whose refusals (server
busy) are counted apart from failures. Counts and structure are asserted, never speeds.
"""

from __future__ import annotations

import json
import math
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from click.testing import CliRunner

from model_factory.errors import FactoryError

TEXTS = Path(__file__).resolve().parents[2] / "benchmarks" / "texts.txt"
MODEL, BUSY = "tiny_llm", "tiny_llm_busy"


def test_stream_timings_from_events():
    from model_factory.measure.generate_bench import StreamError, stream_timings

    events = [(1.5, {"output_ids": 7, "finish_reason": ""}), (1.75, {"output_ids": [8], "finish_reason": ""}),
              (2.0, {"output_ids": [], "text_output": "held back"}),
              (2.25, {"output_ids": [9, 10], "finish_reason": "length", "num_output_tokens": 4,
                      "num_input_tokens": [3]})]
    s = stream_timings(events, start=1.0)
    assert s.ttft_s == 0.5 and s.last_s == 1.25 and s.output_tokens == 4 and s.prompt_tokens == 3
    assert s.itl_s == 0.25  # first to last token (0.75 s) over the 3 tokens after the first
    one = stream_timings([(1.2, {"output_ids": [7], "finish_reason": "length", "num_output_tokens": [1]})], 1.0)
    assert one.itl_s is None
    with pytest.raises(StreamError, match="server busy"):
        stream_timings([(1.1, {"error": "server busy: 0 requests already wait; retry after 2 s"})], start=1.0)
    with pytest.raises(StreamError, match="without a token"):
        stream_timings([(1.1, {"output_ids": [], "finish_reason": "stop"})], start=1.0)


def test_a_busy_stream_is_a_rejection_not_a_failure():
    from model_factory.measure.bench import is_rejection
    from model_factory.measure.generate_bench import StreamError

    assert is_rejection(StreamError("server busy: 64 requests already wait for KV cache memory; retry after 1 s"))
    assert not is_rejection(StreamError("max_tokens=0 must be at least 1"))


def test_summarize_streams_and_the_sweep_files(tmp_path):
    from model_factory.measure.generate_bench import Stream, summarize_streams
    from model_factory.measure.sweep import (TEXT_GENERATION, format_sweep, read_sweep, sweep_header,
                                             write_sweep)

    streams = [Stream(0.1, 0.16, 4, 10), Stream(0.3, 0.33, 4, 12), Stream(0.2, 0.2, 1, 5)]
    p = summarize_streams(streams, concurrency=2, requests=5, rejected=1, errors=1, seconds=2.0, max_tokens=4,
                          error_messages=["boom"])
    assert (p.ok, p.rejected, p.errors, p.output_tokens, p.prompt_tokens) == (3, 1, 1, 9, 27)
    assert p.tokens_per_s == 4.5 and p.throughput == 1.5
    assert math.isclose(p.ttft_p50_ms, 200.0) and p.ttft_p99_ms <= 300.0
    # per stream: 60 ms / 3 and 30 ms / 3; a one-token stream has no interval
    assert math.isclose(p.itl_p50_ms, 15.0) and math.isclose(p.itl_p99_ms, 19.9)
    assert math.isclose(p.p50_ms, 200.0) and math.isclose(p.p99_ms, 327.4)
    from dataclasses import asdict

    empty = summarize_streams([], concurrency=8, requests=8, rejected=8, errors=0, seconds=1.0)
    doc = {**sweep_header("llm", "x", "http", task=TEXT_GENERATION), "points": [asdict(p), asdict(empty)]}
    write_sweep(doc, tmp_path / "g.json", tmp_path / "g.csv")
    back = read_sweep(tmp_path / "g.json")
    assert [q["concurrency"] for q in back["points"]] == [2, 8]
    assert back["points"][0]["itl_p50_ms"] == p.itl_p50_ms and back["points"][1]["ttft_p50_ms"] is None
    header = (tmp_path / "g.csv").read_text().splitlines()[0].split(",")
    assert header[:3] == ["model", "concurrency", "requests"] and "tokens_per_s" in header
    table = format_sweep(back["points"]).splitlines()
    assert table[0].split() == ["conc.", "tokens/s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                                "ok", "rejected", "failed"]
    assert table[1].split()[1] == "4.5" and table[2].split()[2] == "n/a"
    broken = {**doc, "points": [{"concurrency": 1, "tokens_per_s": 2.0}]}
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    with pytest.raises(FactoryError, match="incomplete"):
        read_sweep(tmp_path / "broken.json")


# --------------------------------------------------------------------------- the real server


@pytest.fixture(scope="module")
def served_llm(tiny_llm, tmp_path_factory):
    from model_factory.serving.server import ServerOptions, TritonServer
    from tests.generative_repository import layout_generative_model

    hf, onnx_dir = tiny_llm
    repo = tmp_path_factory.mktemp("bench-gen-repo")
    layout_generative_model(hf, onnx_dir, repo, MODEL, memory_budget_mib=256, max_active_sequences=8,
                            max_waiting_sequences=64)
    layout_generative_model(hf, onnx_dir, repo, BUSY, memory_budget_mib=256, max_active_sequences=1,
                            max_waiting_sequences=1)
    server = TritonServer(repo, options=ServerOptions(0, 0, 0)).start()
    assert not server.load_errors, server.load_errors
    yield server, repo
    rc = server.stop()
    assert rc == 0, server.log_tail(30)


@pytest.fixture(scope="module")
def llm_sweep(served_llm, tmp_path_factory):
    """``model-factory bench --sweep 1,4 --json`` against the tiny Llama: (the CLI's result, the JSON path)."""
    from model_factory.cli.main import main

    served_llm, _ = served_llm
    path = tmp_path_factory.mktemp("bench-gen") / "llm-sweep.json"
    out = CliRunner().invoke(main, ["bench", "--url", served_llm.http_url, "-m", MODEL, "--texts", str(TEXTS),
                                    "--sweep", "1,4", "-n", "8", "--warmup", "1", "--max-tokens", "12",
                                    "--json", str(path)])
    return out, path


@pytest.mark.integration
def test_cli_sweep_of_a_generative_model_on_the_real_server(llm_sweep):
    from model_factory.measure.sweep import TEXT_GENERATION, read_sweep

    out, path = llm_sweep
    assert out.exit_code == 0, out.output
    doc = read_sweep(path)
    assert doc["task"] == TEXT_GENERATION and doc["endpoint"] == "generate_stream" and doc["max_tokens"] == 12
    assert [p["concurrency"] for p in doc["points"]] == [1, 4]
    for p in doc["points"]:
        assert (p["requests"], p["ok"], p["rejected"], p["errors"]) == (8, 8, 0, 0)
        assert p["output_tokens"] == 8 * 12 and p["prompt_tokens"] > 8  # exactly max_tokens each, eos ignored
        assert p["tokens_per_s"] > 0 and 0 < p["ttft_p50_ms"] <= p["ttft_p99_ms"]
        assert 0 < p["itl_p50_ms"] <= p["itl_p99_ms"] and p["ttft_p50_ms"] <= p["p50_ms"]
    table = out.output.strip().splitlines()[-3:]
    assert table[0].split()[:2] == ["conc.", "tokens/s"] and [r.split()[6] for r in table[1:]] == ["8", "8"]


class _Cells(HTMLParser):
    """The ``data-k`` cells of one section of the report: {(key, concurrency): text}, and the figures' classes."""

    def __init__(self, section: str) -> None:
        super().__init__()
        self.section, self.inside, self.depth = section, False, 0
        self.concurrency, self.key = None, None
        self.cells: dict[tuple[str, object], str] = {}
        self.figures: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section" and a.get("id") == self.section:
            self.inside, self.depth = True, 0
        if not self.inside:
            return
        if tag == "section":
            self.depth += 1
        if tag == "tr" and "data-concurrency" in a:
            self.concurrency = int(a["data-concurrency"])
        if tag == "figure":
            self.figures.append(a.get("class", ""))
        if "data-k" in a:
            self.key = a["data-k"]

    def handle_endtag(self, tag):
        if self.inside and tag == "section":
            self.depth -= 1
            self.inside = self.depth > 0

    def handle_data(self, data):
        if self.inside and self.key is not None:
            self.cells[(self.key, self.concurrency)] = data.strip()
            self.key = None


@pytest.mark.integration
def test_the_report_speed_section_shows_the_generation_sweep(served_llm, llm_sweep, tmp_path):
    from model_factory.cli.main import main
    from model_factory.measure.sweep import read_sweep

    _, repo = served_llm
    _, path = llm_sweep
    out = CliRunner().invoke(main, ["report", str(repo), "-m", MODEL, "--bench", str(path),
                                    "-o", str(tmp_path / "r.html")])
    assert out.exit_code == 0, out.output
    html = (tmp_path / "r.html").read_text()
    section = next(m for m in re.findall(r'id="([^"]+-speed)"', html))
    cells = _Cells(section)
    cells.feed(html)
    assert cells.figures == ["plot-speed", "plot-token-latency"]
    assert cells.cells[("speed:max-tokens", None)] == "12"
    for p in read_sweep(path)["points"]:
        c = p["concurrency"]
        for key, field in (("tokens-per-s", "tokens_per_s"), ("ttft-p50", "ttft_p50_ms"), ("ttft-p99", "ttft_p99_ms"),
                           ("itl-p50", "itl_p50_ms"), ("itl-p99", "itl_p99_ms")):
            assert float(cells.cells[(f"speed:{key}", c)]) == pytest.approx(p[field], abs=0.005)
        assert [int(cells.cells[(f"speed:{k}", c)]) for k in ("ok", "rejected", "errors")] == [8, 0, 0]
    assert "tokens/s against time to first token p99" in html and "Peak output" in html


@pytest.mark.integration
def test_refused_streams_are_counted_apart_from_failures(served_llm):
    from model_factory.measure.generate_bench import run_generate_load

    served_llm, _ = served_llm
    prompts = ["a prompt of a few words"] * 12
    p = run_generate_load(served_llm.http_url, BUSY, prompts, concurrency=4, warmup=0, max_tokens=64)
    assert p.requests == 12 and p.ok + p.rejected + p.errors == 12
    assert p.errors == 0, p.error_messages
    assert p.rejected >= 1 and p.ok >= 1  # one slot, one waiting: the others beside them are refused
    assert p.output_tokens == 64 * p.ok


@pytest.mark.integration
def test_unknown_generative_model_and_grpc_are_user_errors(served_llm):
    from model_factory.cli.main import main
    from model_factory.measure.generate_bench import run_generate_load

    served_llm, _ = served_llm
    with pytest.raises(FactoryError, match="not ready"):
        run_generate_load(served_llm.http_url, "nope", ["hello"], warmup=0)
    out = CliRunner().invoke(main, ["bench", "--url", served_llm.grpc_url, "--protocol", "grpc", "-m", MODEL,
                                    "--texts", str(TEXTS), "-n", "2"])
    assert out.exit_code == 1 and "generate_stream (HTTP)" in out.output and "Traceback" not in out.output
