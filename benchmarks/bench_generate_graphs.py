"""Decode speed of our text-generation graphs (FP32 / FP16 / INT8 / INT4) against transformers and ORT GenAI's generator.

One run, side by side, on a 116M-parameter Llama (SmolLM-135M's shape: hidden 576, 30 layers, 9 heads, 3 kv heads,
intermediate 1536; random weights, a 16k BPE vocabulary trained here): 128-token prompts, 64 new tokens, greedy,
batch 1 and 8, two threads, 5 rounds interleaving the engines. Decode tokens/s counts the new tokens after the first
(prefill is timed apart).

* ours: the packaged graph (onnxruntime-genai's builder output, the contract's shared-slot I/O) run by the
  backend's engine (``causal_lm.CausalLM``, ONNX Runtime I/O binding kept per KV slice): each row prefilled
  into its own slot of one [batch, kv, context, head_dim] buffer per layer, then all rows decoded together,
  written in place (no per-token copy);
* ORT GenAI: the same folder through ``onnxruntime_genai.Generator`` (its own C++ loop);
* transformers: ``LlamaForCausalLM`` FP32 with its dynamic cache, one forward per token;
* optimum: ``ORTModelForCausalLM`` FP32 on optimum-onnx's export of the folder (``text-generation-with-past``),
  in its own venv (``--optimum-python``; ``benchmarks/optimum_peer.py``; ``benchmarks/install_peers.sh optimum``),
  left out when that venv is absent.

    python benchmarks/bench_generate_graphs.py [--write] [--optimum-python /work/peers/optimum/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
START, END = "<!-- bench_generate_graphs:start -->", "<!-- bench_generate_graphs:end -->"
PROMPT, NEW, THREADS = 128, 64, 2
SHAPE = dict(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab_size=16384, max_positions=2048,
             tie=True)


def prompts(tok, batch: int) -> list[list[int]]:
    text = (ROOT / "benchmarks" / "texts.txt").read_text().split()
    out = []
    for b in range(batch):
        ids = tok(" ".join(text[b * 40:]), add_special_tokens=False)["input_ids"][:PROMPT]
        out.append(ids)
    return out


def ours(graph: Path, head_dim: int, rows: list[list[int]]) -> tuple[float, float]:
    """(prefill seconds, decode tokens/s) through the backend's own engine (``causal_lm.CausalLM``, the class a
    served model runs): each row prefilled into its own slot of one [batch, kv, context, head_dim] buffer per
    layer, then all rows decoded together, written in place, with the engine's kept I/O binding per slice."""
    from model_factory.backend.generation.causal_lm import CausalLM
    from model_factory.backend.contract import past_name

    model = _ENGINES.get(graph)
    if model is None:
        model = _ENGINES[graph] = CausalLM(graph, threads=THREADS)
    sess = model.session
    pasts = [i for i in sess.get_inputs() if i.name.startswith("past_key_values") and i.name.endswith(".key")]
    layers, kv = len(pasts), int(pasts[0].shape[1])
    dtype = np.float16 if "float16" in pasts[0].type else np.float32  # the FP16 graph's cache is FP16
    b, ctx = len(rows), PROMPT + NEW + 1
    cache = {past_name(i, k): np.zeros((b, kv, ctx, head_dim), dtype) for i in range(layers)
             for k in ("key", "value")}
    views = {r: {n: buf[r:r + 1] for n, buf in cache.items()} for r in range(b)}  # one object per slice, as
    together = {n: buf[0:b] for n, buf in cache.items()}  # KVSlots.views returns: the engine keeps its binding

    t0 = time.perf_counter()
    nxt = [int(model.prefill([p], views[r])[0].argmax()) for r, p in enumerate(rows)]
    prefill = time.perf_counter() - t0
    lens = [len(p) for p in rows]
    t0 = time.perf_counter()
    for _ in range(NEW - 1):
        lg = model.decode(nxt, lens, together)
        nxt = [int(lg[r].argmax()) for r in range(b)]
        lens = [x + 1 for x in lens]
    return prefill, b * (NEW - 1) / (time.perf_counter() - t0)


_ENGINES: dict[Path, object] = {}


def genai(folder: Path, rows: list[list[int]]) -> tuple[float, float]:
    import onnxruntime_genai as og

    model = _ENGINES.get(folder)
    if model is None:  # loaded once per graph, as ours: each round times a warm model
        config = og.Config(str(folder))
        config.clear_providers()
        model = _ENGINES[folder] = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=PROMPT + NEW, min_length=PROMPT + NEW, do_sample=False,
                              batch_size=len(rows))
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(np.array(rows, np.int32))
    gen.generate_next_token()
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(NEW - 1):
        gen.generate_next_token()
    return prefill, len(rows) * (NEW - 1) / (time.perf_counter() - t0)


def hf(folder: Path, rows: list[list[int]]) -> tuple[float, float]:
    import torch
    import transformers

    torch.set_num_threads(THREADS)
    model = _ENGINES.get(folder)
    if model is None:
        model = _ENGINES[folder] = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        model.eval()
    with torch.no_grad():
        ids = torch.tensor(rows)
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        prefill = time.perf_counter() - t0
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(NEW - 1):
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return prefill, len(rows) * (NEW - 1) / (time.perf_counter() - t0)


class OptimumPeer:
    """``benchmarks/optimum_peer.py`` in optimum's venv, loaded once, timed per call like the others."""

    def __init__(self, python: str, folder: Path, export: Path) -> None:
        import subprocess

        self.proc = subprocess.Popen([python, str(ROOT / "benchmarks" / "optimum_peer.py"), "--folder", str(folder),
                                      "--export", str(export), "--threads", str(THREADS)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"optimum's peer did not start (exit {self.proc.wait()})")
        self.onnxruntime = json.loads(ready)["onnxruntime"]

    def __call__(self, rows: list[list[int]]) -> tuple[float, float]:
        self.proc.stdin.write(json.dumps({"rows": rows, "new": NEW}) + "\n")
        self.proc.stdin.flush()
        got = json.loads(self.proc.stdout.readline())
        return got["prefill"], got["tps"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    from benchmarks.harness.run_header import LoadReading, run_header
    from benchmarks.results_file import publish, say
    from generative_models import make_causal_lm

    from model_factory.build_engines.causal_lm import run_builder
    from model_factory.build_engines.lm_quantize import _builder_options, dynamic_int8, weights_bytes
    from model_factory.build_engines.logits_positions import select_logits_positions

    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--optimum-python", default="/work/peers/optimum/bin/python",
                    help="python of a venv with optimum-onnx[onnxruntime] (left out when absent)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    load = LoadReading.begin()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-gen-"))
    src = work / "llama-116m"
    if not (src / "config.json").is_file():
        say("making the 116M Llama folder")
        make_causal_lm("llama", src, **SHAPE)
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(src))
    graphs, packaged = {}, {}
    for p in ("fp32", "int8", "int4"):
        out = work / f"graph-{p}"
        if not (out / "model.onnx").is_file():
            say(f"building {p}")
            # The builder with the factory's own options (INT4: block 32, accuracy_level 4, RTN; INT8: 8-bit
            # MatMulNBits with float activations, the factory's weight_only method and ORT GenAI's INT8). ORT GenAI
            # runs the builder's graph as written; ours is the same graph as the factory packages it (the LM head
            # at the asked positions only: a graph input ORT GenAI does not know).
            run_builder(src, out, p, _builder_options(p, "rtn", 32, ()) if p != "fp32" else None,
                        select_positions=False)
        graphs[p] = out
        packaged[p] = work / f"graph-{p}-packaged"
        if not (packaged[p] / "model.onnx").is_file():
            shutil.rmtree(packaged[p], ignore_errors=True)
            shutil.copytree(out, packaged[p])
            select_logits_positions(packaged[p] / "model.onnx")
    # FP16: the builder's FP16 graph as the factory builds it (its CUDA graph: the shared-slot I/O, FP16 caches).
    fp16 = work / "graph-fp16-packaged"
    if not (fp16 / "model.onnx").is_file():
        say("building fp16")
        run_builder(src, fp16, "fp16", select_positions=True)
    # INT4 with block 128 (the recipe's int4_block_size = 128): the same builder, otherwise as the factory's INT4.
    b128 = work / "graph-int4-block128-packaged"
    if not (b128 / "model.onnx").is_file():
        say("building int4 block 128")
        run_builder(src, b128, "int4", _builder_options("int4", "rtn", 128, ()), select_positions=True)
    dynamic = work / "graph-int8-dynamic"
    if not (dynamic / "model.onnx").is_file():
        say("building int8 (dynamic)")
        dynamic_int8(packaged["fp32"] / "model.onnx", dynamic)  # the factory's INT8 dynamic method
    ours_graphs = {"FP32": packaged["fp32"], "FP16": fp16, "INT8": dynamic, "INT8 weight-only": packaged["int8"],
                   "INT4": packaged["int4"], "INT4 block 128": b128}
    head_dim = SHAPE["hidden"] // SHAPE["heads"]
    n_params = sum(np.prod(t.shape) for t in __import__("safetensors.torch", fromlist=["load_file"])
                   .load_file(str(src / "model.safetensors")).values())
    engines = [("transformers FP32", lambda r: hf(src, r))] + [
        (f"ours {p}", (lambda r, p=p: ours(ours_graphs[p] / "model.onnx", head_dim, r))) for p in ours_graphs] + [
        (f"ORT GenAI {p.upper()}", (lambda r, p=p: genai(graphs[p], r))) for p in graphs]
    optimum = None
    if Path(args.optimum_python).is_file():
        say("optimum: exporting (once) and loading ORTModelForCausalLM")
        optimum = OptimumPeer(args.optimum_python, src, work / "optimum-fp32")
        engines.insert(1, ("optimum ORTModelForCausalLM FP32", optimum))
    else:
        say(f"optimum: {args.optimum_python} not found, left out")
    # Rounds interleave the engines (every engine once per round), so a drift of the machine's speed touches them
    # all alike; a ratio is taken within each round, then its median and range over the rounds.
    runs: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for batch in (1, 8):
        rows = prompts(tok, batch)
        for name, fn in engines:
            fn(prompts(tok, 1))  # warm-up (pages of the weights, allocations)
        for r in range(args.rounds):
            for name, fn in engines:
                say(f"{name} batch {batch} round {r + 1}")
                runs.setdefault((name, batch), []).append(fn(rows))

    def spread(values: list[float], fmt: str) -> str:
        return f"{np.median(values):{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})"

    def ratio(a: str, b: str, batch: int) -> str:
        per_round = [x[1] / y[1] for x, y in zip(runs[(a, batch)], runs[(b, batch)])]
        return spread(per_round, ".2f") + "x"

    load = load.finish()
    lines = [START, "## Text-generation graphs: decode tokens/s (benchmarks/bench_generate_graphs.py)", "",
             run_header("benchmarks/bench_generate_graphs.py", load), "",
             f"A {n_params / 1e6:.0f}M-parameter Llama (SmolLM-135M shape, random weights, tied embeddings), "
             f"{PROMPT}-token prompts, {NEW} new tokens, greedy, {THREADS} threads. Decode tokens/s: new tokens after "
             "the first, all rows together. Graph weights: " + ", ".join(
                 f"{p} {weights_bytes(g / 'model.onnx') / 2**20:.0f} MiB" for p, g in ours_graphs.items()) + ". "
             "Ours INT8 is the factory's `dynamic` method (7-bit weights per channel, activations quantized per "
             "tensor at run time, MatMulIntegerToFloat); INT8 weight-only and ORT GenAI's INT8 are the builder's "
             "8-bit MatMulNBits with float activations. Ours INT4 is the factory's default (block 32, round to "
             "nearest here, accuracy_level 4); ours INT4 block 128 the same with the recipe's int4_block_size = 128. "
             "Ours FP16 is the builder's FP16 graph the factory builds for the GPU (FP16 weights and KV cache), run "
             "here on ONNX Runtime's CPU provider. "
             "Ours are the graphs as the factory packages them (the LM "
             "head at each row's last position only); ORT GenAI runs the builder's graphs as written"
             + (f"; optimum: `ORTModelForCausalLM` on optimum-onnx's `text-generation-with-past` export of the "
                f"folder, its own venv (ONNX Runtime {optimum.onnxruntime}), one forward per token with the cache "
                "concatenated" if optimum is not None else "") + ".", "",
             f"Every engine is loaded once and warmed up, then timed in each of {args.rounds} rounds (ours: the "
             "backend's `CausalLM`, its I/O binding kept per KV slice). Median of the rounds, the range in brackets; "
             "ratios per round, then their median.", "",
             "| engine | batch | prefill (s) | decode tokens/s | vs ours FP32 (per round) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for (name, batch), v in runs.items():
        lines.append(f"| {name} | {batch} | {np.median([p for p, _t in v]):.2f} | {spread([t for _p, t in v], '.1f')} "
                     f"| {ratio(name, 'ours FP32', batch)} |")
    lines += ["", "Ratios from this run: " + "; ".join(
        f"batch {b}: ours INT4 / ours FP32 {ratio('ours INT4', 'ours FP32', b)}, "
        f"ours INT4 block 128 / ours FP32 {ratio('ours INT4 block 128', 'ours FP32', b)}, "
        f"ours INT8 / ours FP32 {ratio('ours INT8', 'ours FP32', b)}, "
        f"ours FP16 / ours FP32 {ratio('ours FP16', 'ours FP32', b)}, "
        f"ours INT4 / ORT GenAI INT4 {ratio('ours INT4', 'ORT GenAI INT4', b)}, "
        f"ours INT8 / ORT GenAI INT4 {ratio('ours INT8', 'ORT GenAI INT4', b)}" for b in (1, 8)), END]
    publish("\n".join(lines), ROOT / "benchmarks" / "RESULTS.md", START, END, args.write)
    if optimum is not None:
        optimum.close()


if __name__ == "__main__":
    main()
