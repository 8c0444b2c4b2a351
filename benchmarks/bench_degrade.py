"""Degrade before shedding: at about twice what the replica admits, 503s and p99 with degrading on and off.

    .venv/bin/python benchmarks/bench_degrade.py            # about 3 min on 2 cores, writes RESULTS.md
    .venv/bin/python benchmarks/bench_degrade.py --quick    # a smoke run, RESULTS.md untouched

MiniLM exported once and quantized by the real quantize stage (INT8 with the 0.99 gate, and its 7-bit form for
CPUs without VNNI when it passes), packaged twice from the same files, each on its own server in this process:

(off)  FP32, ``max_queue_size = "auto"``, ``shed_by = "count"``: Triton sheds past the bound (503 / UNAVAILABLE);
(on)   FP32 with ``[repository] degrade_to = "int8"``: the bound doubled (``DEGRADE_QUEUE_FACTOR``) and a window
       of ``degrade_backlog`` requests or more (default: half the largest preferred batch) answered by INT8.

Both run the example recipe's batching (two instances, preferred batches 16/32/64) with the same fixed cost-model
constants (measured once here on the FP32 ONNX), so the bound is the same for both before doubling. The load is
twice what the (off) replica admits with a full queue (its bound plus a window of the largest preferred batch in
each instance), in flight for ``--seconds`` each, (off) and (on) alternating over ``--rounds``; closed loop of
token ids (the soak's loop), a rejected client waiting ``--backoff-s`` (1 s) before its next request, as one that
backs off (0: one unloaded p50, a client that retries at once: then nearly every attempt is a 503 either way).
The share of the
accepted requests INT8 answered comes from the (on) server's ``model_factory_degraded_requests_total``. The
section between ``<!-- degrade:start -->`` and ``<!-- degrade:end -->`` of benchmarks/RESULTS.md is replaced.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.harness
from model_factory.measure import bench  # noqa: E402
from benchmarks.harness import soak  # noqa: E402
from benchmarks.harness.run_header import LoadReading, run_header  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # results_file.py is beside this script
from results_file import publish, say  # noqa: E402

START, END = "<!-- degrade:start -->", "<!-- degrade:end -->"
EXAMPLES = HERE.parent / "model_factory" / "examples"


def build(work: Path) -> dict[str, Any]:
    """Export, quantize (the real gate), measure the FP32 cost once, package (off) and (on)."""
    from benchmarks.harness.minilm import export_minilm, package_variant
    from benchmarks.harness.onnx_cost import measured_queue_bound
    from model_factory.backend.contract import DEGRADE_QUEUE_FACTOR
    from model_factory.build_engines.quantize import quantize_model

    recipe, exported = export_minilm(work, {
        "precisions": ["fp32", "int8"], "quantization.calibration_data": str(EXAMPLES / "calibration.txt"),
        "quantization.heldout_data": str(EXAMPLES / "heldout.txt"), "quantization.min_accuracy": 0.99,
        # Shedding by count (503 at once past the bound), as the runs RESULTS.md holds were made; the default now
        # sheds by age, where the load below would wait its turn instead of being shed.
        "batching.shed_by": "count"})
    say("quantize (INT8, the 0.99 gate)")
    quantized = quantize_model(recipe, exported)
    int8 = quantized.models["int8"]
    artifacts = {"model.onnx": exported.onnx_path, "model.int8.onnx": int8}
    seven = int8.parent / "model.int8.w7.onnx"
    if seven.is_file():
        artifacts[seven.name] = seven
    info = json.loads((int8.parent / "quantize.json").read_text()).get("int8_7bit") or {}
    size, cost = measured_queue_bound(exported.onnx_path, recipe)
    params = {"cost_model": ",".join(repr(float(x)) for x in cost)} if cost else {}
    repos = {
        "off": package_variant(recipe, exported, work / "off", parameters=params),
        "on": package_variant(dataclasses.replace(recipe, repository=dataclasses.replace(
            recipe.repository, degrade_to="int8")), exported, work / "on", artifacts=artifacts,
            extra_files=[quantized.report_path], parameters=params),
    }
    return {"repos": repos, "exported": exported, "recipe": recipe, "size": size,
            "on_size": DEGRADE_QUEUE_FACTOR * size,
            "cost": cost, "gate": quantized.report.result("int8"), "min_accuracy": quantized.report.min_accuracy,
            "seven_bit": info}


def degraded_total(server: Any) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        text = r.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(
        r'^model_factory_degraded_requests_total\{[^}]*precision="int8"[^}]*\} (\S+)$', text, re.M))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=15.0, help="length of each loaded run")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--backoff-s", type=float, default=1.0, help="how long a rejected client waits before its next "
                    "request (0: one unloaded p50, a client that retries at once)")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (RESULTS.md untouched)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds, args.rounds, args.no_write = 4.0, 1, True
    load = LoadReading.begin()
    from benchmarks.harness.minilm import start_server

    with tempfile.TemporaryDirectory(prefix="bench-degrade-") as tmp:
        work = Path(tmp)
        say("export, quantize and package")
        b = build(work)
        recipe = b["recipe"]
        admits = b["size"] + recipe.repository.instance_count * max(recipe.batching.preferred_batch_sizes
                                                                   or (recipe.shapes.max_batch,))
        level = 2 * admits
        say(f"bound {b['size']} (on: {b['on_size']}), admits {admits}, load {level} in flight")
        tok = bench.load_tokenizer(b["exported"].tokenizer_dir, 128)
        stream = bench.make_payloads(bench.draw_texts(bench.load_texts(HERE / "texts.txt"), 600, seed=0), tok)
        servers, runs = {}, {}
        try:
            for label, repo in b["repos"].items():
                say(f"start {label}")
                servers[label] = start_server(repo, exit_timeout_s=30)
            unloaded = bench.run_load(servers["off"].grpc_url, "minilm", stream[:60], protocol="grpc", concurrency=1,
                                      warmup=4, send="ids", label="unloaded")
            say(f"unloaded p50 {unloaded.p50_ms:.1f} ms, p99 {unloaded.p99_ms:.1f} ms")
            before = degraded_total(servers["on"])
            pause = args.backoff_s or unloaded.p50_ms / 1e3
            for i in range(args.rounds):
                for label in (("off", "on") if i % 2 == 0 else ("on", "off")):
                    srv = servers[label]
                    r = soak.run_soak(srv.grpc_url, "minilm", stream, srv.process.pid, srv.served_repository,
                                      concurrency=level, seconds=args.seconds, sample_s=3600,
                                      reject_pause_s=pause, send="ids")
                    runs.setdefault(label, []).append(r)
                    ok = r.requests - r.rejected - r.errors
                    say(f"round {i + 1} {label}: {ok / r.seconds:.1f} seq/s accepted, p99 {r.p99_ms:.0f} ms, "
                        f"503 {r.rejected}/{r.requests}, errors {r.errors}")
            import time

            time.sleep(2.5)  # the backend sends its counters about once a second
            degraded = degraded_total(servers["on"]) - before
        finally:
            for s in servers.values():
                s.stop()

    def merged(label: str) -> soak.SoakReport:
        rs = runs[label]
        return soak.SoakReport(sum(r.seconds for r in rs), sum(r.requests for r in rs), sum(r.errors for r in rs),
                               sum(r.rejected for r in rs), [], [], [],
                               latencies_ms=[x for r in rs for x in r.latencies_ms])

    gate, seven = b["gate"], b["seven_bit"]
    rows = ["| degrading | Triton's bound | in flight | accepted seq/s | p50 ms | p99 ms (accepted) | 503 share | "
            "answered by INT8 | errors |", "|" + " --- |" * 9]
    for label in ("off", "on"):
        r = merged(label)
        ok = r.requests - r.rejected - r.errors
        share = r.rejected / r.requests if r.requests else 0.0
        by_int8 = "-" if label == "off" else f"{int(degraded)} of {ok} ({degraded / ok:.0%})" if ok else "0"
        rows.append(f"| {label} | {b['size'] if label == 'off' else b['on_size']} | {level} | {ok / r.seconds:.1f} | "
                    f"{r.p50_ms:.0f} | {r.p99_ms:.0f} | {share:.1%} | {by_int8} | {r.errors} |")
    seven_txt = (f"; its 7-bit form (what a CPU without VNNI runs) {seven.get('metric')} {seven.get('score'):.5f}, "
                 + ("kept" if seven.get("passed") else "not kept")) if seven.get("score") is not None else ""
    section = "\n".join([
        START, "## Degrade before shedding (benchmarks/bench_degrade.py)", "",
        run_header("benchmarks/bench_degrade.py", load.finish(), own_processes=4) + " MiniLM, two instances per "
        "server, gRPC token ids of real-text lengths, closed loop; a rejected client waits "
        + (f"{args.backoff_s:g} s (it backs off)" if args.backoff_s else "one unloaded p50 (it retries at once)")
        + ".", "",
        f"- INT8's gate: {gate.metric} {gate.gate_score:.5f} against min_accuracy {b['min_accuracy']:g} (held-out "
        f"sentences, scored by the quantize stage){seven_txt}.",
        f"- Load: {level} in flight = 2 x what the (off) replica admits with a full queue ({b['size']} queued, "
        f"from the FP32 cost measured here, + {admits - b['size']} in the instances' windows); unloaded p50 "
        f"{unloaded.p50_ms:.1f} ms, p99 {unloaded.p99_ms:.1f} ms; {args.rounds} round(s) of {args.seconds:g} s each.",
        "", *rows, "",
        "One run on a shared 2-core machine: the figures move with the other work on it (the load average above).",
        END])
    publish(section, args.results, START, END, not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
