"""INT8 on the CPU behind the real Triton: FP32 vs INT8 with Q/DQ simulated in float vs ONNX Runtime's integer
kernels, and the instances' threads: the cores split with idle cores lent (the default), split alone (the
default before lending), and every core each with spinning off.

    .venv/bin/python benchmarks/bench_int8_cpu.py            # ~12 min on 2 cores, writes RESULTS.md
    .venv/bin/python benchmarks/bench_int8_cpu.py --quick    # a smoke run, RESULTS.md untouched

MiniLM built once (FP32 + INT8, the example recipe's gate), then packaged eight times as the default package
(2 instances, unbounded queues), each served by its own real Triton in this one process:

(FP32, split)           the cores split between the instances (2 x 1 on 2 cores), nothing lent: the baseline;
(FP32, split again)     the baseline a second time, its own server: how far two equal packages differ here;
(FP32)                  the default package: split, and a run takes every core while the other instance is
                        idle (``lend_idle_cores``, backends/python_backend/batching/idle_cores.py);
(FP32, 2 x all)         every core per instance, spinning off (cpu_threads = the core count);
(INT8 simulated)        INT8 with Q/DQ as float arithmetic (weights folded at load), the default threads;
(INT8 integer, split)   ONNX Runtime's integer kernels, cores split, nothing lent;
(INT8 integer)          ONNX Runtime's integer kernels, the default threads (the default on a CPU with VNNI/AMX);
(INT8 integer, 2 x all) ONNX Runtime's integer kernels, every core per instance;
(INT8 integer, 7-bit)   integer kernels on the 7-bit weight form (``model.int8.w7.onnx``), the default threads: what
                        ``auto`` runs on a CPU without VNNI/AMX, where 8-bit weights saturate. Here it runs on this
                        CPU's kernels (VNNI where it has them): an AVX2-only CPU's own speed is its own run.

Each package's acceptance (``model-factory accept``'s score: mean cosine vs FP32 on the held-out data)
is taken through the same choice of kernels, and the kernels and threads each server really runs are
read back from its ``/metrics`` (``model_factory_engine_info``), with the share of engine runs that took
borrowed cores at each load (``model_factory_borrowed_core_runs_total`` / ``model_factory_groups_total``).
Then, over rounds in alternating order: throughput and latency at 1, 8 and 64 requests in flight (gRPC,
token ids of real-text lengths, closed loop; the load generator shares the cores). Medians over rounds, with
the range; ratios are taken within each round. Each CPU kind owns its own section of RESULTS.md, replaced by its
latest run: ``int8cpu`` on a CPU with integer dot products (VNNI/AMX/asimddp/i8mm), ``int8cpu-avx2`` on one
without (AVX2 only). On an AVX2-only CPU the 8-bit integer rows are left out: ``integer`` runs the 7-bit form
there, as ``auto`` does, and 8-bit weights on those kernels compute wrong values.
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

def markers(flags: frozenset[str]) -> tuple[str, str]:
    """This CPU kind's section of RESULTS.md: ``int8cpu`` with integer dot products, ``int8cpu-avx2`` without."""
    from model_factory.backend.engines.cpu_features import integer_dot_product

    name = "int8cpu" if integer_dot_product(flags) else "int8cpu-avx2"
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


# Rows that need integer dot products: on a CPU without them `integer` runs the 7-bit form (the last row).
NEEDS_DOT = ("INT8 integer, split", "INT8 integer", "INT8 integer, 2 x all")
FLAGS = ("avx2", "avx512_vnni", "avx_vnni", "amx_int8", "asimddp", "i8mm")
# label: (served precision, int8_kernels, cpu_threads per instance, lend_idle_cores); threads 0 = the cores
# split, "all" = every core per instance, spinning off.
CONFIGS = {
    "FP32, split": ("fp32", "auto", 0, False),
    "FP32, split again": ("fp32", "auto", 0, False),  # the baseline twice: the noise floor of every ratio
    "FP32": ("fp32", "auto", 0, True),
    "FP32, 2 x all": ("fp32", "auto", "all", True),
    "INT8 simulated": ("int8", "simulated", 0, True),
    "INT8 integer, split": ("int8", "integer", 0, False),
    "INT8 integer": ("int8", "integer", 0, True),
    "INT8 integer, 2 x all": ("int8", "integer", "all", True),
    # The 7-bit weight form (model.int8.w7.onnx): what `auto` and `integer` run on a CPU without VNNI/AMX.
    "INT8 integer, 7-bit": ("int8", "integer-7bit", 0, True),
}
BASE = "FP32, split"
BORROWED, GROUPS = "model_factory_borrowed_core_runs_total", "model_factory_groups_total"


def _rng(values: Sequence[float], fmt: str = "{:.1f}") -> str:
    """``median (min-max)``."""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def _counts(bench, url: str) -> tuple[float, float]:
    """(runs on borrowed cores, engine runs) of the served model so far, after the backend's next flush."""
    import time

    time.sleep(1.2)  # the backend sends its counters about once a second
    samples = bench.scrape_metrics(url)
    return (bench.metric_total(samples, BORROWED, model="minilm") or 0.0,
            bench.metric_total(samples, GROUPS, model="minilm") or 0.0)


def _auto_lines(flags, accepted, results, levels, ratio, cpu_gain) -> list[str]:
    """What ``auto`` picks on this CPU, with the figures behind it (throughput and CPU per sequence vs FP32)."""
    from model_factory.backend.engines.cpu_features import integer_dot_product

    top = max(levels)
    found = integer_dot_product(flags)
    out = []
    for label in ("INT8 simulated", "INT8 integer", "INT8 integer, 7-bit"):
        if label in accepted and (label, top) in results:
            out.append(f"({label}) vs ({BASE}) at {top} in flight: {_rng(ratio(label, top), '{:.2f}')}x the "
                       f"throughput, {_rng(cpu_gain(label, top), '{:.2f}')}x less CPU per sequence, accept "
                       f"{accepted[label].score:.5f} ({'pass' if accepted[label].passed else 'FAIL'})")
    if found:
        here = ("`auto` on this CPU (" + ", ".join(found) + "): integer kernels on the 8-bit weights, (INT8 integer). "
                "An AVX2-only CPU has its own section (`int8cpu-avx2`), written by this script on such a CPU.")
    else:
        here = ("`auto` on this CPU (AVX2, no integer dot products): integer kernels on the 7-bit weights, (INT8 "
                "integer, 7-bit), when the build kept that form (its gate score is in quantize.json); 8-bit weights "
                "never meet integer kernels here (they saturate). Without the 7-bit form, `auto` serves the FP32 "
                "model that packaging then puts beside the INT8 one, since Q/DQ simulated in float does FP32's work "
                "and more: (INT8 simulated) above is what a package without either would get.")
    return [here, "", "; ".join(out) + "."]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,8,64", help="requests in flight")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (RESULTS.md untouched)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    ap.add_argument("--only", default="", help="semicolon-separated configuration labels to run (RESULTS.md untouched)")
    args = ap.parse_args(argv)
    if args.only:
        keep = {x.strip() for x in args.only.split(";")}
        for label in [k for k in CONFIGS if k not in keep and k != BASE]:
            del CONFIGS[label]
        args.no_write = True
    if args.quick:
        args.rounds, args.concurrency, args.no_write = 1, "1,8", True

    from benchmarks.harness.server_cpu import server_cpu_seconds
    from model_factory.backend.engines.cpu_features import cpu_flags, integer_dot_product
    from model_factory.backend.engines.loading import available_cpus
    from model_factory.build.pipeline import build, package_existing
    from model_factory.measure import bench
    from model_factory.recipe import load_recipe
    from model_factory.serving.acceptance import accept_model
    from model_factory.serving.server import ServerOptions, TritonServer

    cores = available_cpus()
    flags = cpu_flags()
    START, END = markers(flags)
    if not integer_dot_product(flags):
        for label in NEEDS_DOT:
            CONFIGS.pop(label, None)
    levels = [int(x) for x in args.concurrency.split(",")]
    load_start = os.getloadavg()
    results: dict[tuple[str, int], list[bench.BenchResult]] = {}
    accepted, running, borrowed = {}, {}, {}
    cpu: dict[tuple[str, int], list[float]] = {}  # the server's CPU milliseconds per answered sequence
    with tempfile.TemporaryDirectory(prefix="bench-int8-cpu-") as tmp:
        work = Path(tmp)
        recipe = load_recipe(EXAMPLE, {"repository.path": str(work / "repo_build"), "precisions": ["fp32", "int8"],
                                       "tensorrt.enabled": False, "batching.max_queue_size": 0})
        say("build (export, quantize with the example's gate, package)")
        build(recipe)
        for i, (label, (precision, kernels, threads, lend)) in enumerate(CONFIGS.items()):
            r = dataclasses.replace(recipe, repository=dataclasses.replace(
                recipe.repository, path=work / f"repo{i}", serve=precision, int8_kernels=kernels,
                cpu_threads=cores if threads == "all" else threads, lend_idle_cores=lend))
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
                running[label] = sorted({(x.get("precision", "?"), x.get("int8_kernels", "-")
                                          + (f" ({x['int8_weights']} weights)" if x.get("int8_weights") else ""),
                                          x.get("threads", "?"), x.get("wide_threads", "0")) for x in info})
                say(f"{label}: serving {running[label]}")
            for rnd in range(args.rounds):
                order = list(CONFIGS) if rnd % 2 == 0 else list(reversed(CONFIGS))
                for label in order:
                    url = servers[label].grpc_url
                    for c in levels:
                        count = 120 if c == 1 else max(16 * c, 320)  # at 64 in flight: 1024 requests, some seconds
                        lends = CONFIGS[label][2] == 0 and CONFIGS[label][3]
                        before = _counts(bench, servers[label].metrics_url) if lends else (0.0, 0.0)
                        warm = 8 if c == 1 else c
                        cpu_before = server_cpu_seconds(servers[label])
                        res = bench.run_load(url, "minilm", stream[:count], protocol="grpc", concurrency=c,
                                             warmup=warm, send="ids", label=f"c={c}")
                        # The warm-up's sequences ran inside the same CPU window: counted with the measured ones.
                        cpu.setdefault((label, c), []).append(
                            (server_cpu_seconds(servers[label]) - cpu_before) / max(res.sequences + warm, 1) * 1000)
                        results.setdefault((label, c), []).append(res)
                        if lends:
                            after = _counts(bench, servers[label].metrics_url)
                            runs = after[1] - before[1]
                            borrowed.setdefault((label, c), []).append((after[0] - before[0]) / runs if runs else 0.0)
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
        shown = "; ".join(f"{p} {k}, {t}" + (f" (borrows {w})" if w not in ("0", "") else "")
                          for p, k, t, w in running[label]) or "?"
        rows.append(f"| ({label}) | {shown} | {a.score:.5f} {'pass' if a.passed else 'FAIL'} | "
                    + " | ".join(_rng(col(label, c, "throughput")) for c in levels)
                    + f" | {_rng(col(label, levels[0], 'p50_ms'))} | "
                    + " | ".join(_rng(ratio(label, c), "{:.2f}") + "x" for c in levels) + " |")
    def cpu_gain(label: str, c: int, base: str = BASE) -> list[float]:
        """The baseline's CPU per sequence over this configuration's, within each round: how many times fewer CPU
        seconds a sequence costs (what throughput would gain on an otherwise idle machine whose cores are saturated)."""
        return [b / a for a, b in zip(cpu[(label, c)], cpu[(base, c)]) if a > 0]

    cpu_rows = ["| configuration | " + " | ".join(f"server CPU ms/seq at {c}" for c in levels) + " | "
                + " | ".join(f"CPU per seq, ({BASE}) / this, at {c}" for c in levels) + " |",
                "|" + " --- |" * (1 + 2 * len(levels))]
    for label in CONFIGS:
        cpu_rows.append(f"| ({label}) | " + " | ".join(_rng(cpu[(label, c)], "{:.2f}") for c in levels) + " | "
                        + " | ".join(_rng(cpu_gain(label, c), "{:.2f}") + "x" for c in levels) + " |")
    from benchmarks.harness.run_header import LoadReading, cpu_model, load_sentence

    # Busy: more load than this run's own four servers and client account for.
    busy = max(load_start[0], load_start[1], load_end[0], load_end[1]) > cores + 4
    model = cpu_model()
    section = "\n".join([
        START, "## INT8 on the CPU" + ("" if integer_dot_product(flags) else " without integer dot products (AVX2 only)")
        + ": integer kernels vs Q/DQ in float, and threads per instance "
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
        "CPU time per answered sequence, the server's own (tritonserver and its stubs: user + system, read with psutil "
        "around each load; the warm-up's sequences counted). Other work on a shared machine stretches wall time, "
        "but much less what a sequence costs in CPU, so these ratios are the steadier reading of which engine is "
        "cheaper here; at 64 in flight, with the cores saturated, throughput follows them on an idle machine.", "",
        *cpu_rows, "",
        "Same precision, against the split with nothing lent (the first pair is the baseline against itself: "
        "the noise of this machine) — "
        + "; ".join(f"({new}) vs ({old}): " + ", ".join(f"{_rng(ratio(new, c, old), '{:.2f}')}x at {c}" for c in levels)
                    for new, old in (("FP32, split again", "FP32, split"), ("FP32", "FP32, split"),
                                     ("FP32, 2 x all", "FP32, split"),
                                     ("INT8 integer", "INT8 integer, split"),
                                     ("INT8 integer, 2 x all", "INT8 integer, split"))
                    if new in CONFIGS and old in CONFIGS)
        + ".", "",
        "Engine runs on borrowed cores (all cores, the other instance idle), share of runs — "
        + "; ".join(f"({label}): " + ", ".join(f"{_rng(borrowed[(label, c)], '{:.2f}')} at {c}" for c in levels)
                    for label in CONFIGS if (label, levels[0]) in borrowed)
        + ".", "", *_auto_lines(flags, accepted, results, levels, ratio, cpu_gain), "", END])
    publish(section, args.results, START, END, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
