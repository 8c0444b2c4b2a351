"""Long inputs and tracing, measured on the real server (issue 30).

    .venv/bin/python benchmarks/bench_observability.py                  # both parts, writes RESULTS.md
    .venv/bin/python benchmarks/bench_observability.py --part tracing   # the tracing cost only (~3 min)
    .venv/bin/python benchmarks/bench_observability.py --quick          # a smoke run, RESULTS.md untouched

1. Long inputs (section ``observability``): how close is a chunked embedding to the whole text's? MiniLM is
   packaged twice from one export: ``minilm`` (max_sequence_length 128) and ``minilm512`` (512, buckets 128 and
   512: MiniLM's position table has 512 rows, so no bucket of 1024 is possible). Texts of 200 to 500 tokens
   (benchmarks/texts.txt lines joined) are sent to ``minilm`` with ``long_inputs=chunk`` and with ``truncate``,
   and whole to ``minilm512``; the cosine of each against the whole text's embedding is reported.
2. Tracing (section ``tracing``): throughput at 8 requests in flight (texts, HTTP) on a server without tracing
   and on one tracing every request (``--trace-rate 1``, the backend as the trace source: Triton 2.51's own tracer
   crashed the server twice at this load, docs/environment.md) into an OTLP/HTTP receiver in its own process (so its
   parsing never holds the load generator's interpreter). Built for a noisy shared machine: many short runs,
   off and on interleaved in pairs whose order alternates (off-on, on-off, ...), the ratio taken within each
   adjacent pair (both halves saw about the same background load), and the median and the spread of the
   per-pair ratios reported, with the load averages (/proc/loadavg) at the start and the end and the CPU flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import http.server
import json
import math
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Sequence

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from results_file import publish, say  # noqa: E402

START, END = "<!-- observability:start -->", "<!-- observability:end -->"
TRACING_START, TRACING_END = "<!-- tracing:start -->", "<!-- tracing:end -->"
FIXED = {"cost_model": "0.002,1e-6,1e-9"}  # loads without a warm-up sweep


def _embed(url: str, model: str, text: str, parameters: dict | None = None) -> np.ndarray:
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": [text]}],
            "outputs": [{"name": "embedding"}], **({"parameters": parameters} if parameters else {})}
    req = urllib.request.Request(f"http://{url}/v2/models/{model}/infer", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return np.asarray(json.loads(resp.read())["outputs"][0]["data"], dtype=np.float64)


def _long_texts(lines: Sequence[str], tokenizer, targets: Sequence[int]) -> list[tuple[str, int]]:
    out, i = [], 0
    for target in targets:
        text = ""
        while True:
            candidate = (text + " " + lines[i % len(lines)]).strip()
            i += 1
            if len(tokenizer.encode(candidate).ids) > target:
                break
            text = candidate
        out.append((text, len(tokenizer.encode(text).ids)))
    return out


def _receive(port_out, posts, spans) -> None:
    """An OTLP/HTTP receiver (its own process): counts the exports and the spans in them, answers 200."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with posts.get_lock():
                posts.value += 1
            with spans.get_lock():
                spans.value += body.count(b'"spanId"')
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port_out.put(httpd.server_address[1])
    httpd.serve_forever()


class _Receiver:
    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.posts, self.spans = ctx.Value("i", 0), ctx.Value("i", 0)
        port = ctx.Queue()
        self.proc = ctx.Process(target=_receive, args=(port, self.posts, self.spans), daemon=True)
        self.proc.start()
        self.endpoint = f"127.0.0.1:{port.get(timeout=30)}/v1/traces"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.join(10)


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _median_interval(values: Sequence[float], z: float = 1.96) -> tuple[float, float]:
    """A distribution-free ~95 % confidence interval for the median: the order statistics n/2 -+ z*sqrt(n)/2."""
    ordered = sorted(values)
    n = len(ordered)
    half = z * math.sqrt(n) / 2
    lo = max(0, int(math.floor(n / 2 - half)))
    hi = min(n - 1, int(math.ceil(n / 2 + half)) - 1)
    return ordered[lo], ordered[hi]


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return q[0], q[2]


def _long_inputs(work: Path, recipe, exported, lines: Sequence[str], quick: bool) -> str:
    """Part 1: chunked and truncated embeddings against the whole text's; the ``observability`` section."""
    from tokenizers import Tokenizer

    from benchmarks.harness.minilm import package_variant, start_server
    from model_factory.backend.engines.loading import available_cpus

    repo = work / "repo"
    package_variant(dataclasses.replace(recipe, repository=dataclasses.replace(recipe.repository, instance_count=1)),
                    exported, repo, parameters=FIXED)
    wide = dataclasses.replace(recipe, name="minilm512", shapes=dataclasses.replace(
        recipe.shapes, max_sequence_length=512, sequence_buckets=(128, 512)),
        repository=dataclasses.replace(recipe.repository, instance_count=1))
    package_variant(wide, exported, repo, parameters=FIXED)
    tok = Tokenizer.from_file(str(exported.tokenizer_dir / "tokenizer.json"))
    tok.no_truncation()
    texts = _long_texts(lines, tok, [200, 300, 400, 500] if not quick else [300])
    say("long inputs")
    rows = []
    server = start_server(repo, ("minilm", "minilm512"), exit_timeout_s=30)
    try:
        for text, n in texts:
            whole = _embed(server.http_url, "minilm512", text)
            chunk = _embed(server.http_url, "minilm", text, {"long_inputs": "chunk"})
            cut = _embed(server.http_url, "minilm", text, {"long_inputs": "truncate"})
            windows = 1 + -(-(n - 128) // (128 - 2 - 32))
            rows.append(f"| {n} | {windows} | {float(chunk @ whole):.4f} | {float(cut @ whole):.4f} |")
    finally:
        server.stop()
    return "\n".join([
        START, "## Long inputs: chunked against the whole text (benchmarks/bench_observability.py)", "",
        f"Run {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} on {platform.node() or 'this host'} "
        f"({available_cpus()} usable cores, shared with other work: load average {_loadavg()} at the end). MiniLM "
        "FP32 ONNX Runtime CPU. The whole text runs on `minilm512` (max_sequence_length 512, buckets 128 and 512: "
        "MiniLM's position table has 512 rows, so a 1024-token bucket cannot be built for it; texts stay under "
        "512 tokens so the reference sees all of them); chunked and truncated on `minilm` (128, chunk_overlap 32). "
        "Cosine of each against the whole text's unit embedding.", "",
        "| tokens | windows of 128 | cosine chunk vs whole | cosine truncate(128) vs whole |",
        "| --- | --- | --- | --- |", *rows, "",
        "The tracing overhead is its own section (`tracing`), below.", END])


def _tracing(work: Path, recipe, exported, lines: Sequence[str], args) -> str:
    """Part 2: off vs rate 1 in interleaved pairs; the ``tracing`` section."""
    from benchmarks.harness.minilm import package_variant, start_server
    from benchmarks.harness.run_header import LoadReading, run_header
    from benchmarks.harness.server_cpu import server_cpu_seconds
    from model_factory.measure import bench

    load, loadavg_start = LoadReading.begin(), _loadavg()
    say(f"tracing: /proc/loadavg {loadavg_start}")
    package_variant(recipe, exported, work / "repo-trace", parameters=FIXED)
    receiver = _Receiver()
    stream = bench.make_payloads(bench.draw_texts(lines, args.requests, seed=0))
    servers = {"off": start_server(work / "repo-trace", exit_timeout_s=30),
               "on": start_server(work / "repo-trace", exit_timeout_s=30, trace_endpoint=receiver.endpoint,
                                  trace_rate=1)}
    runs: dict[str, list] = {k: [] for k in servers}
    pairs: list[float] = []
    cpu_pairs: list[float] = []  # the server's CPU per sequence, on / off, within each pair
    cpu_ms: dict[str, list[float]] = {k: [] for k in servers}
    try:
        for label in servers:  # warm both (first-window costs, the exporter's first connection)
            bench.run_load(servers[label].http_url, "minilm", stream, concurrency=8, warmup=16, send="text")
        deadline = time.monotonic() + args.seconds
        while len(pairs) < args.min_pairs or (time.monotonic() < deadline and len(pairs) < args.max_pairs):
            order = ("off", "on") if len(pairs) % 2 == 0 else ("on", "off")
            got = {}
            for label in order:
                before = server_cpu_seconds(servers[label])
                got[label] = bench.run_load(servers[label].http_url, "minilm", stream, protocol="http",
                                            concurrency=8, warmup=8, send="text", label=label)
                # The warm-up's 8 sequences ran inside the same CPU window: counted with the measured ones.
                cpu_ms[label].append((server_cpu_seconds(servers[label]) - before) * 1000
                                     / max(got[label].sequences + 8, 1))
                runs[label].append(got[label])
            pairs.append(got["on"].throughput / got["off"].throughput)
            cpu_pairs.append(cpu_ms["on"][-1] / cpu_ms["off"][-1])
            say(f"pair {len(pairs)} ({'-'.join(order)}): off {got['off'].throughput:.1f}, on "
                f"{got['on'].throughput:.1f} seq/s, ratio {pairs[-1]:.3f}; CPU per sequence on/off {cpu_pairs[-1]:.3f}")
    finally:
        for label, srv in servers.items():
            if srv.process.poll() is not None:  # a server that died mid-run: say how, with its log's end
                say(f"the {label} server exited with {srv.process.returncode}; its log ends:\n"
                    + "\n".join(srv.log_file.read_text(errors="replace").splitlines()[-40:]))
            srv.stop()
        receiver.close()
    load, loadavg_end = load.finish(), _loadavg()
    low, high = _quartiles(pairs)
    median = statistics.median(pairs)

    def med(label: str, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in runs[label])

    seconds = sum(r.seconds for rs in runs.values() for r in rs)
    verdict = (f"Every request traced costs {100 * (1 - median):.1f} % of throughput at the median"
               if median < 1 else "No cost shows at the median")
    lo, hi = _median_interval(pairs)
    verdict += (f"; a 95 % interval for the median ratio (distribution-free, from the order statistics of the "
                f"{len(pairs)} pairs) is {lo:.3f}–{hi:.3f}: "
                + ("tracing at rate 1 costs at most 5 % of throughput here." if lo >= 0.95 else
                   "it reaches below 0.95, so this run cannot show the cost is within 5 %: more pairs, or a "
                   "quieter machine."))
    cpu_lo, cpu_hi = _median_interval(cpu_pairs)
    return "\n".join([
        TRACING_START,
        "## Tracing overhead: OpenTelemetry off vs every request traced (benchmarks/bench_observability.py --part "
        "tracing)", "",
        run_header("benchmarks/bench_observability.py --part tracing", load, own_processes=1)
        + f" /proc/loadavg at the start: `{loadavg_start}`, at the end: `{loadavg_end}`.", "",
        f"Two servers from one package (MiniLM FP32, ONNX Runtime CPU, the example's instances), one without tracing "
        f"and one with `--trace-rate 1` (the default trace source, the backend: its `request` span and the work "
        f"under it, every request; Triton's own tracer in 2.51 crashes the server under this load, "
        f"docs/environment.md) into an "
        f"OTLP/HTTP receiver in its own process ({receiver.posts.value} exports, {receiver.spans.value} spans "
        f"received). HTTP, texts, 8 requests in flight, {args.requests} requests per run after 8 of warm-up; "
        f"{len(pairs)} pairs of runs, off and on back to back, the order alternating (off-on, on-off, ...), "
        f"{seconds:.0f} s measured in all. The ratio is taken within each pair.", "",
        "| tracing | runs | seq/s (median) | p50 ms (median) | p99 ms (median) |", "| --- | --- | --- | --- | --- |",
        *(f"| {'rate 1' if k == 'on' else 'off'} | {len(runs[k])} | {med(k, 'throughput'):.1f} | "
          f"{med(k, 'p50_ms'):.1f} | {med(k, 'p99_ms'):.1f} |" for k in runs), "",
        f"rate 1 / off throughput per pair: median **{median:.3f}**, quartiles {low:.3f}–{high:.3f}, range "
        f"{min(pairs):.3f}–{max(pairs):.3f} (pairs: {', '.join(f'{r:.3f}' for r in pairs)}).", "",
        verdict, "",
        "The server's own CPU time per answered sequence (tritonserver and its stubs, user + system, read with psutil "
        "around each run; the receiver's process not counted), which other work on the machine stretches much less "
        "than throughput: " + ", ".join(f"{'rate 1' if k == 'on' else 'off'} {statistics.median(v):.2f} ms "
                                        f"(median of {len(v)})" for k, v in cpu_ms.items())
        + f"; rate 1 / off per pair: median **{statistics.median(cpu_pairs):.3f}**, quartiles "
        + "{:.3f}–{:.3f}".format(*_quartiles(cpu_pairs)) + f", range {min(cpu_pairs):.3f}–{max(cpu_pairs):.3f}: "
        + (f"every request traced costs {100 * (statistics.median(cpu_pairs) - 1):.1f} % more CPU at the median"
           if statistics.median(cpu_pairs) > 1 else "no extra CPU shows at the median")
        + f"; 95 % interval for the median {cpu_lo:.3f}–{cpu_hi:.3f}.",
        TRACING_END])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("all", "long-inputs", "tracing"), default="all")
    ap.add_argument("--requests", type=int, default=64, help="requests per run (tracing)")
    ap.add_argument("--seconds", type=float, default=110.0, help="time for the tracing pairs, after the warm-up")
    ap.add_argument("--min-pairs", type=int, default=6)
    ap.add_argument("--max-pairs", type=int, default=200)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args(argv)
    write = not args.quick
    if args.quick:
        args.requests, args.seconds, args.min_pairs = 24, 0.0, 2

    from benchmarks.harness.minilm import export_minilm
    from model_factory.measure import bench

    lines = bench.load_texts(HERE / "texts.txt")
    with tempfile.TemporaryDirectory(prefix="bench-observability-") as tmp:
        work = Path(tmp)
        say("export")
        recipe, exported = export_minilm(work)
        if args.part in ("all", "long-inputs"):
            publish(_long_inputs(work, recipe, exported, lines, args.quick), args.results, START, END, write=write)
        if args.part in ("all", "tracing"):
            say("tracing")
            publish(_tracing(work, recipe, exported, lines, args), args.results, TRACING_START, TRACING_END,
                    write=write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
