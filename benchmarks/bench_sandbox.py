"""Serving throughput with each stub walled in (Landlock + seccomp) against the same server without walls.

    .venv/bin/python benchmarks/bench_sandbox.py            # ~2 min on 2 cores, writes RESULTS.md

MiniLM (FP32 ONNX, ONNX Runtime CPU), one repository, the real tritonserver started in turns with the
sandbox on (the default) and off (``MODEL_FACTORY_SERVE_SANDBOX=off``), alternating so that drift on a
shared machine falls on both. Each turn: a warm-up, then closed-loop clients (HTTP, one sentence of
benchmarks/texts.txt per request) for a fixed time; throughput and p50/p99 latency per turn, and the
on/off ratio of the medians. The walls cost nothing per request by design (Landlock checks open(), not
read(); the seccomp filter runs on each syscall: a handful of BPF instructions). The section between
``<!-- sandbox:start -->`` and ``<!-- sandbox:end -->`` of RESULTS.md is replaced.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # results_file.py is beside this script
sys.path.insert(0, str(HERE.parent))  # the repository root: benchmarks.harness
from results_file import publish, say  # noqa: E402

START, END = "<!-- sandbox:start -->", "<!-- sandbox:end -->"


def load(url: str, texts: list[str], clients: int, seconds: float) -> tuple[float, float, float]:
    """(requests/s, p50 ms, p99 ms) of ``clients`` closed-loop clients for ``seconds``."""
    import tritonclient.http as http

    from model_factory.measure.client import embed_texts  # noqa: F401  (the same request shape)
    import numpy as np

    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client(k: int) -> None:
        c = http.InferenceServerClient(url)
        mine = []
        i = k
        try:
            while time.monotonic() < stop:
                text = np.array([[texts[i % len(texts)].encode()]], dtype=object)
                inp = http.InferInput("text", [1, 1], "BYTES")
                inp.set_data_from_numpy(text)
                t0 = time.perf_counter()
                c.infer("minilm", [inp], outputs=[http.InferRequestedOutput("embedding")])
                mine.append(time.perf_counter() - t0)
                i += clients
        finally:
            c.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    latencies.sort()
    return (len(latencies) / wall, 1e3 * latencies[len(latencies) // 2],
            1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="turns per mode (alternating)")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args(argv)

    from benchmarks.harness.minilm import TEXTS, export_minilm, package_variant
    from model_factory.backend.operations.sandbox import SERVE_ENV, support
    from model_factory.measure import bench
    from model_factory.serving.server import ServerOptions, TritonServer

    have = support()
    texts = [t for t in TEXTS.read_text().splitlines() if t.strip()]
    rows: list[tuple[str, float, float, float, str]] = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as tmp:
        root = Path(tmp)
        recipe, exported = export_minilm(root, {"repository.path": str(root / "repo")})
        repo = package_variant(recipe, exported)
        for i in range(2 * args.rounds):
            mode = "on" if i % 2 == 0 else "off"
            env = {} if mode == "on" else {SERVE_ENV: "off"}
            server = TritonServer(repo, ["minilm"], ServerOptions(0, 0, 0), env=env).start()
            try:
                state = next(s.labels.get("sandbox", "?") for s in bench.scrape_metrics(server.metrics_url)
                             if s.name == "model_factory_engine_info")
                load(server.http_url, texts, args.clients, 3.0)  # warm-up (the cost model learns here too)
                rps, p50, p99 = load(server.http_url, texts, args.clients, args.seconds)
            finally:
                server.stop()
            say(f"sandbox {mode} ({state}): {rps:.1f} req/s, p50 {p50:.1f} ms, p99 {p99:.1f} ms")
            rows.append((mode, rps, p50, p99, state))
    load_after = os.getloadavg()
    med = {m: statistics.median(r[1] for r in rows if r[0] == m) for m in ("on", "off")}
    p50 = {m: statistics.median(r[2] for r in rows if r[0] == m) for m in ("on", "off")}
    lines = [START, "## Serving with the stub sandbox on vs off", "",
             f"`benchmarks/bench_sandbox.py`, {_dt.date.today().isoformat()}, {platform.node()} "
             f"({os.cpu_count()} cores, **shared with other work**: load average {load_before[0]:.1f} before, "
             f"{load_after[0]:.1f} after). MiniLM FP32 on ONNX Runtime CPU (the example recipe's instances), {args.clients} closed-loop "
             f"HTTP clients, {args.seconds:.0f} s per turn after a 3 s warm-up, turns alternating on/off. Kernel: "
             f"{have.describe()}.", "",
             "| turn | sandbox | req/s | p50 ms | p99 ms |", "| --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {i + 1} | {state} | {rps:.1f} | {a:.1f} | {b:.1f} |" for i, (_m, rps, a, b, state) in enumerate(rows)]
    lines += ["", f"Median throughput on / off: **{med['on'] / med['off']:.3f}** ({med['on']:.1f} vs {med['off']:.1f} "
              f"req/s); median p50 on / off: {p50['on'] / p50['off']:.3f}. The walls are applied once, after the "
              "load; a request pays only the seccomp filter on its syscalls.", END]
    publish("\n".join(lines), args.results, START, END, not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
