"""INT8 on the CPU behind the real Triton: FP32 vs INT8 with Q/DQ simulated in float vs ONNX Runtime's integer
kernels, and the instances' threads: the cores split (the default) against every core each with spinning off.

    .venv/bin/python benchmarks/bench_int8_cpu.py            # ~10 min on 2 busy cores, writes RESULTS.md
    .venv/bin/python benchmarks/bench_int8_cpu.py --quick    # a smoke run, RESULTS.md untouched

MiniLM built once (FP32 + INT8, the example recipe's gate), then packaged five times as the default package
(2 instances, unbounded queues), each served by its own real Triton in this one process:

(FP32)                 the default package: the cores split between the instances (2 x 1 on 2 cores);
(FP32, 2 x all)        every core per instance, spinning off (cpu_threads = the core count);
(INT8 simulated)       INT8 with Q/DQ as float arithmetic (weights folded at load), cores split;
(INT8 integer)         ONNX Runtime's integer kernels, cores split (the default on a CPU with VNNI/AMX);
(INT8 integer, 2 x all) ONNX Runtime's integer kernels, every core per instance.

Each package's acceptance (``model-factory accept``'s score: mean cosine vs FP32 on the held-out data)
is taken through the same choice of kernels, and the kernels and threads each server really runs are
read back from its ``/metrics`` (``model_factory_engine_info``). Then, over rounds in alternating order:
throughput and latency at 1, 8 and 64 requests in flight (gRPC, token ids of real-text lengths, closed
loop; the load generator shares the cores). Medians over rounds, with the range; ratios are taken within
each round. The section between ``<!-- int8cpu:start -->`` and ``<!-- int8cpu:end -->`` of RESULTS.md is
replaced.
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

EXAMPLE = HERE.parent / "model_factory" / "examples" / "minilm.toml"
START, END = "<!-- int8cpu:start -->", "<!-- int8cpu:end -->"
FLAGS = ("avx2", "avx512_vnni", "avx_vnni", "amx_int8", "asimddp", "i8mm")
# label: (served precision, int8_kernels, cpu_threads per instance; 0 = the default: the cores split,
# "all" = every core per instance, spinning off)
CONFIGS = {
    "FP32": ("fp32", "auto", 0),
    "FP32, 2 x all": ("fp32", "auto", "all"),
    "INT8 simulated": ("int8", "simulated", 0),
    "INT8 integer": ("int8", "integer", 0),
    "INT8 integer, 2 x all": ("int8", "integer", "all"),
}
BASE = "FP32"


def _rng(values: Sequence[float], fmt: str = "{:.1f}") -> str:
    """``median (min-max)``."""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,8,64", help="requests in flight")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (RESULTS.md untouched)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.concurrency, args.no_write = 1, "1,8", True

    from model_factory.backend.cpu_features import cpu_flags
    from model_factory.backend.loading import available_cpus
    from model_factory.build.pipeline import build, package_existing
    from model_factory.measure import bench
    from model_factory.recipe import load_recipe
    from model_factory.serving.acceptance import accept_model
    from model_factory.serving.server import ServerOptions, TritonServer

    cores = available_cpus()
    flags = cpu_flags()
    levels = [int(x) for x in args.concurrency.split(",")]
    load_start = os.getloadavg()
    results: dict[tuple[str, int], list[bench.BenchResult]] = {}
    accepted, running = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench-int8-cpu-") as tmp:
        work = Path(tmp)
        recipe = load_recipe(EXAMPLE, {"repository.path": str(work / "repo_build"), "precisions": ["fp32", "int8"],
                                       "tensorrt.enabled": False, "batching.max_queue_size": 0})
        say("build (export, quantize with the example's gate, package)")
        build(recipe)
        for i, (label, (precision, kernels, threads)) in enumerate(CONFIGS.items()):
            r = dataclasses.replace(recipe, repository=dataclasses.replace(
                recipe.repository, path=work / f"repo{i}", serve=precision, int8_kernels=kernels,
                cpu_threads=cores if threads == "all" else threads))
            package_existing(r)
            res = accept_model(work / f"repo{i}" / "minilm", layers=False)
            accepted[label] = res
            say(f"{label}: accept {'pass' if res.passed else 'FAIL'} {res.score:.5f} ({res.where})")
        tok = bench.load_tokenizer(work / "build" / "minilm" / "export" / "tokenizer", 128)
        stream = bench.make_payloads(bench.draw_texts(bench.load_texts(HERE / "texts.txt"), 600, seed=0), tok)
        servers = {}
        try:
            for i, label in enumerate(CONFIGS):
                servers[label] = TritonServer(work / f"repo{i}", ["minilm"],
                                              ServerOptions(0, 0, 0, exit_timeout_s=30)).start()
                info = [s.labels for s in bench.scrape_metrics(servers[label].metrics_url)
                        if s.name == "model_factory_engine_info"]
                running[label] = sorted({(x.get("precision", "?"), x.get("int8_kernels", "-"), x.get("threads", "?"))
                                         for x in info})
                say(f"{label}: serving {running[label]}")
            for rnd in range(args.rounds):
                order = list(CONFIGS) if rnd % 2 == 0 else list(reversed(CONFIGS))
                for label in order:
                    url = servers[label].grpc_url
                    for c in levels:
                        count = 120 if c == 1 else max(4 * c, 160)
                        res = bench.run_load(url, "minilm", stream[:count], protocol="grpc", concurrency=c,
                                             warmup=8 if c == 1 else c, send="ids", label=f"c={c}")
                        results.setdefault((label, c), []).append(res)
                    say(f"round {rnd + 1} {label}: " + ", ".join(
                        f"c={c} {results[(label, c)][-1].throughput:.0f} seq/s" for c in levels))
        finally:
            for s in servers.values():
                s.stop()
    load_end = os.getloadavg()

    def col(label: str, c: int, attr: str) -> list[float]:
        return [getattr(r, attr) for r in results[(label, c)]]

    def ratio(label: str, c: int, base: str = BASE) -> list[float]:
        return [a.throughput / b.throughput for a, b in zip(results[(label, c)], results[(base, c)])]

    rows = ["| configuration | kernels, threads per instance (from /metrics) | accept (mean cos, gate 0.99) | "
            + " | ".join(f"seq/s at {c}" for c in levels) + " | p50 ms at 1 | "
            + " | ".join(f"vs ({BASE}) at {c}" for c in levels) + " |",
            "|" + " --- |" * (4 + 2 * len(levels))]
    for label in CONFIGS:
        a = accepted[label]
        shown = "; ".join(f"{p} {k}, {t}" for p, k, t in running[label]) or "?"
        rows.append(f"| ({label}) | {shown} | {a.score:.5f} {'pass' if a.passed else 'FAIL'} | "
                    + " | ".join(_rng(col(label, c, "throughput")) for c in levels)
                    + f" | {_rng(col(label, levels[0], 'p50_ms'))} | "
                    + " | ".join(_rng(ratio(label, c), "{:.2f}") + "x" for c in levels) + " |")
    from benchmarks.harness.run_header import LoadReading, cpu_model, load_sentence

    # Busy: more load than this run's own four servers and client account for.
    busy = max(load_start[0], load_start[1], load_end[0], load_end[1]) > cores + 4
    model = cpu_model()
    section = "\n".join([
        START, "## INT8 on the CPU: integer kernels vs Q/DQ in float, and threads per instance "
        "(benchmarks/bench_int8_cpu.py)", "",
        f"Run {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} on {platform.node() or 'this host'}: "
        f"{model}, {cores} usable cores; CPU flags: "
        + ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in FLAGS)
        + f"; {load_sentence(LoadReading(tuple(load_start[:2]), tuple(load_end[:2])), own_processes=4)}"
        + (" (figures are noisy; configurations alternate each round)" if busy else "") + ".", "",
        "MiniLM built once (FP32 + INT8, the example recipe's gate), each package the default one (2 instances, "
        "unbounded queues), its own real Triton; gRPC, token ids of real-text lengths, closed loop; "
        f"{args.rounds} rounds in alternating order; medians over rounds with (min-max); ratios within each round. "
        "`accept` = model-factory accept through the same kernels.", "",
        *rows, "",
        "Every core per instance against the split, same precision — (FP32, 2 x all) vs (FP32): "
        + ", ".join(f"{_rng(ratio('FP32, 2 x all', c, 'FP32'), '{:.2f}')}x at {c}" for c in levels)
        + "; (INT8 integer, 2 x all) vs (INT8 integer): "
        + ", ".join(f"{_rng(ratio('INT8 integer, 2 x all', c, 'INT8 integer'), '{:.2f}')}x at {c}" for c in levels)
        + ".",
        "", END])
    publish(section, args.results, START, END, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
