"""Chunked prefill off, with a fixed chunk and with the ITL budget: 8 streams decoding while long prompts arrive (issue
51's token jitter), served.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_chunked_prefill.py [--work DIR] [--built VERSION_DIR] [--rounds 2]
        [--write]

The 110M Llama of bench_generate (SmolLM-135M's shape, random weights, 2,048 positions; made here or reused from
``--work``), or with ``--shape 15m`` a narrower one of the same family and context, the factory's FP32 build,
laid out three times in one repository: ``prefill_chunk_tokens = "auto"`` with ``max_itl_ratio = 2`` (``itl``: the
chunk sized each step to keep the step within twice the decode-only step, generation/itl_budget.py), ``auto`` with
``max_itl_ratio = 0`` (the chunk chosen once from the cost model measured at load) and ``0`` (``off``: every prompt
whole), served by the real Triton server and
driven through our OpenAI frontend (streamed ``/v1/completions``, token-id prompts, greedy, ``min_tokens`` +
``ignore_eos``). Per run: 8 streams of 128-token prompts start together and decode ``STREAM_TOKENS`` tokens each;
from ``FIRST_S`` on, a ``LONG``-token prompt (the longest the 2,048 positions hold with its ``LONG_TOKENS`` tokens)
arrives every ``GAP_S`` seconds, ``LONGS`` of them. The running streams' inter-token latency (the time between two
streamed token events of one stream) p50 / p99 and their token jitter p99 (the standard deviation of 10 consecutive
intervals, as ``model_factory_token_jitter_seconds``) over the window from the first long prompt's arrival to the
last one's first token; the long prompts' TTFT p50; whether every request's text equals the same request's with
chunking off. Then a short check on fresh prompts alone: 8 streams of 128-token prompts, 64 tokens each, all at
once (tokens/s and TTFT p50), each setting. The settings alternate within a round (the order rotates each round). The
section between ``<!-- chunked-prefill:start -->`` and ``<!-- chunked-prefill:end -->`` is replaced.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from results_file import median_cell as _cell, publish, say, suffixed  # noqa: E402
from benchmarks.harness.scheduler_run import SHAPE, pct  # noqa: E402

START, END = "<!-- chunked-prefill:start -->", "<!-- chunked-prefill:end -->"

STREAMS, PROMPT, STREAM_TOKENS = 8, 128, 560
LONG, LONG_TOKENS, LONGS, FIRST_S, GAP_S = 2000, 16, 3, 1.0, 2.5
FRESH_TOKENS = 64
JITTER_WINDOW = 10
MODELS = {"itl": "llm_itl", "auto": "llm_chunked", "off": "llm_whole"}
LAYOUT = {"itl": dict(prefill_chunk_tokens="auto", max_itl_ratio=2.0),
          "auto": dict(prefill_chunk_tokens="auto", max_itl_ratio=0.0), "off": dict(prefill_chunk_tokens=0)}
SETTINGS = tuple(MODELS)
# The 110M Llama of bench_generate, and a 15M one of the same family and context (--shape 15m: its factory build takes
# minutes where the 110M's takes a quarter of an hour or more on a loaded 2-core machine).
SHAPES = {"110m": SHAPE, "15m": dict(SHAPE, hidden=384, layers=8, heads=6, kv_heads=2, intermediate=1024)}
MODEL_TEXT = {"110m": "The 110M Llama of bench_generate",
              "15m": "A 15M Llama (`--shape 15m`: bench_generate's 110M shape narrowed to hidden 384, 8 layers, 6 "
                     "heads, 2 KV heads, intermediate 1536 -> 1024; 2,048 positions)"}


def llama_folder(work: Path | None, shape: str) -> Path:
    """The HF folder of the ``shape`` Llama under ``work`` (a new temporary folder when None), made when absent."""
    import tempfile

    from tests.generative_models import make_causal_lm

    work = work or Path(tempfile.mkdtemp(prefix="bench-chunked-prefill-"))
    hf = work / ("hf" if shape == "110m" else f"hf-{shape}")
    if not (hf / "config.json").is_file():
        say(f"making the {shape} Llama (random weights)")
        make_causal_lm("llama", hf, **SHAPES[shape])
    return hf


async def _stream(session, url: str, model: str, prompt: list[int], max_tokens: int,
                  record: dict | None = None) -> dict:
    """One streamed completion: the arrival time of each token event, and its text, filled into ``record`` as they
    arrive (a stream cancelled before its end keeps what it had)."""
    from benchmarks.harness.openai_stream import stream_completion

    record = {} if record is None else record
    record.update(sent=time.perf_counter(), times=[], text="")

    def seen(at: float, text: str) -> None:
        record["times"].append(at)
        record["text"] += text

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}
    await stream_completion(session, url, body, on_event=seen)
    return record


async def _mixed(url: str, model: str, streams: list[list[int]], longs: list[list[int]],
                 stream_tokens: int = STREAM_TOKENS, cancel_after_s: float | None = None) -> dict:
    """The mixed workload through an OpenAI API at ``url``. ``cancel_after_s``: the streams are closed that long after
    the last long prompt has ended (the server cancels them) instead of decoding all their ``stream_tokens``."""
    import aiohttp

    records: list[dict] = [{} for _ in streams]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        running = [asyncio.create_task(_stream(session, url, model, p, stream_tokens, records[i]))
                   for i, p in enumerate(streams)]

        async def late(i: int, prompt: list[int]) -> dict:
            await asyncio.sleep(FIRST_S + i * GAP_S)
            return await _stream(session, url, model, prompt, LONG_TOKENS)

        arriving = [asyncio.create_task(late(i, p)) for i, p in enumerate(longs)]
        got_longs = await asyncio.gather(*arriving)
        if cancel_after_s is not None:
            await asyncio.sleep(cancel_after_s)
            for task in running:
                task.cancel()
        results = await asyncio.gather(*running, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
        assert not failed, failed
    return _window(records, got_longs, stream_tokens if cancel_after_s is None else 0)


def _window(got_streams: list[dict], got_longs: list[dict], stream_tokens: int = STREAM_TOKENS) -> dict:
    """The running streams' ITL and jitter over the window from the first long prompt's arrival to the last one's first
    token, and the long prompts' TTFT (each request: ``sent``, its token ``times``, its ``text``)."""
    begin = min(g["sent"] for g in got_longs)
    end = max(g["times"][0] for g in got_longs)
    intervals, jitters = [], []
    for g in got_streams:
        t = np.asarray(g["times"])
        gaps = np.diff(t)
        intervals += gaps[(t[1:] >= begin) & (t[1:] <= end)].tolist()  # intervals ending inside the window
        for i in range(0, len(gaps) - JITTER_WINDOW + 1, JITTER_WINDOW):  # 10 intervals whose span meets it
            if t[i + JITTER_WINDOW] >= begin and t[i] <= end:
                jitters.append(float(np.std(gaps[i:i + JITTER_WINDOW])))
    counts = [len(g["times"]) for g in got_streams]
    # An event may carry more than one token (the frontend sends what has arrived): events, not tokens, are timed.
    assert len(intervals) >= 2 * STREAMS and all(c > stream_tokens // 2 for c in counts), (len(intervals), counts)
    assert all(g["times"][-1] > end for g in got_streams), "a stream ended before the last long prompt's first token"
    return {"intervals": len(intervals), "stream_tokens_min": min(counts), "itl_p50_ms": 1e3 * pct(intervals, 0.5),
            "itl_p90_ms": 1e3 * pct(intervals, 0.9), "itl_p99_ms": 1e3 * pct(intervals, 0.99),
            "itl_max_ms": 1e3 * max(intervals), "jitter_p99_ms": 1e3 * pct(jitters, 0.99) if jitters else float("nan"),
            "p99_over_p50": pct(intervals, 0.99) / pct(intervals, 0.5),
            "long_ttft_p50_s": statistics.median(g["times"][0] - g["sent"] for g in got_longs),
            "texts": [g["text"] for g in got_streams + got_longs]}


async def _fresh(url: str, model: str, prompts: list[list[int]]) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()
        got = await asyncio.gather(*(_stream(session, url, model, p, FRESH_TOKENS) for p in prompts))
        wall = time.perf_counter() - start
    return {"tokens_per_s": sum(len(g["times"]) for g in got) / wall,
            "ttft_p50_s": statistics.median(g["times"][0] - g["sent"] for g in got),
            "texts": [g["text"] for g in got]}


def _prompts(vocab: int, seed: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(seed)
    draw = lambda n: rng.integers(10, vocab - 10, n).tolist()  # noqa: E731
    return ([draw(PROMPT) for _ in range(STREAMS)], [draw(LONG) for _ in range(LONGS)],
            [draw(PROMPT) for _ in range(STREAMS)])


CHUNKS = (16, 32, 64, 128, 256, 512)


def interleave(vdir: Path, repeats: int = 7) -> dict:
    """In-process, on the served graph (2 threads): what a step's launches cost. The decode launch of the 8 streams
    (256 cached tokens each), a continued chunk of each size (from 1,000 cached tokens: a chunk runs alone), and the
    prefill cost model the load fits (``prefill_cost.measure_cost``) with what ``auto`` takes from it."""
    from model_factory.backend.contract import Files, GenerationSpec
    from model_factory.backend.generation.prefill_cost import measure_cost
    from model_factory.backend.generation.causal_lm import CausalLM
    from model_factory.backend.generation.chunked_prefill import chunk_tokens
    from model_factory.backend.generation.kv_slots import KVSlots

    spec = GenerationSpec.from_json((vdir / Files.GENERATION).read_text())
    lm = CausalLM(vdir / Files.ONNX, threads=2, pad_token_id=spec.pad_token_id or 0)
    slots = KVSlots(spec, STREAMS + 1, 1 << 34)
    cost = measure_cost(lm, slots, 2048)
    for _ in range(STREAMS + 1):
        slots.admit(2048)
    lm.prefill([[11] * 256] * STREAMS, slots.views(0, STREAMS))
    lm.prefill([[12] * 1000], slots.views(STREAMS, 1))

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return 1e3 * statistics.median(times)

    out = {"decode": timed(lambda: lm.decode([5] * STREAMS, [256] * STREAMS, slots.views(0, STREAMS)))}
    for c in CHUNKS:
        out[c] = timed(lambda: lm.prefill([[13] * c], slots.views(STREAMS, 1), past=[1000]))
    out["cost"] = cost
    out["auto"] = chunk_tokens("auto", cost, 2048)
    return out


GEMMA_VERSION = Path("/work/gemma-cache/gemma-bench/work/builds/int8kv8/repo/gemma3/1")
GEMMA_START, GEMMA_END = "<!-- chunked-prefill-gemma:start -->", "<!-- chunked-prefill-gemma:end -->"


def _inprocess_mixed(lm, spec, cost, setting: str, streams: list[list[int]], longs: list[list[int]],
                     stream_tokens: int = STREAM_TOKENS) -> dict | None:
    """The mixed workload on the backend's scheduler in-process (no Triton, no HTTP): the scheduler a load of
    ``setting`` makes (``chunk_tokens``, ``whole_below``, ``itl_budget`` from the same functions), the long prompts
    submitted from another thread at their times, each token's time taken when the scheduler emits it. The streams
    are cancelled a few tokens after the last long prompt's first token (what follows is outside the window)."""
    from benchmarks.harness.scheduler_run import step_while_arriving
    from model_factory.backend.generation.chunked_prefill import chunk_tokens, whole_below
    from model_factory.backend.generation.itl_budget import itl_budget
    from model_factory.backend.generation.kv_slots import KVSlots
    from model_factory.backend.generation.sampling import SamplingParams
    from model_factory.backend.generation.scheduler import Generation, Scheduler

    lay = LAYOUT[setting]
    pct, ratio = lay["prefill_chunk_tokens"], lay.get("max_itl_ratio", 0.0)
    chunk = chunk_tokens(pct, cost, 2048)
    sched = Scheduler(lm, KVSlots(spec, STREAMS + LONGS, 1 << 34), None, spec.eos_token_ids, cost=cost,
                      chunk_tokens=chunk, whole_below=whole_below(pct, chunk),
                      itl_budget=itl_budget(pct, ratio, chunk, cost, 2048))
    records: dict[int, dict] = {}
    tail = {"tokens": None}  # the streams' tokens still to come once every long prompt has its first token

    def submit(prompt: list[int], tokens: int) -> None:
        record = {"sent": time.perf_counter(), "times": [], "text": []}
        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
        long = len(records) >= len(streams)

        def emit(_g, event) -> None:
            if event.token is not None:
                record["times"].append(time.perf_counter())
                record["text"].append(event.token)
                firsts = [r for i, r in records.items() if i >= len(streams) and r["times"]]
                if long and len(firsts) == len(longs) and tail["tokens"] is None:
                    tail["tokens"] = 3 * len(streams)
                elif not long and tail["tokens"]:
                    tail["tokens"] -= 1
        records[len(records)] = record
        sched.submit(Generation(list(prompt), params, emit,
                                is_cancelled=(lambda: tail["tokens"] == 0) if not long else (lambda: False)))

    def arrivals() -> None:
        start = time.perf_counter()
        for p in streams:
            submit(p, stream_tokens)
        for i, p in enumerate(longs):
            time.sleep(max(0.0, start + FIRST_S + i * GAP_S - time.perf_counter()))
            submit(p, LONG_TOKENS)

    step_while_arriving(sched, arrivals)
    got = [records[i] for i in range(len(records))]
    if len(streams) < STREAMS:
        return None  # a warm-up
    return _window(got[:len(streams)], got[len(streams):], 0)


def gemma(args, load_reading, header) -> None:
    """The mixed workload on Gemma 3 270M in-process: the FP32 graph of ``--gemma``'s version folder (its float KV
    cache), its slots sized to 2,048 tokens; the three settings interleaved, ``--rounds`` rounds."""
    import dataclasses

    from model_factory.backend.contract import Files, GenerationSpec
    from model_factory.backend.generation.prefill_cost import measure_cost
    from model_factory.backend.generation.causal_lm import CausalLM
    from model_factory.backend.generation.chunked_prefill import chunk_tokens
    from model_factory.backend.generation.kv_slots import KVSlots

    vdir = args.gemma
    spec = GenerationSpec.from_json((vdir / Files.GENERATION).read_text()).for_precision("fp32")
    spec = dataclasses.replace(spec, max_context=max(spec.max_context, 2048))
    lm = CausalLM(vdir / Files.ONNX, threads=2, pad_token_id=spec.pad_token_id or 0)
    cost = measure_cost(lm, KVSlots(spec, STREAMS + LONGS, 1 << 34), 2048)
    say(f"Gemma 3 270M FP32 in-process: cost {cost}, auto takes {chunk_tokens('auto', cost, 2048)}")
    warm_streams, warm_longs, _ = _prompts(spec.vocab_size, 99)
    _inprocess_mixed(lm, spec, cost, "itl", warm_streams[:2], [warm_longs[0][:600]], 64)
    load = load_reading.begin()
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        streams, longs, _ = _prompts(spec.vocab_size, r)
        for setting in SETTINGS[r % 3:] + SETTINGS[:r % 3]:
            got = _inprocess_mixed(lm, spec, cost, setting, streams, longs, args.stream_tokens)
            runs.setdefault(setting, []).append(got)
            say(f"round {r + 1} Gemma mixed, {setting}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in got.items() if k != "texts"))
    load = load.finish()
    keys = [k for k in runs["auto"][0] if k != "texts"]
    rows = [f"| {k} | " + " | ".join(_cell([run[k] for run in runs[s]], 2 if "over" in k else 1)
                                      for s in ("off", "auto", "itl")) + " |" for k in keys]
    # The streams were cancelled at different tokens in each setting: their common tokens compared.
    same = ["yes" if all(x[:min(len(x), len(y))] == y[:min(len(x), len(y))]
                         for a, b in zip(runs[s], runs["off"]) for x, y in zip(a["texts"], b["texts"])) else "no"
            for s in ("auto", "itl")]
    rows.append(f"| every request's tokens = chunking off's (the tokens both have) | – | {same[0]} | {same[1]} |")
    start, end, title = suffixed(GEMMA_START, GEMMA_END, args.section_suffix)
    section = "\n".join([
        start, f"## Chunked prefill on Gemma 3 270M, in-process{title} (benchmarks/bench_chunked_prefill.py --gemma)", "",
        header("benchmarks/bench_chunked_prefill.py --gemma", load), "",
        f"Gemma 3 270M (the real weights: the FP32 graph of the factory's build, float KV cache, its slots sized to "
        f"2,048 tokens) on the backend's scheduler in-process (2 threads; no Triton, no HTTP), the workload above: "
        f"{STREAMS} streams of {PROMPT}-token prompts decode up to {args.stream_tokens} tokens each (greedy, eos "
        "ignored; cancelled 3 tokens each after the last long prompt's first token, past the window); "
        f"from {FIRST_S:g} s on a {LONG}-token prompt ({LONG_TOKENS} tokens out) arrives every {GAP_S:g} s, {LONGS} of "
        f"them. The scheduler of each setting as a load makes it; the load's prefill cost model a = "
        f"{1e3 * cost.a:.1f} ms, b = {1e3 * cost.b:.3f} ms/token, c = {1e3 * cost.c:.2e} ms/token², `auto` "
        f"{chunk_tokens('auto', cost, 2048)} tokens. ITL: the time between two tokens of one stream as the scheduler "
        f"emits them. {args.rounds} round(s), medians and ranges, the settings' order rotated each round.", "",
        "| per run | chunked prefill off | auto, fixed chunk | auto, max_itl_ratio 2 |", "| --- | ---: | ---: | ---: |",
        *rows, "", end])
    publish(section, HERE / "RESULTS.md", start, end, args.write)


def _load_line(server, model: str) -> str:
    """The instance's load line's chunked-prefill part (what ``auto`` chose)."""
    for line in server.log_tail(400).splitlines():
        if f"{model} generates" in line and "chunked prefill" in line:
            return line.split("chunked prefill", 1)[1].split(";")[0].strip().strip('"')
    return "?"


def main() -> int:
    from benchmarks.harness.run_header import LoadReading, run_header
    from model_factory.serving.openai_api import OpenAIFrontend, generative_models
    from model_factory.serving.server import ServerOptions, TritonServer
    from tests.generative_repository import layout_generative_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="110m")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--built", type=Path, default=None,
                    help="the version folder of the factory's FP32 build of --work's Llama (the build takes a quarter "
                         "of an hour on a shared 2-core machine)")
    ap.add_argument("--interleave-only", action="store_true", help="only the in-process launch timings (printed)")
    ap.add_argument("--gemma", type=Path, nargs="?", const=GEMMA_VERSION, default=None,
                    help="instead: the workload on Gemma 3 270M in-process (a version folder of its build, with the "
                         f"FP32 graph; default {GEMMA_VERSION})")
    ap.add_argument("--section-suffix", default="", help="appended to the section's markers and title (a run on "
                    "another machine kept beside the first: --section-suffix epyc)")
    ap.add_argument("--stream-tokens", type=int, default=STREAM_TOKENS,
                    help="with --gemma: the tokens each running stream decodes (it must outlast the long prompts)")
    args = ap.parse_args()
    if args.gemma is not None:
        gemma(args, LoadReading, run_header)
        return 0
    hf = llama_folder(args.work, args.shape)
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    repo = hf.parent / "repo-chunked"
    if args.built:
        from tests import generative_repository

        generative_repository._BUILDS[(str(hf.resolve()), "fp32", "")] = args.built.resolve()
    say(f"laying out the three models (the factory's FP32 build of the {args.shape} Llama)")
    for setting, model in MODELS.items():
        vdir = layout_generative_model(hf, None, repo, model, memory_budget_mib=4096, max_active_sequences=16,
                                       **LAYOUT[setting])
    say("a step's launches, in-process")
    steps = interleave(vdir)
    say(", ".join(f"{k} {v}" for k, v in steps.items()))
    if args.interleave_only:
        return 0
    server = TritonServer(repo, options=ServerOptions(0, 0, 0, startup_timeout_s=900)).start()
    runs: dict[tuple[str, str], list[dict]] = {}
    try:
        assert not server.load_errors, server.load_errors
        chunk = _load_line(server, MODELS["auto"])
        say(f"chunked prefill: {chunk}; itl: {_load_line(server, MODELS['itl'])}")
        with OpenAIFrontend(server.http_url, generative_models(repo, server.ready_models)) as fe:
            warm_streams, warm_longs, _ = _prompts(vocab, 99)
            for model in MODELS.values():  # untimed: the first requests' sessions and bindings
                asyncio.run(_fresh(fe.url, model, warm_streams[:2] + [warm_longs[0][:600]]))
            load = LoadReading.begin()
            for r in range(args.rounds):
                streams, longs, fresh = _prompts(vocab, r)
                order = SETTINGS[r % 3:] + SETTINGS[:r % 3]  # rotated each round
                for setting in order:
                    got = asyncio.run(_mixed(fe.url, MODELS[setting], streams, longs))
                    runs.setdefault(("mixed", setting), []).append(got)
                    say(f"round {r + 1} mixed, chunked prefill {setting}: " + ", ".join(
                        f"{k} {v:.3f}" for k, v in got.items() if k != "texts"))
                for setting in reversed(order):
                    got = asyncio.run(_fresh(fe.url, MODELS[setting], fresh))
                    runs.setdefault(("fresh", setting), []).append(got)
                    say(f"round {r + 1} fresh, chunked prefill {setting}: " + ", ".join(
                        f"{k} {v:.3f}" for k, v in got.items() if k != "texts"))
            load = load.finish()
    finally:
        server.stop()

    cell = _cell

    def table(kind: str) -> list[str]:
        keys = [k for k in runs[(kind, "auto")][0] if k != "texts"]
        rows = [f"| {k} | " + " | ".join(cell([run[k] for run in runs[(kind, s)]], 2 if "over" in k else 1)
                                          for s in ("off", "auto", "itl")) + " |" for k in keys]
        same = ["yes" if all(a["texts"] == b["texts"] for a, b in zip(runs[(kind, s)], runs[(kind, "off")]))
                else "no" for s in ("auto", "itl")]
        rows.append(f"| every request's text = chunking off's | – | {same[0]} | {same[1]} |")
        return ["| per run | chunked prefill off | auto, fixed chunk | auto, max_itl_ratio 2 |",
                "| --- | ---: | ---: | ---: |", *rows]

    start, end, title = suffixed(START, END, args.section_suffix)
    section = "\n".join([
        start, f"## Chunked prefill: 8 streams while 2,000-token prompts arrive{title} "
        "(benchmarks/bench_chunked_prefill.py)",
        "", run_header("benchmarks/bench_chunked_prefill.py", load), "",
        f"{MODEL_TEXT[args.shape]} (random weights, FP32, the factory's build), served three times by one Triton "
        f"server (`prefill_chunk_tokens` auto with `max_itl_ratio` 2: each step's chunk sized to keep the step within "
        f"twice the decode-only step; auto with `max_itl_ratio` 0: the cost model's fixed chunk, which took {chunk}; "
        "and 0: whole prompts), through our OpenAI frontend "
        f"(streamed `/v1/completions`, greedy). {STREAMS} streams of {PROMPT}-token prompts decode {STREAM_TOKENS} "
        f"tokens each; from {FIRST_S:g} s on a {LONG}-token prompt ({LONG_TOKENS} tokens out) arrives every "
        f"{GAP_S:g} s, {LONGS} of them. ITL: the time between two token events of one running stream (an event may "
        "carry two tokens when they "
        "arrive together), over the window "
        "from the first long prompt's arrival to the last one's first token; jitter: the standard deviation of 10 "
        "consecutive intervals (those whose span meets the window). Long TTFT: the long prompts' time to first token. "
        f"{args.rounds} round(s), medians and ranges; the settings alternate within a round (the order rotates each "
        "round), on a machine shared with other work.", "",
        *table("mixed"), "",
        "A step's launches, in-process on the same graph (2 threads, medians of 7; milliseconds): the decode launch "
        f"of the {STREAMS} streams (256 cached tokens each) and one continued chunk (1,000 cached tokens) of each "
        f"size; the load's prefill cost model a = {1e3 * steps['cost'].a:.1f} ms, b = {1e3 * steps['cost'].b:.3f} "
        f"ms/token, c = {1e3 * steps['cost'].c:.2e} ms/token², from which `auto` takes {steps['auto']} tokens.", "",
        "| decode, 8 rows | " + " | ".join(f"chunk {c}" for c in CHUNKS) + " |",
        "| ---: | " + " | ".join("---:" for _ in CHUNKS) + " |",
        f"| {steps['decode']:.1f} | " + " | ".join(f"{steps[c]:.1f}" for c in CHUNKS) + " |", "",
        f"Fresh prompts alone ({STREAMS} streams of {PROMPT}-token prompts, {FRESH_TOKENS} tokens each, all at once):",
        "", *table("fresh"), "", end])
    publish(section, HERE / "RESULTS.md", start, end, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
