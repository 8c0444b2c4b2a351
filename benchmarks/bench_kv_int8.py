"""The KV cache in INT8 against float: one graph's decode steps and prefill, each cache, side by side.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_kv_int8.py [--work DIR] [--write]

The 110M Llama of bench_generate (SmolLM-135M's shape, random weights; made here or reused from ``--work``) is
built by the factory at INT8 dynamic twice: ``quantization.kv_cache = "float"`` and ``"int8"``
(build_engines/kv_int8.py). Both graphs run on the backend's own runtime (``CausalLM`` on ``KVSlots``, 2 threads):
a decode step of 32 rows at 64, 192 and 512 cached tokens (every slot filled with values first: a fresh
``np.zeros`` buffer maps the shared zero page and would read as fast as cache), and a prefill of 8 x 128 tokens.
Rounds alternate the two graphs; medians and ranges, the ratio taken per round. The section between
``<!-- kv_int8:start -->`` and ``<!-- kv_int8:end -->`` is replaced.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from results_file import publish, say  # noqa: E402
from benchmarks.harness.scheduler_run import llama_folder  # noqa: E402

START, END = "<!-- kv_int8:start -->", "<!-- kv_int8:end -->"
ROWS, CONTEXTS, PREFILL = 32, (64, 192, 512), (8, 128)


def runner(version_dir: Path, precision: str):
    """(CausalLM, KVSlots with every slot filled) for ``precision``'s graph in ``version_dir``."""
    from model_factory.backend.generation.causal_lm import CausalLM
    from model_factory.backend.contract import Files, GenerationSpec, onnx_file
    from model_factory.backend.generation.kv_slots import KVSlots

    spec = GenerationSpec.from_json((version_dir / Files.GENERATION).read_text()).for_precision(precision)
    lm = CausalLM(version_dir / onnx_file(precision), threads=2)
    slots = KVSlots(spec, ROWS, 8 << 30, max_context=1024)
    rng = np.random.default_rng(0)
    for buf in slots.buffers.values():
        if buf.dtype == np.int8:
            buf[...] = rng.integers(-60, 60, buf.shape, dtype=np.int8)
        else:
            buf[...] = rng.standard_normal(buf.shape, np.float32).astype(buf.dtype) * 0.1
    return lm, slots, spec.kv_dtype


def timings(lm, slots) -> dict[str, float]:
    """Seconds: a decode step of ROWS rows at each cached length (median of 5), a prefill of PREFILL."""
    out = {}
    views = slots.views(0, ROWS)
    for length in CONTEXTS:
        lm.decode([5] * ROWS, [length] * ROWS, views)  # its binding made
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            lm.decode([5] * ROWS, [length] * ROWS, views)
            ts.append(time.perf_counter() - t)
        out[f"decode {ROWS} rows @ {length}"] = statistics.median(ts)
    n, length = PREFILL
    t = time.perf_counter()
    lm.prefill([[7] * length] * n, slots.views(0, n))
    out[f"prefill {n} x {length}"] = time.perf_counter() - t
    return out


def main() -> int:
    from benchmarks.harness.run_header import LoadReading, run_header
    from tests.generative_repository import layout_generative_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    hf = llama_folder(args.work, "bench-kv-int8-")
    repo = Path(tempfile.mkdtemp(prefix="bench-kv-int8-repo-"))
    dirs = {kv: layout_generative_model(hf, None, repo, f"llm_{kv}", precision="int8",
                                        quantization='int8_method = "dynamic"' + (
                                            '\nkv_cache = "int8"' if kv == "int8" else ""))
            for kv in ("float", "int8")}
    load = LoadReading.begin()
    runs: dict[str, list[dict[str, float]]] = {"float": [], "int8": []}
    for r in range(args.rounds):
        for kv in (("float", "int8") if r % 2 == 0 else ("int8", "float")):
            lm, slots, dtype = runner(dirs[kv], "int8")
            got = timings(lm, slots)
            runs[kv].append(got)
            say(f"round {r + 1} cache {dtype}: " + ", ".join(f"{k} {1000 * v:.1f} ms" for k, v in got.items()))
            lm.close()
            del slots
    load = load.finish()
    rows = []
    for key in runs["float"][0]:
        f = [run[key] for run in runs["float"]]
        q = [run[key] for run in runs["int8"]]
        ratio = [a / b for a, b in zip(f, q)]

        def ms(v):
            return f"{1000 * statistics.median(v):.1f} ({1000 * min(v):.1f}–{1000 * max(v):.1f})"

        rows.append(f"| {key} | {ms(f)} | {ms(q)} | {statistics.median(ratio):.2f} ({min(ratio):.2f}–{max(ratio):.2f})x |")
    section = "\n".join([
        START, "## KV cache in INT8: decode steps and prefill of one graph, each cache (benchmarks/bench_kv_int8.py)",
        "", run_header("benchmarks/bench_kv_int8.py", load), "",
        "The 110M Llama of bench_generate (random weights), built by the factory at INT8 dynamic with "
        "`quantization.kv_cache = \"float\"` and `\"int8\"`; the backend's runtime (`CausalLM` on `KVSlots`, 2 "
        f"threads, every slot filled with values first); {args.rounds} rounds alternating the two graphs, each cell "
        "a median of 5 steps (a prefill: one); medians over the rounds, the range in brackets, the speed-up taken "
        "per round (float's time / INT8's: above 1, the INT8 cache is faster).", "",
        "| step | float cache (ms) | INT8 cache (ms) | speed-up |", "| --- | ---: | ---: | ---: |", *rows, "", END])
    publish(section, HERE / "RESULTS.md", START, END, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
