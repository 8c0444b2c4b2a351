"""Instances and threads on the CPU: one instance against two that split the cores, side by side.

    .venv/bin/python benchmarks/bench_instances.py            # ~2 min on 2 cores, writes RESULTS.md
    .venv/bin/python benchmarks/bench_instances.py --quick    # a smoke run, RESULTS.md untouched

MiniLM (FP32 ONNX, ONNX Runtime CPU) served by the real bundled Triton through model-factory's backend,
packaged three times, each on its own server in this one process, all unbounded and with the same fixed
cost model:

(1 x all)  one instance, ONNX Runtime threads = the cores (what one instance gets by default);
(2 x split) two instances, the cores split between them (the default package: ``cpu_threads`` = 0);
(2 x all)  two instances that each start a thread per core (``cpu_threads`` = the cores; what two
           instances did before the backend split the cores).

For each, in alternating order over rounds: the unloaded latency (one request in flight) and throughput at
4 to 64 requests in flight (``model-factory bench``'s load generator, token ids of real-text lengths, gRPC).
The section between ``<!-- instances:start -->`` and ``<!-- instances:end -->`` of RESULTS.md is replaced.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # results_file.py is beside this script
sys.path.insert(0, str(HERE.parent))  # the repository root: benchmarks.harness
from results_file import publish, say  # noqa: E402

START, END = "<!-- instances:start -->", "<!-- instances:end -->"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="4,16,64", help="requests in flight for the throughput runs")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (RESULTS.md untouched)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.concurrency, args.no_write = 1, "16", True

    from model_factory.measure import bench
    from model_factory.backend.engines.loading import available_cpus
    from benchmarks.harness.minilm import export_minilm, package_variant, start_server
    from benchmarks.harness.onnx_cost import measure_onnx_cost_model

    cores = available_cpus()
    configs = {"1 x all": (1, 0), "2 x split": (2, 0), "2 x all": (2, cores)}
    levels = [int(x) for x in args.concurrency.split(",")]
    results: dict[tuple[str, int], list[bench.BenchResult]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-instances-") as tmp:
        work = Path(tmp)
        say("export")
        recipe, exported = export_minilm(work, {"batching.max_queue_size": 0})
        cost = measure_onnx_cost_model(exported.onnx_path, recipe)
        fixed = {"cost_model": ",".join(repr(float(x)) for x in cost)}
        for i, (label, (instances, threads)) in enumerate(configs.items()):
            r = dataclasses.replace(recipe, repository=dataclasses.replace(
                recipe.repository, instance_count=instances, cpu_threads=threads))
            package_variant(r, exported, work / f"repo{i}", parameters=fixed)
        tok = bench.load_tokenizer(exported.tokenizer_dir, 128)
        stream = bench.make_payloads(bench.draw_texts(bench.load_texts(HERE / "texts.txt"), 600, seed=0), tok)
        servers = {}
        try:
            for i, label in enumerate(configs):
                servers[label] = start_server(work / f"repo{i}", exit_timeout_s=30)
            for rnd in range(args.rounds):
                for label in (list(configs) if rnd % 2 == 0 else list(reversed(configs))):
                    url = servers[label].grpc_url
                    for c in [1] + levels:
                        res = bench.run_load(url, "minilm", stream[:150 if c == 1 else max(4 * c, 160)], protocol="grpc",
                                             concurrency=c, warmup=8 if c == 1 else c, send="ids", label=f"c={c}")
                        results.setdefault((label, c), []).append(res)
                    say(f"round {rnd + 1} {label}: " + ", ".join(
                        f"c={c} {results[(label, c)][-1].throughput:.0f} seq/s" for c in [1] + levels))
        finally:
            for s in servers.values():
                s.stop()

    def med(label: str, c: int, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in results[(label, c)])

    base = "1 x all"
    rows = ["| configuration | instances x ORT threads | unloaded p50 ms | unloaded p99 ms | "
            + " | ".join(f"seq/s at {c}" for c in levels) + f" | vs ({base}) at {levels[-1]} |",
            "|" + " --- |" * (5 + len(levels))]
    for label, (instances, threads) in configs.items():
        per = threads or max(1, cores // instances)
        ratio = statistics.median(a.throughput / b.throughput for a, b in zip(results[(label, levels[-1])],
                                                                               results[(base, levels[-1])]))
        rows.append(f"| ({label}) | {instances} x {per} | {med(label, 1, 'p50_ms'):.1f} | {med(label, 1, 'p99_ms'):.1f} | "
                    + " | ".join(f"{med(label, c, 'throughput'):.1f}" for c in levels) + f" | {ratio:.2f}x |")
    section = "\n".join([
        START, "## Instances on the CPU: one, or two that split the cores (benchmarks/bench_instances.py)", "",
        f"Run {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} on {platform.node() or 'this host'} "
        f"({cores} usable cores, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end). MiniLM "
        "FP32 ONNX on ONNX Runtime CPU through model-factory's backend, unbounded queues, one fixed cost model for "
        f"all; gRPC, token ids of real-text lengths, closed loop; {args.rounds} rounds in alternating order, "
        "medians over rounds (the ratio is taken within each round). The load generator shares the cores.", "",
        *rows, "", END])
    publish(section, args.results, START, END, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
