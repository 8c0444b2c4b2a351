"""FP32 vs FP16 vs INT8 for MiniLM: ONNX Runtime CPU speed, size, quantization cost and accuracy.

    .venv/bin/python benchmarks/bench_precision.py              # ~6 min on 2 cores, writes RESULTS.md
    .venv/bin/python benchmarks/bench_precision.py --quick      # fewer repeats and methods, RESULTS.md untouched

What is measured:

* ONNX Runtime CPU latency and throughput per precision, batch 8 x 128 tokens (every sequence exactly 128
  tokens), median of ``--repeats`` runs after warm-up, default session options (all graph optimizations,
  so INT8 runs on ORT's own int8 kernels);
* size on disk of each ONNX model (and of each TensorRT plan when a builder is installed, with its
  ahead-of-time build time);
* quantization wall time and peak memory per calibration method: every quantize run is a fresh child
  process, so ``getrusage`` peak RSS is that run's own (it includes the imports: the baseline after imports
  is shown too); ``tracemalloc`` peak counts Python/numpy allocations only (not ONNX Runtime's);
* accuracy vs FP32 on the held-out sentences, as the quantize stage reports it (INT8 with Q/DQ simulated
  in float, as TensorRT computes it) and, for INT8, also as ORT's int8 CPU kernels compute it;
* the CPU features that decide which int8/fp16 kernels ORT can use (/proc/cpuinfo flags).

The result replaces the section between ``<!-- precision:start -->`` and ``<!-- precision:end -->`` in
benchmarks/RESULTS.md, leaving other sections alone.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file.py is beside this script
import results_file  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "model_factory" / "examples"
START, END = "<!-- precision:start -->", "<!-- precision:end -->"
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16",
         "amx_tile", "amx_int8", "amx_bf16")
BATCH, SEQ = 8, 128


def cpu_info() -> dict[str, Any]:
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("unknown", ""):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags |= set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count(), "flags": {f: f in flags for f in FLAGS}}


def recipe_for(root: Path, precisions: list[str], method: str) -> Any:
    from model_factory.recipe import load_recipe

    return load_recipe(EXAMPLES / "minilm.toml", {
        "repository.path": str(root / "model_repository"), "precisions": precisions,
        "quantization.calibration_data": str(EXAMPLES / "calibration.txt"),
        "quantization.heldout_data": str(EXAMPLES / "heldout.txt"),
        "quantization.method": method, "quantization.min_accuracy": 0.99})


# --------------------------------------------------------------------------- quantize runs (child processes)


def _quantize_child(root: str, export_dir: str, precisions: list[str], method: str, out: Any) -> None:
    import tracemalloc

    from model_factory.build_engines.accuracy import AccuracyGateError
    from model_factory.build_engines.quantize import load_export, quantize_model

    recipe = recipe_for(Path(root), precisions, method)
    link = recipe.work_dir / "export"
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(export_dir, target_is_directory=True)
    export = load_export(recipe)
    import onnxruntime  # noqa: F401 - imports counted in the baseline, not in the run
    import transformers  # noqa: F401

    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    t0 = time.perf_counter()
    error = None
    try:
        res = quantize_model(recipe, export)
        report, models, float_nodes = res.report, {k: str(v) for k, v in res.models.items()}, list(res.float_nodes)
    except AccuracyGateError as exc:
        report, models, float_nodes, error = exc.report, {}, list(exc.report.results[-1].float_nodes), "gate failed"
    seconds = time.perf_counter() - t0
    _, py_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    out.put({"seconds": seconds, "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
             "baseline_rss_kib": base_rss, "tracemalloc_peak": py_peak, "report": report.to_dict(),
             "models": models, "float_nodes": float_nodes, "error": error})


def quantize_run(root: Path, export_dir: Path, precisions: list[str], method: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_quantize_child, args=(str(root), str(export_dir), precisions, method, q))
    p.start()
    result = q.get()
    p.join()
    return result


# --------------------------------------------------------------------------- speed


def long_batch(tokenizer_dir: Path) -> dict[str, Any]:
    """BATCH sequences of exactly SEQ tokens, from the example sentences."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    lines = (EXAMPLES / "calibration.txt").read_text().splitlines()
    texts = [" ".join(lines[i * 12:(i + 1) * 12]) for i in range(BATCH)]
    enc = tok(texts, padding="max_length", truncation=True, max_length=SEQ, return_tensors="np")
    assert enc["attention_mask"].sum() == BATCH * SEQ, "the texts must fill every position"
    return {k: v.astype("int64") for k, v in enc.items()}


def time_session(path: Path, feeds: dict[str, Any], repeats: int, warmup: int) -> dict[str, float]:
    from model_factory.build_engines.export import onnxruntime_session

    sess = onnxruntime_session(path)
    names = [i.name for i in sess.get_inputs()]
    feeds = {n: feeds[n] for n in names}
    for _ in range(warmup):
        sess.run(None, feeds)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"median_ms": med * 1e3, "p10_ms": sorted(times)[len(times) // 10] * 1e3,
            "max_ms": max(times) * 1e3, "seq_per_s": BATCH / med, "tokens_per_s": BATCH * SEQ / med}


def ort_kernel_accuracy(int8_path: Path, recipe: Any, export: Any) -> dict[str, float]:
    """INT8 accuracy as ONNX Runtime's own int8 CPU kernels compute it (full graph optimizations)."""
    from model_factory.build_engines.accuracy import Evaluator
    from model_factory.build_engines.calibration import InputEncoder, split_data
    from model_factory.build_engines.export import onnxruntime_session
    from model_factory.build_engines.calibration import input_types as _input_types

    ref = onnxruntime_session(export.onnx_path)
    split = split_data(recipe.quantization, need_calibration=True)
    enc = InputEncoder(_input_types(ref), export.tokenizer_dir, recipe.shapes.max_sequence_length)
    ev = Evaluator(ref, enc.encode(split.heldout), recipe.task, "embedding")
    r = ev.score(onnxruntime_session(int8_path), "int8")
    return {"mean": r.score, "min": r.min_cosine, "max_abs": r.max_abs_error}


# --------------------------------------------------------------------------- report


def render(env: dict[str, Any], runs: dict[str, dict[str, Any]], speed: dict[str, dict[str, float]],
           sizes: dict[str, int], engines: dict[str, dict[str, Any]], ort_int8: dict[str, float]) -> str:
    mib = 1 / 2**20
    flags = ", ".join(f for f, on in env["cpu"]["flags"].items() if on) or "none"
    missing = ", ".join(f for f, on in env["cpu"]["flags"].items() if not on)
    out = [START, "## Precision (FP32 / FP16 / INT8, MiniLM on ONNX Runtime CPU)", "",
           f"`benchmarks/bench_precision.py`, {env['date']}: {env['cpu']['model']}, {env['cpu']['cores']} cores, "
           f"Python {env['python']}, onnxruntime {env['ort']}. CPU flags present: {flags}; absent: {missing}. "
           f"Load average (1 min) before / after: {env['load_before']:.2f} / {env['load_after']:.2f} "
           "(shared machine).", "",
           f"### Speed (batch {BATCH} x {SEQ} tokens, median of {env['repeats']} runs)", "",
           "| precision | ONNX size MiB | median ms | p10 ms | seq/s | tokens/s | vs FP32 |", "|---|---|---|---|---|---|---|"]
    base = speed["fp32"]["median_ms"]
    for p, s in speed.items():
        out.append(f"| {p} | {sizes[p] * mib:.1f} | {s['median_ms']:.1f} | {s['p10_ms']:.1f} | {s['seq_per_s']:.1f} "
                   f"| {s['tokens_per_s']:.0f} | {base / s['median_ms']:.2f}x |")
    out += ["", "### Accuracy vs FP32 (40 held-out sentences) and quantization cost", "",
            "| run | mean cos | min cos | max abs err | INT8 MatMuls | kept in float | all-INT8 score (search set) "
            "| wall s | peak RSS MiB (baseline) | tracemalloc peak MiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        res = r["report"]["results"][-1]
        all_int8 = next((s["score"] for s in r["report"]["search"] if s.get("step") == "all int8"), None)
        kept = ", ".join(n.replace("/model/encoder/", "").removesuffix("/MatMul") for n in res["float_nodes"]) or "-"
        ints = f"{res['int8_nodes']}/{res['candidates']}" if res["candidates"] else "-"
        label = name + (f" ({r['error']})" if r["error"] else "")
        out.append(f"| {label} | {res['score']:.5f} | {res['min_cosine']:.5f} | {res['max_abs_error']:.3g} | {ints} "
                   f"| {kept} | {'-' if all_int8 is None else f'{all_int8:.5f}'} | {r['seconds']:.1f} "
                   f"| {r['peak_rss_kib'] / 1024:.0f} ({r['baseline_rss_kib'] / 1024:.0f}) "
                   f"| {r['tracemalloc_peak'] * mib:.0f} |")
    if ort_int8:
        out += ["", f"INT8 (minmax, mixed precision) run on ORT's own int8 CPU kernels instead of simulated Q/DQ: "
                    f"mean cos {ort_int8['mean']:.5f}, min {ort_int8['min']:.5f}, max abs {ort_int8['max_abs']:.3g}."]
    if engines:
        out += ["", "### TensorRT plans (ahead-of-time build on this CPU machine)", "",
                "| precision | flavour | plan MiB | build s |", "|---|---|---|---|"]
        for p, e in engines.items():
            out.append(f"| {p} | {e['flavour']} {e['version']} | {e['size'] * mib:.1f} | {e['seconds']:.1f} |")
    out += ["", "### Reading", ""] + env["notes"] + ["", END]
    return "\n".join(out)


def write_section(path: Path, section: str) -> None:
    """Replace this benchmark's section of RESULTS.md; other sections stay as they are."""
    results_file.write_section(path, START, END, section)


def notes(env: dict[str, Any], speed: dict[str, Any], runs: dict[str, Any], ort_int8: dict[str, float]) -> list[str]:
    f = env["cpu"]["flags"]
    n = []
    vnni = f["avx512_vnni"] or f["avx_vnni"]
    n.append(f"- INT8 on ORT CPU: {speed['int8']['seq_per_s'] / speed['fp32']['seq_per_s']:.2f}x FP32 throughput. "
             + ("This CPU has VNNI, so ORT's int8 GEMMs use it." if vnni else
                "This CPU has no VNNI: ORT's int8 GEMMs use AVX2 u8s8 arithmetic, whose 16-bit intermediate sums can "
                "saturate; the quantize stage therefore scores INT8 with Q/DQ simulated in float, which is what "
                "TensorRT's int8 GEMMs compute."))
    n.append(f"- FP16 on ORT CPU: {speed['fp16']['seq_per_s'] / speed['fp32']['seq_per_s']:.2f}x FP32 throughput "
             "(ORT's CPU provider has few fp16 kernels and inserts casts; FP16 is for the GPU engine, and its "
             "accuracy is what this table checks).")
    if ort_int8:
        n.append(f"- The same INT8 model scored on ORT's int8 kernels: mean cos {ort_int8['mean']:.5f} "
                 "(vs the simulated score in the table): the difference is the CPU kernels, not the quantization.")
    n.append("- Histogram methods (percentile, entropy) stream per-tensor histograms over two passes, so memory "
             "stays near the baseline; docs/environment.md measured onnxruntime.quantization's histogram calibrators "
             "at ~17 s and 4.3 GB for 100 sentences.")
    n.append("- Mixed precision keeps the most harmful MatMuls in float until the search set scores >= 0.992 "
             "(the 0.99 gate plus a margin), then returns any it does not need to INT8.")
    return n


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=20, help="timed runs per precision")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--methods", default="minmax,percentile,entropy", help="calibration methods to run")
    ap.add_argument("--quick", action="store_true", help="5 repeats, minmax only, RESULTS.md untouched")
    ap.add_argument("--no-engines", action="store_true", help="skip the TensorRT plan builds")
    ap.add_argument("--results", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    ap.add_argument("--no-write", action="store_true", help="print only, do not update RESULTS.md")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.methods, args.no_write = 5, "minmax", True
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import onnxruntime

    from model_factory.build_engines.export import export_model
    from model_factory.build_engines.quantize import load_export

    env = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_info(), "python": platform.python_version(),
           "ort": onnxruntime.__version__, "repeats": args.repeats, "load_before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="bench-precision-") as tmp_s:
        root = Path(tmp_s)
        print("exporting MiniLM", file=sys.stderr)
        export = export_model(recipe_for(root / "export", ["fp32"], "minmax"))
        export_dir = export.onnx_path.parent
        runs: dict[str, dict[str, Any]] = {}
        print("fp16", file=sys.stderr)
        runs["fp16"] = quantize_run(root / "fp16", export_dir, ["fp32", "fp16"], "minmax")
        for method in args.methods.split(","):
            print(f"int8 {method}", file=sys.stderr)
            runs[f"int8 {method}"] = quantize_run(root / f"int8-{method}", export_dir, ["fp32", "int8"], method)
        int8_run = runs["int8 minmax"] if "int8 minmax" in runs else next(r for k, r in runs.items() if k != "fp16")
        models = {"fp32": export.onnx_path, "fp16": Path(runs["fp16"]["models"]["fp16"]),
                  "int8": Path(int8_run["models"]["int8"])}
        sizes = {p: m.stat().st_size for p, m in models.items()}
        feeds = long_batch(export.tokenizer_dir)
        speed = {}
        for p, m in models.items():
            print(f"timing {p}", file=sys.stderr)
            speed[p] = time_session(m, feeds, args.repeats, args.warmup)
        recipe = recipe_for(root / "int8-minmax", ["fp32", "int8"], "minmax")
        ort_int8 = ort_kernel_accuracy(models["int8"], recipe, load_export(recipe)) if "int8 minmax" in runs else {}
        engines: dict[str, dict[str, Any]] = {}
        if not args.no_engines:
            from model_factory.build_engines.tensorrt import build_engines, tensorrt_available

            if tensorrt_available():
                print("building TensorRT plans", file=sys.stderr)
                for e in build_engines(recipe_for(root / "engines", ["fp32", "fp16", "int8"], "minmax"), models):
                    meta = json.loads(e.metadata_path.read_text())
                    engines[e.precision] = {"flavour": meta["flavour"], "version": meta["version"],
                                            "size": e.size_bytes, "seconds": e.build_seconds}
        env["load_after"] = os.getloadavg()[0]
        env["notes"] = notes(env, speed, runs, ort_int8)
        section = render(env, runs, speed, sizes, engines, ort_int8)
    print(section)
    if not args.no_write:
        write_section(args.results, section)
        print(f"wrote {args.results}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
