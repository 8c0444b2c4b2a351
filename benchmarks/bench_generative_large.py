"""A 1B-parameter causal LM through ``model-factory build``: time and peak memory, FP32 + FP16 + INT4 (awq).

The folder (TinyLlama's shape with one layer more, so past 1B: hidden 2048, 23 layers, 32 heads, 4 kv heads,
intermediate 5632; a 16k BPE vocabulary trained here; random weights) is made once, then built in a child
process whose process tree's memory is sampled every 50 ms (``bench_large_models.build``: VmRSS, which counts a
mapped safetensors file once per mapping, and RssAnon, the memory the build holds itself); the build's output
goes to ``<work>/build.log``. FP16 is the builder's FP16 graph (its CUDA graph: the shared-slot I/O), gated on the
CPU like INT4; ``--part fp16`` exports that graph alone and measures the export.

    python benchmarks/bench_generative_large.py [--write] [--work DIR] [--part all|build|fp16]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
START, END = "<!-- bench_generative_large:start -->", "<!-- bench_generative_large:end -->"
# Where each stage's private memory goes (read from RssAnon per process every 3 s during the runs of 2026-12-02;
# the reasons from the code): docs/models.md says the same.
WHERE = ("Where the private memory goes, step by step (a 3-second watch of each stage's RssAnon beside this run): "
         "export: the builder maps the safetensors and writes the FP32 graph tensor by tensor (0.8 GiB), "
         "transformers' reference runs on the mapped weights (0.8 GiB), and the check of the graph loads it into "
         "ONNX Runtime, which copies the external data into its own buffers (4.7 GiB: 4 bytes per parameter, the "
         "export's peak). quantize: the FP32 scorer is the same session (4.0 GiB, freed before awq); awq scales the "
         "mapped weights in place, so their pages turn private layer by layer (4.0 GiB at the end, freed once the "
         "scaled folder is saved); the INT4 builder serializes its whole FP32 model into one ModelProto "
         "(`ir.to_proto`, 4 bytes per parameter) before ONNX Runtime's MatMulNBitsQuantizer reads it, plus the "
         "quantized tensors (5.4 GiB in the run of 2026-12-02 15:31): the build's peak. Streaming that quantization (one MatMul weight at a time from the FP32 "
         "graph's data file) would bring the peak down to the export's; not done. Each builder run is now collected "
         "as it ends: before, the gate's second INT4 run (its ladder) started with the first one's 6 GiB still "
         "held (10.3 GiB private, in a run stopped at that point).")
FP16_START, FP16_END = "<!-- bench_generative_large:fp16:start -->", "<!-- bench_generative_large:fp16:end -->"
FP16_CHILD = """
import os, sys
os.environ["HF_HUB_OFFLINE"] = "1"
from onnxruntime_genai.models import builder
src, out, cache = sys.argv[1:4]
opts = builder.parse_extra_options(None, src, out, "fp16", "cuda", cache, ["hf_token=false"])
builder.create_model(None, src, out, "fp16", "cuda", cache, **opts)
"""
SHAPE = dict(hidden=2048, layers=23, heads=32, kv_heads=4, intermediate=5632, vocab_size=16384, max_positions=2048)


def fp16_graph(src: Path, out: Path, log: Path) -> dict:
    """The model builder's FP16 graph for the GPU (``-p fp16 -e cuda``) in a child: time, peak memory, size, I/O.

    The export alone (the build, measured apart, gates and packages it). Its I/O is compared with the shared-slot
    contract the CPU FP32 graph has.
    """
    import shutil
    import subprocess
    import time

    import onnx

    from benchmarks.bench_large_models import tree_memory
    from model_factory.backend.contract import ATTENTION_MASK, INPUT_IDS, LOGITS, past_name, present_name

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-c", FP16_CHILD, str(src), str(out), str(out.parent / ".fp16-cache")],
                                stdout=sink, stderr=subprocess.STDOUT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        peak = peak_anon = 0
        while proc.poll() is None:
            rss, anon = tree_memory(proc.pid)
            peak, peak_anon = max(peak, rss), max(peak_anon, anon)
            time.sleep(0.05)
    seconds = time.perf_counter() - t0
    row = {"rc": proc.returncode, "seconds": seconds, "peak_rss": peak, "peak_anon": peak_anon,
           "bytes": sum(p.stat().st_size for p in out.glob("model.onnx*")) if out.is_dir() else 0}
    if proc.returncode == 0:
        m = onnx.load(str(out / "model.onnx"), load_external_data=False)
        layers = sum(1 for i in m.graph.input if i.name.startswith("past_key_values.") and i.name.endswith(".key"))
        want_in = {INPUT_IDS, ATTENTION_MASK} | {past_name(i, k) for i in range(layers) for k in ("key", "value")}
        want_out = {LOGITS} | {present_name(i, k) for i in range(layers) for k in ("key", "value")}
        kv = {i.type.tensor_type.elem_type for i in m.graph.input if i.name.startswith("past_key_values.")}
        row.update(layers=layers, shared_slot_io={i.name for i in m.graph.input} == want_in and
                   {o.name for o in m.graph.output} == want_out, kv_fp16=kv == {onnx.TensorProto.FLOAT16},
                   ops=sorted({n.op_type for n in m.graph.node}))
    return row


def gate_line(work: Path) -> str:
    """The gate's figures per precision, from the build's accuracy.json (empty when the build wrote none)."""
    import json

    found = sorted(work.glob("repo/llama-1b/*/accuracy.json"))
    if not found:
        return ""
    rows = json.loads(found[-1].read_text())["results"]
    return " Gate figures: " + "; ".join(
        f"{r['precision']} agreement {r['score']:.3f}, perplexity ratio {r['perplexity_ratio']:.4f}, max logits error "
        f"{r['max_abs_error']:.3g}, weights {r['weights_bytes'] / 2**30:.2f} GiB" for r in rows) + "."


def fp16_section(row: dict, params: int, header: str) -> str:
    ok = row["rc"] == 0
    lines = [FP16_START, "## The 1B causal LM's FP16 graph for the GPU: export time and peak memory "
             "(benchmarks/bench_generative_large.py --part fp16)", "", header, "",
             "onnxruntime-genai's model builder, `-p fp16 -e cuda`, on the same folder, in a child process whose "
             "tree's memory is sampled every 50 ms: the export alone, as the factory's FP16 precision runs it (the build "
             "below gates and packages it; `generation.json` names its KV cache `float16`). The CPU FP16 graph "
             "(`-e cpu`) takes position ids and grows its cache by concatenation; this CUDA one has the shared-slot "
             "I/O.", "",
             "| graph | parameters | export (s) | graph + data (GiB) | peak RSS (GiB) | peak private (GiB) | "
             "private bytes / parameter | shared-slot I/O | KV dtype | rc |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |",
             f"| builder fp16 cuda | {params / 1e9:.2f}B | {row['seconds']:.0f} | {row['bytes'] / 2**30:.2f} | "
             f"{row['peak_rss'] / 2**30:.2f} | {row['peak_anon'] / 2**30:.2f} | {row['peak_anon'] / params:.1f} | "
             f"{('yes' if row.get('shared_slot_io') else 'no') if ok else '-'} | "
             f"{('float16' if row.get('kv_fp16') else 'other') if ok else '-'} | {row['rc']} |"]
    if ok:
        lines += ["", f"Operators: {', '.join(row['ops'])}."]
    return "\n".join(lines + [FP16_END])


def main() -> None:
    from benchmarks.bench_large_models import build, keygen
    from benchmarks.harness.run_header import LoadReading, run_header
    from benchmarks.results_file import publish, say
    from generative_models import make_causal_lm

    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--part", choices=("all", "build", "fp16"), default="all",
                    help="build: FP32 + FP16 + INT4 through model-factory build; fp16: the builder's FP16 graph alone")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    load = LoadReading.begin()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-gen-large-"))
    src = work / "llama-1b"
    if not (src / "config.json").is_file():
        say("making the 1B folder (random weights)")
        make_causal_lm("llama", src, **SHAPE)
    params = sum(p.stat().st_size for p in src.glob("*.safetensors")) // 4
    if args.part in ("all", "fp16"):
        say("exporting the FP16 graph for the GPU")
        fp16_load = LoadReading.begin()
        row = fp16_graph(src, work / "fp16-cuda", work / "fp16.log")
        publish(fp16_section(row, params, run_header("benchmarks/bench_generative_large.py --part fp16",
                                                     fp16_load.finish())),
                ROOT / "benchmarks" / "RESULTS.md", FP16_START, FP16_END, args.write)
        if args.part == "fp16":
            return
    for f in ("calibration.txt", "heldout.txt"):
        (work / f).write_text((ROOT / "model_factory" / "examples" / f).read_text())
    recipe = work / "llama-1b.toml"
    recipe.write_text('precisions = ["fp32", "fp16", "int4"]\n[model]\nname = "llama-1b"\ntask = "text-generation"\n'
                      '[source]\nkind = "huggingface"\npath = "llama-1b"\n[shapes]\nmax_context = 1024\n'
                      # Random weights (std 0.1) make large logits: 1e-3 (the default) is below what FP32
                      # kernels differ by on 23 layers (0.0012 measured on a Xeon with AVX-512, 2026-12-04).
                      '[export]\ntolerance = 0.01\n'
                      '[quantization]\ncalibration_data = "calibration.txt"\nheldout_data = "heldout.txt"\n'
                      'max_heldout_samples = 16\nmax_calibration_samples = 16\nmin_token_agreement = 0.001\n'
                      'max_perplexity_ratio = 2.0\n[repository]\npath = "repo"\nserve = "int4"\nkeep_all_precisions = true\n')
    key = work / "keys" / "signing-key.pem"
    if not key.is_file():  # keygen never overwrites a key: a second run in the same --work reuses it
        key = keygen(work / "keys")
    say("building")
    run = build(recipe, key, "this branch", None, "1B", params, log=work / "build.log")
    load = load.finish()
    per = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in run.stage_peaks.items())
    per_anon = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in run.anon_stage_peaks.items())
    lines = [START, "## A 1B-parameter causal LM: build time and peak memory (benchmarks/bench_generative_large.py)", "",
             run_header("benchmarks/bench_generative_large.py", load), "",
             f"Llama, TinyLlama's shape with a 16k vocabulary and 23 layers ({params / 1e9:.2f}B parameters, FP32 safetensors, random "
             "weights); `model-factory build` (stages in child processes): export with the model builder and the "
             "transformers check (4 prompts x 64 greedy tokens; logits within export.tolerance 0.01: the random weights' "
             "logits are large), FP16 (the builder's FP16 graph) and INT4 awq (16 "
             "calibration lines), each with its gate on the CPU (16 held-out lines; gate relaxed to agreement >= "
             "0.001 and perplexity ratio <= 2: random weights's greedy continuations are chaotic, INT4 agreed on 0.5 % "
             "of them in an earlier run), package, sign." + gate_line(work), "",
             "| model | parameters | build (s) | peak RSS (GiB) | bytes / parameter | peak during | peak private "
             "(RssAnon, GiB) | private bytes / parameter | rc |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
             f"| Llama 1B | {params / 1e9:.2f}B | {run.seconds:.0f} | {run.peak_rss / 2**30:.2f} | "
             f"{run.bytes_per_param:.1f} | {run.peak_stage} | {run.peak_anon / 2**30:.2f} | "
             f"{run.peak_anon / params:.1f} | {run.rc} |", "",
             "Peak RSS sums VmRSS over the build's process tree: file-backed pages count once per mapping (the "
             "source's safetensors, mapped by transformers and by the builder, counts twice), and the kernel may "
             "drop them under pressure. Private memory (RssAnon) is what the build holds itself.", "",
             f"Peak RSS per stage (GiB): {per}.", "", f"Peak private memory per stage (GiB): {per_anon}.", "",
             WHERE,
             END]
    if run.rc != 0:
        say(run.tail)
    publish("\n".join(lines), ROOT / "benchmarks" / "RESULTS.md", START, END, args.write)


if __name__ == "__main__":
    main()
