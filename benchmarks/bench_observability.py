"""Long inputs and tracing, measured on the real server (issue 30).

    .venv/bin/python benchmarks/bench_observability.py           # ~3 min on 2 cores, writes RESULTS.md
    .venv/bin/python benchmarks/bench_observability.py --quick   # a smoke run, RESULTS.md untouched

1. Long inputs: how close is a chunked embedding to the whole text's? MiniLM is packaged twice from one export:
   ``minilm`` (max_sequence_length 128) and ``minilm512`` (512, buckets 128 and 512: MiniLM's position table has
   512 rows, so no bucket of 1024 is possible). Texts of 200 to 500 tokens (benchmarks/texts.txt lines joined)
   are sent to ``minilm`` with ``long_inputs=chunk`` and with ``truncate``, and whole to ``minilm512``; the
   cosine of each against the whole text's embedding is reported.
2. Tracing: throughput at 8 requests in flight (texts, HTTP) on a server without tracing and on one tracing
   every request (``--trace-rate 1``) into an OTLP receiver in this process, in alternating rounds.

Sections between ``<!-- observability:start -->`` and ``<!-- observability:end -->`` of RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import http.server
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
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


class _Receiver:
    def __init__(self) -> None:
        self.posts = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))  # read, not parsed: it shares the
                outer.posts += 1  # load generator's process, and a parse would slow the client, not the server
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"127.0.0.1:{self.httpd.server_address[1]}/v1/traces"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args(argv)
    write = not args.quick
    if args.quick:
        args.rounds, args.requests = 1, 64

    from tokenizers import Tokenizer

    from benchmarks.harness.minilm import export_minilm, package_variant, start_server
    from model_factory.backend.loading import available_cpus
    from model_factory.measure import bench

    lines = bench.load_texts(HERE / "texts.txt")
    with tempfile.TemporaryDirectory(prefix="bench-observability-") as tmp:
        work = Path(tmp)
        say("export")
        recipe, exported = export_minilm(work)
        repo = work / "repo"
        package_variant(dataclasses.replace(recipe, repository=dataclasses.replace(recipe.repository,
                                                                                   instance_count=1)),
                        exported, repo, parameters=FIXED)
        wide = dataclasses.replace(recipe, name="minilm512", shapes=dataclasses.replace(
            recipe.shapes, max_sequence_length=512, sequence_buckets=(128, 512)),
            repository=dataclasses.replace(recipe.repository, instance_count=1))
        package_variant(wide, exported, repo, parameters=FIXED)
        tok = Tokenizer.from_file(str(exported.tokenizer_dir / "tokenizer.json"))
        tok.no_truncation()
        texts = _long_texts(lines, tok, [200, 300, 400, 500] if not args.quick else [300])
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

        say("tracing")
        package_variant(recipe, exported, work / "repo-trace", parameters=FIXED)
        receiver = _Receiver()
        stream = bench.make_payloads(bench.draw_texts(lines, args.requests, seed=0))
        servers = {"off": start_server(work / "repo-trace", exit_timeout_s=30),
                   "rate 1": start_server(work / "repo-trace", exit_timeout_s=30, trace_endpoint=receiver.endpoint,
                                          trace_rate=1)}
        results: dict[str, list] = {k: [] for k in servers}
        try:
            for rnd in range(args.rounds):
                for label in (list(servers) if rnd % 2 == 0 else list(reversed(servers))):
                    res = bench.run_load(servers[label].http_url, "minilm", stream, protocol="http", concurrency=8,
                                         warmup=16, send="text", label=label)
                    results[label].append(res)
                    say(f"round {rnd + 1} tracing {label}: {res.throughput:.1f} seq/s, p50 {res.p50_ms:.1f} ms")
        finally:
            for s in servers.values():
                s.stop()
    ratios = [on.throughput / off.throughput for off, on in zip(results["off"], results["rate 1"])]

    def med(label: str, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in results[label])

    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    section = "\n".join([
        START, "## Long inputs: chunked against the whole text (benchmarks/bench_observability.py)", "",
        f"Run {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} on {platform.node() or 'this host'} "
        f"({available_cpus()} usable cores, shared with other work: load average {load} at the end). MiniLM FP32 "
        "ONNX Runtime CPU. The whole text runs on `minilm512` (max_sequence_length 512, buckets 128 and 512: "
        "MiniLM's position table has 512 rows, so a 1024-token bucket cannot be built for it; texts stay under "
        "512 tokens so the reference sees all of them); chunked and truncated on `minilm` (128, chunk_overlap 32). "
        "Cosine of each against the whole text's unit embedding.", "",
        "| tokens | windows of 128 | cosine chunk vs whole | cosine truncate(128) vs whole |",
        "| --- | --- | --- | --- |", *rows, "",
        "## Tracing overhead: OpenTelemetry off vs every request traced (benchmarks/bench_observability.py)", "",
        f"Same run. Two servers from one package (2 instances), one without tracing, one with `--trace-rate 1` "
        f"into an OTLP/HTTP receiver in the benchmark's process ({receiver.posts} OTLP exports received); HTTP, texts, "
        f"8 requests in flight, {args.requests} requests per run, {args.rounds} rounds in alternating order "
        "(ratio taken within each round, median reported). The load generator and the receiver share the cores.",
        "",
        "| tracing | seq/s (median) | p50 ms | p99 ms |", "| --- | --- | --- | --- |",
        *(f"| {k} | {med(k, 'throughput'):.1f} | {med(k, 'p50_ms'):.1f} | {med(k, 'p99_ms'):.1f} |" for k in results),
        "", f"rate 1 / off throughput: {statistics.median(ratios):.3f} (per round: "
            f"{', '.join(f'{r:.3f}' for r in ratios)})." + (
            f" The rounds spread over {max(ratios) - min(ratios):.2f}: on this machine the run cannot resolve a 5 % "
            "difference; rerun on a quiet one." if max(ratios) - min(ratios) > 0.1 else ""), "", END])
    publish(section, args.results, START, END, write=write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
