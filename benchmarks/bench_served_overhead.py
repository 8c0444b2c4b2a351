"""What serving costs per output token beyond the engine: the same prompts in-process and through the server.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_served_overhead.py --version VERSION_DIR [--precision int8]
        [--streams 8,32] [--tokens 128] [--rounds 2] [--variants base:,nospin:cpu_spinning=off] [--write]

Issue 49: at 8 and 32 streams Gemma 3 270M served through Triton and our OpenAI API (HTTP, streamed) reaches
0.74-0.81x of OpenVINO GenAI's in-process pipeline. Each round runs, on ``S`` 128-token prompts of word pieces
(``--tokens`` greedy tokens each, ``min_tokens`` = ``max_tokens`` + ``ignore_eos``, all submitted at once):

- ``in-process``: the version's graph as the stub loads it (``CausalLM``, 2 threads, spinning, the INT8-cache kernel
  where the cache is INT8) under the backend's ``Scheduler`` with the version's tokenizer; no Triton, no HTTP;
- ``served <variant>``: the version laid out as a model (``harness.gemma3.layout``, the variant's model parameters
  set), Triton started, our OpenAI frontend **in a process of its own** (as ``serve`` runs it beside Triton; in
  bench_generate it shares the client's process), and this process as the client: one streamed ``/v1/completions``
  per prompt (aiohttp), every SSE chunk parsed.

For each served run the CPU seconds (user + system, ``/proc`` through psutil) of tritonserver, the Python stub
(Triton's children), the frontend and the client are read before and after, and given per output token; the
in-process run's CPU is its process's (every thread). Output tokens are compared across arms and variants: every
stream's text must be the in-process run's. The variants alternate within each round (the order reversed every
other round), so the machine's drift falls on all of them.
The section between ``<!-- served_overhead:start -->`` and ``<!-- served_overhead:end -->`` is replaced.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks.results_file import publish, say  # noqa: E402

START, END = "<!-- served_overhead:start -->", "<!-- served_overhead:end -->"
PARTS = ("tritonserver", "stub", "frontend", "client")


def in_process(vdir: Path, precision: str, prompts: list[list[int]], tokens: int) -> dict:
    """The prompts on the backend's scheduler in this process: tokens/s, CPU ms per token, each stream's text."""
    from tokenizers import Tokenizer

    from benchmarks.bench_decode_profile import _engine, scheduler_for
    from model_factory.backend.generation.sampling import SamplingParams
    from model_factory.backend.generation.scheduler import Generation

    tokenizer = Tokenizer.from_file(str(vdir / "tokenizer" / "tokenizer.json"))
    tokenizer.no_padding()
    spec, lm = _engine(vdir, precision)
    try:
        sched = scheduler_for(lm, spec, tokenizer, len(prompts), len(prompts[0]) + tokens, max_waiting=256)
        texts = [[] for _ in prompts]
        count = {"tokens": 0}

        def sink(i):
            def emit(_gen, event):
                texts[i].append(event.text)
                count["tokens"] += event.token is not None
            return emit

        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
        wall, cpu = time.perf_counter(), time.process_time()
        for i, prompt in enumerate(prompts):
            sched.submit(Generation(list(prompt), params, sink(i)))
        while sched.has_work():
            sched.step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        lm.close()
    return {"tps": count["tokens"] / wall, "tokens": count["tokens"],
            "cpu_ms": {"engine": 1000 * cpu / count["tokens"]}, "texts": ["".join(t) for t in texts], "ttft_p50": None}


def _frontend(triton_http: str, repo: str, name: str, conn) -> None:
    """The OpenAI frontend in a process of its own (spawned): its URL sent back, stopped when the pipe says so."""
    from model_factory.serving.openai_api import OpenAIFrontend, generative_models

    fe = OpenAIFrontend(triton_http, generative_models(Path(repo), [name])).start()
    conn.send(fe.url)
    conn.recv()
    fe.stop()


async def _drive(url: str, model: str, prompts: list[list[int]], tokens: int) -> dict:
    """One streamed /v1/completions per prompt, all at once: texts, counts, chunks, TTFTs, wall."""
    import aiohttp

    from benchmarks.harness.openai_stream import stream_completion

    out: list[dict] = [{} for _ in prompts]

    async def one(session, i, prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        read = await stream_completion(session, url, body)
        out[i] = {"text": read.text, "chunks": read.chunks, "ttft": read.ttft,
                  "tokens": read.usage_of("completion_tokens") or 0}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(one(session, i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - start
    return {"wall": wall, "streams": out}


class Served:
    """Triton with the version laid out under each variant's name, and the frontend in its own process."""

    def __init__(self, vdir: Path, precision: str, variants: dict[str, dict], max_streams: int, work: Path) -> None:
        from benchmarks.harness import gemma3
        from model_factory.backend.contract import onnx_file
        from model_factory.serving.server import ServerOptions, TritonServer

        self.repo = work / "repo"
        for name, params in variants.items():
            gemma3.layout(vdir, self.repo, f"m_{name}", precision=precision, onnx_file=onnx_file(precision),
                          memory_budget_mib=4096, max_active_sequences=max_streams, **params)
        self.server = TritonServer(self.repo, options=ServerOptions(0, 0, 0, startup_timeout_s=600)).start()
        assert not self.server.load_errors, self.server.load_errors
        ctx = multiprocessing.get_context("spawn")
        self.fronts: dict[str, tuple] = {}  # variant -> (process, pipe, url): a frontend each, its CPU its own
        for name in variants:
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=_frontend, args=(self.server.http_url, str(self.repo), f"m_{name}", child),
                               daemon=True)
            proc.start()
            self.fronts[name] = (proc, conn, conn.recv())

    def cpu(self, name: str) -> dict[str, float]:
        """CPU seconds so far of each part; the stub is the one serving ``model`` (its command line names it)."""
        import psutil

        def secs(p) -> float:
            t = p.cpu_times()
            return t.user + t.system

        root = psutil.Process(self.server.process.pid)
        stubs = [c for c in root.children(recursive=True) if any(f"m_{name}" in a for a in c.cmdline())]
        return {"tritonserver": secs(root), "stub": sum(secs(s) for s in stubs),
                "frontend": secs(psutil.Process(self.fronts[name][0].pid)), "client": secs(psutil.Process())}

    def run(self, name: str, prompts: list[list[int]], tokens: int) -> dict:
        before = self.cpu(name)
        got = asyncio.run(_drive(self.fronts[name][2], f"m_{name}", prompts, tokens))
        after = self.cpu(name)
        n = sum(s["tokens"] for s in got["streams"])
        ttfts = sorted(s["ttft"] for s in got["streams"])
        return {"tps": n / got["wall"], "tokens": n, "texts": [s["text"] for s in got["streams"]],
                "chunks": sum(s["chunks"] for s in got["streams"]), "ttft_p50": ttfts[len(ttfts) // 2],
                "cpu_ms": {k: 1000 * (after[k] - before[k]) / max(1, n) for k in PARTS}}

    def close(self) -> None:
        for proc, conn, _url in self.fronts.values():
            conn.send("stop")
            proc.join(20)
        self.server.stop()


def _variants(text: str) -> dict[str, dict]:
    """``name:key=value;key=value,name2:...`` -> {name: {key: value}} (model parameters, as the contract reads)."""
    out = {}
    for item in text.split(","):
        name, _, rest = item.partition(":")
        out[name] = dict(kv.split("=", 1) for kv in rest.split(";") if kv)
    return out


def main() -> int:
    from tokenizers import Tokenizer

    from benchmarks.bench_decode_profile import _prompts
    from benchmarks.harness.run_header import LoadReading, run_header

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", required=True, help="a built version folder (model.<precision>.onnx, generation.json)")
    ap.add_argument("--precision", default="int8")
    ap.add_argument("--streams", default="8,32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="base:", help="served variants: name:param=value;...,name2:... "
                                                       "(model parameters; 'base:' the defaults)")
    ap.add_argument("--no-in-process", action="store_true")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    vdir = Path(args.version)
    variants = _variants(args.variants)
    levels = [int(s) for s in args.streams.split(",")]
    load = LoadReading.begin()
    tokenizer = Tokenizer.from_file(str(vdir / "tokenizer" / "tokenizer.json"))
    spec = json.loads((vdir / "generation.json").read_text())
    bos = spec.get("bos_token_id") if spec.get("bos_token_id") is not None else 2
    results: dict = collections.defaultdict(list)
    problems: list[str] = []
    loads: list[float] = []
    with tempfile.TemporaryDirectory(prefix="served-overhead-") as tmp:
        served = Served(vdir, args.precision, variants, max(levels), Path(tmp))
        try:
            for name in variants:  # warm-up: each model's first request
                served.run(name, _prompts(tokenizer, 1, 7, bos), 4)
            for r in range(args.rounds):
                arms = (["in-process"] if not args.no_in_process else []) + list(variants)
                if r % 2:
                    arms.reverse()
                for streams in levels:
                    prompts = _prompts(tokenizer, streams, 1000 * r + streams, bos)
                    reference = None
                    for arm in arms:
                        got = (in_process(vdir, args.precision, prompts, args.tokens) if arm == "in-process"
                               else served.run(arm, prompts, args.tokens))
                        loads.append(os.getloadavg()[0])
                        if got["tokens"] != streams * args.tokens:
                            problems.append(f"round {r + 1} {arm} S={streams}: {got['tokens']} tokens")
                        if reference is None:
                            reference = got["texts"]
                        got["same"] = sum(a == b for a, b in zip(got["texts"], reference)) / streams
                        results[(streams, arm)].append(got)
                        say(f"round {r + 1} S={streams} {arm}: {got['tps']:.1f} tok/s, CPU ms/token "
                            + ", ".join(f"{k} {v:.2f}" for k, v in got["cpu_ms"].items())
                            + (f", chunks {got['chunks']}, TTFT p50 {got['ttft_p50']:.2f} s" if "chunks" in got
                               else "") + f", load {loads[-1]:.1f}")
        finally:
            served.close()
    lines = section(results, levels, variants, args, load, loads, problems, run_header)
    publish("\n".join(lines), HERE / "RESULTS.md", START, END, args.write)
    return 1 if problems else 0


def section(results, levels, variants, args, load, loads, problems, run_header) -> list[str]:
    def cell(runs: list[dict], get, fmt: str = "{:.2f}") -> str:
        values = [get(x) for x in runs]
        if any(v is None for v in values):
            return "-"
        mid = fmt.format(statistics.median(values))
        return mid if len(values) == 1 else f"{mid} ({fmt.format(min(values))}-{fmt.format(max(values))})"

    lines = [START, "## What serving costs per output token beyond the engine (`served_overhead`)", "",
             run_header("benchmarks/bench_served_overhead.py", load.finish()), "",
             f"`{args.version}` at `{args.precision}`; {_prompts_note()} {args.tokens} greedy output tokens a "
             f"stream (min_tokens = max_tokens, ignore_eos), all streams at once; medians (ranges) over {args.rounds} "
             f"rounds, the arms alternating in each; load average during the runs {min(loads):.1f}-{max(loads):.1f}. "
             "In-process: the backend's scheduler and CausalLM in one process (CPU: all its threads). Served: Triton "
             "+ our OpenAI frontend (its own process) + this process as the streamed client; CPU per output token of "
             "each process. Variants: " + "; ".join(f"`{k}` " + (", ".join(f"{a} = {b}" for a, b in v.items())
                                                                  or "the defaults") for k, v in variants.items())
             + ".", "",
             "| streams | arm | tokens/s | TTFT p50 s | engine / stub CPU ms | tritonserver | frontend | client | "
             "all CPU ms / token | chunks / token | streams as the round's first arm |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for streams in levels:
        for arm in ["in-process", *variants]:
            runs = results.get((streams, arm))
            if not runs:
                continue
            ms = [r["cpu_ms"] for r in runs]
            lines.append(
                f"| {streams} | {arm} | {cell(runs, lambda x: x['tps'], '{:.1f}')} | "
                f"{cell(runs, lambda x: x['ttft_p50'])} | "
                f"{cell(ms, lambda m: m.get('engine', m.get('stub')))} | {cell(ms, lambda m: m.get('tritonserver'))} | "
                f"{cell(ms, lambda m: m.get('frontend'))} | {cell(ms, lambda m: m.get('client'))} | "
                f"{cell(ms, lambda m: sum(m.values()))} | "
                f"{cell(runs, lambda x: x['chunks'] / x['tokens'] if 'chunks' in x else None)} | "
                f"{cell(runs, lambda x: x['same'], '{:.0%}')} |")
    lines += ["", "The last column: the share of streams whose text equals the round's first arm's (exact only where "
              "the precision is batch-independent: INT8 dynamic quantizes each launch's activations with one scale, "
              "so a row's tokens depend on what it was batched with, and the batches follow the arrivals' timing).",
              "Every stream made its tokens." if not problems else "Problems: " + "; ".join(problems)]
    lines.append(END)
    return lines


def _prompts_note() -> str:
    return "128-token prompts (`<bos>` and 127 word pieces),"


if __name__ == "__main__":
    raise SystemExit(main())
