"""A 1B-parameter causal LM through ``model-factory build``: time and peak memory, FP32 + INT4 (awq).

The folder (TinyLlama's shape: hidden 2048, 22 layers, 32 heads, 4 kv heads, intermediate 5632; a 16k BPE
vocabulary trained here; random weights) is made once, then built in a child process whose process tree's RSS
is sampled every 50 ms (``bench_large_models.build``). FP16 is not built: the exporter's CPU FP16 graph is not the
shared-slot engine (docs/models.md).

    python benchmarks/bench_generative_large.py [--write] [--work DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
START, END = "<!-- bench_generative_large:start -->", "<!-- bench_generative_large:end -->"
SHAPE = dict(hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632, vocab_size=16384, max_positions=2048)


def main() -> None:
    from benchmarks.bench_large_models import build, keygen
    from benchmarks.harness.run_header import LoadReading, run_header
    from benchmarks.results_file import publish, say
    from generative_models import make_causal_lm

    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    load = LoadReading.begin()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-gen-large-"))
    src = work / "llama-1b"
    if not (src / "config.json").is_file():
        say("making the 1B folder (random weights)")
        make_causal_lm("llama", src, **SHAPE)
    params = sum(p.stat().st_size for p in src.glob("*.safetensors")) // 4
    for f in ("calibration.txt", "heldout.txt"):
        (work / f).write_text((ROOT / "model_factory" / "examples" / f).read_text())
    recipe = work / "llama-1b.toml"
    recipe.write_text('precisions = ["fp32", "int4"]\n[model]\nname = "llama-1b"\ntask = "text-generation"\n'
                      '[source]\nkind = "huggingface"\npath = "llama-1b"\n[shapes]\nmax_context = 1024\n'
                      '[quantization]\ncalibration_data = "calibration.txt"\nheldout_data = "heldout.txt"\n'
                      'max_heldout_samples = 16\nmax_calibration_samples = 16\nmin_token_agreement = 0.05\n'
                      'max_perplexity_ratio = 2.0\n[repository]\npath = "repo"\nserve = "int4"\nkeep_all_precisions = true\n')
    key = keygen(work / "keys")
    say("building")
    run = build(recipe, key, "this branch", None, "1B", params)
    load = load.finish()
    per = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in run.stage_peaks.items())
    lines = [START, "## A 1B-parameter causal LM: build time and peak memory (benchmarks/bench_generative_large.py)", "",
             run_header("benchmarks/bench_generative_large.py", load), "",
             f"Llama, TinyLlama's shape with a 16k vocabulary ({params / 1e9:.2f}B parameters, FP32 safetensors, random "
             "weights); `model-factory build` (stages in child processes): export with the model builder and the "
             "transformers check (4 prompts x 64 greedy tokens), INT4 awq (16 calibration lines) and its gate (16 "
             "held-out lines; thresholds relaxed: random weights), package, sign. FP16 is not built on the CPU.", "",
             "| model | parameters | build (s) | peak RSS (GiB) | bytes / parameter | peak during | rc |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: |",
             f"| Llama 1B | {params / 1e9:.2f}B | {run.seconds:.0f} | {run.peak_rss / 2**30:.2f} | "
             f"{run.bytes_per_param:.1f} | {run.peak_stage} | {run.rc} |", "", f"Peak RSS per stage (GiB): {per}.",
             END]
    if run.rc != 0:
        say(run.tail)
    publish("\n".join(lines), ROOT / "benchmarks" / "RESULTS.md", START, END, args.write)


if __name__ == "__main__":
    main()
