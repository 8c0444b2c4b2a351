"""Prefill with the LM head at every position (the builder's graph) against the last position only (the graph the
factory packages, ``build_engines/logits_positions.py``), side by side in one run.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_logits_positions.py [--rounds 5] [--write]

The body of SmolLM-135M (hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate 1536, random weights std 0.1)
with three vocabularies: this repository's benchmark Llama's (6,294 tokens: the tokenizer trained on local
text), SmolLM's own (49,152) and Qwen2's (151,936); untied LM head. FP32 graphs from onnxruntime-genai's
builder, the backend's runtime (``causal_lm.CausalLM``: I/O binding on preallocated KV buffers), 2 threads.
Prefill of B prompts of 128 tokens (B = 1, 8, 16), the rounds interleaving the two graphs; the logits of both
are compared (they must be identical). The section between ``<!-- logits_positions:start -->`` and
``<!-- logits_positions:end -->`` of benchmarks/RESULTS.md is replaced with ``--write``.
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
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

START, END = "<!-- logits_positions:start -->", "<!-- logits_positions:end -->"
PROMPT = 128
BATCHES = (1, 8, 16)
VOCABS = (6294, 49152, 151936)
SHAPE = dict(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, max_positions=2048, vocab_size=16384)


def make_folder(base: Path, out: Path, vocab: int) -> Path:
    """``base``'s config (SmolLM's body) with ``vocab`` tokens and an untied head, random weights std 0.1."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((base / "config.json").read_text())
    cfg.update(vocab_size=vocab, tie_word_embeddings=False)
    (out / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(out)))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    model.save_pretrained(out)
    for f in base.iterdir():  # the builder copies the tokenizer; ids stay below the trained vocabulary
        if f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja":
            shutil.copy(f, out / f.name)
    return out


def prefill_seconds(model, head_dim: int, kv_heads: int, layers: int, rows: list[list[int]]):
    from model_factory.backend.contract import past_name

    n = len(rows)
    views = {past_name(i, k): np.zeros((n, kv_heads, PROMPT + 1, head_dim), np.float32)
             for i in range(layers) for k in ("key", "value")}
    t0 = time.perf_counter()
    logits = model.prefill(rows, views)
    return time.perf_counter() - t0, logits


def main() -> None:
    from benchmarks.harness.run_header import LoadReading, run_header
    from benchmarks.results_file import publish, say
    from generative_models import make_causal_lm

    from model_factory.backend.generation.causal_lm import CausalLM
    from model_factory.build_engines.causal_lm import run_builder
    from model_factory.build_engines.logits_positions import select_logits_positions

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-logits-positions-"))
    base = work / "base"
    if not (base / "config.json").is_file():
        say("making the base folder (tokenizer trained on local text)")
        make_causal_lm("llama", base, **SHAPE)
    layers, kv_heads, head_dim = SHAPE["layers"], SHAPE["kv_heads"], SHAPE["hidden"] // SHAPE["heads"]
    load = LoadReading.begin()
    models = {}
    for vocab in VOCABS:
        whole = work / f"v{vocab}-whole"
        if not (whole / "model.onnx").is_file():
            say(f"building the FP32 graph, vocabulary {vocab}")
            run_builder(make_folder(base, work / f"v{vocab}-hf", vocab), whole, "fp32", select_positions=False)
        last = work / f"v{vocab}-last"
        if not (last / "model.onnx").is_file():
            shutil.copytree(whole, last)
            select_logits_positions(last / "model.onnx")
        models[vocab] = {"every position": CausalLM(whole / "model.onnx", threads=2),
                         "last position": CausalLM(last / "model.onnx", threads=2)}
    rng = np.random.default_rng(0)
    runs: dict[tuple[int, int, str], list[float]] = {}
    worst = 0.0
    for vocab, pair in models.items():
        for batch in BATCHES:
            rows = [list(map(int, rng.integers(3, 2000, PROMPT))) for _ in range(batch)]
            for m in pair.values():
                prefill_seconds(m, head_dim, kv_heads, layers, rows[:1])  # warm-up
            for r in range(args.rounds):
                got = {}
                for name, m in pair.items():
                    seconds, got[name] = prefill_seconds(m, head_dim, kv_heads, layers, rows)
                    runs.setdefault((vocab, batch, name), []).append(seconds)
                worst = max(worst, float(np.abs(got["every position"] - got["last position"]).max()))
                say(f"vocab {vocab} batch {batch} round {r + 1}: " + ", ".join(
                    f"{k} {v[-1]:.3f} s" for (vv, b, k), v in runs.items() if vv == vocab and b == batch))
    load = load.finish()

    def spread(values: list[float], fmt: str) -> str:
        return f"{np.median(values):{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})"

    lines = [START, "## Prefill: the LM head at every position vs the last only (benchmarks/bench_logits_positions.py)",
             "", run_header("benchmarks/bench_logits_positions.py", load), "",
             f"SmolLM-135M's body (hidden 576, 30 layers, 9 heads, 3 KV heads), random weights, untied LM head, "
             f"FP32 graphs of onnxruntime-genai's builder on the backend's runtime (`CausalLM`, 2 threads); prefill "
             f"of B prompts of {PROMPT} tokens; {args.rounds} rounds interleaving the two graphs: medians, the "
             "range in brackets, the ratio taken per round. 'every position': the builder's graph (the LM head on "
             "all B x 128 tokens, the backend keeping each row's last); 'last position': the graph the factory "
             "packages (`logits_positions`). Logits bytes: what one prefill writes. Largest difference between the "
             f"two graphs' logits over every run: {worst:.3g}.", "",
             "| vocabulary | LM head share of weights | B | every position (s) | last position (s) | speed-up | "
             "logits bytes (every / last) |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    body = 2 * layers * (SHAPE["hidden"] ** 2 + SHAPE["hidden"] * kv_heads * head_dim) \
        + 3 * layers * SHAPE["hidden"] * SHAPE["intermediate"]
    for vocab in VOCABS:
        head = vocab * SHAPE["hidden"]
        share = head / (body + 2 * head)
        for batch in BATCHES:
            a, b = runs[(vocab, batch, "every position")], runs[(vocab, batch, "last position")]
            per_round = [x / y for x, y in zip(a, b)]
            lines.append(f"| {vocab:,} | {share:.0%} | {batch} | {spread(a, '.3f')} | {spread(b, '.3f')} | "
                         f"{spread(per_round, '.2f')}x | {batch * PROMPT * vocab * 4 / 2**20:,.0f} MiB / "
                         f"{batch * vocab * 4 / 2**20:.2f} MiB |")
    lines.append(END)
    publish("\n".join(lines), ROOT / "benchmarks" / "RESULTS.md", START, END, args.write)


if __name__ == "__main__":
    main()
