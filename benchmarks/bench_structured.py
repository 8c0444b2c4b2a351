"""Structured outputs' cost: output tokens/s with a JSON schema against without, at 1 / 8 / 32 streams (issue 50's
target: at least 0.9x, the mask must not be what decides speed).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_structured.py [--work DIR] [--built VERSION_DIR] [--write]

The 110M Llama of bench_generate (SmolLM-135M's shape, random weights, its 6,294-token tokenizer; made here or
reused from ``--work``), built by the factory at INT8 dynamic with the INT8 cache (or the version folder of such a
build, ``--built``: the build takes a quarter of an hour on a shared 2-core machine), runs on the backend's own
scheduler in-process (``Scheduler`` over ``CausalLM`` and ``KVSlots``, 2 threads; no Triton, no HTTP). The same
work with and without the schema, so that what differs is the grammar alone: ``N`` streams each send ``R`` requests
one after another (closed loop, 64-token prompts, sampled at temperature 0.8). With the schema (``SCHEMA``: 2-4
records of strings, bounded integers and an enum; compiled once by llguidance against the tokenizer, each sequence's
mask computed beside the batched step and applied before sampling) each request ends when its JSON is complete (each
answer checked: it parses); then the same prompts run without it, each request made to generate exactly as many
tokens as its guided twin did (``min_tokens`` = ``max_tokens``, ``ignore_eos``). Output tokens/s = the tokens over
the wall time; two rounds, the second in the other order (free first), the ratio of each. Also the schema's compile
time, the time to build llguidance's view of the tokenizer, and the masks' time per token. The section between
``<!-- structured:start -->`` and ``<!-- structured:end -->`` is replaced.

``--served ours,vllm``: the same model, schema and prompts served, beside vLLM-CPU's guided decoding (section
``structured_served``)::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_structured.py --work DIR --served ours,vllm \
        [--served-precision fp32] [--served-rounds 2] [--vllm-lock /tmp/vllm.lock] [--write]

The 110M Llama's HF folder (``--work``/hf, the in-process run's) served by ours (the factory's build at
``--served-precision``, FP32 by default as vLLM serves it, reused from ``--work``/served-repo, on the real Triton
server behind our OpenAI frontend, bench_generate's set-up) and by vLLM-CPU (``--vllm-python``, bench_generate's
command and environment, both cores, ``--structured-outputs-config`` xgrammar without free whitespace; its first start
compiles for minutes, cached in ``~/.cache/vllm``), one server at a time, each through its OpenAI ``/v1/completions``
streamed through ``harness.openai_stream``: the closed-loop streams above, the schema sent as vLLM's
``structured_outputs`` (both servers take it), every complete answer parsed and validated against the schema
(jsonschema); without it the same prompts make exactly the tokens of the level's first guided run. Rounds interleave
with and without, the order alternating. Each server's run is kept in ``--work`` (``served-ours.json``,
``served-vllm.json``): the servers may run in separate invocations, and the section shows every run found there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from results_file import publish, say, suffixed  # noqa: E402
from benchmarks.harness.scheduler_run import int8_kv8_engine, llama_folder  # noqa: E402

START, END = "<!-- structured:start -->", "<!-- structured:end -->"
STREAMS = {1: 4, 8: 3, 32: 2}  # streams: requests each stream sends
PROMPT, MAX_TOKENS = 64, 200
SCHEMA = {"type": "object", "properties": {"records": {"type": "array", "minItems": 2, "maxItems": 4, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "score": {"type": "integer", "minimum": 0, "maximum": 1000},
                                     "kind": {"enum": ["alpha", "beta", "gamma"]}},
    "required": ["name", "score", "kind"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False}


class MaskTimer:
    """The matcher's mask calls, timed (wraps each sequence's matcher)."""

    def __init__(self, matcher, times: list[float]) -> None:
        self._m, self._times, self.vocab_size = matcher, times, matcher.vocab_size

    def fill_mask(self, row):
        t = time.perf_counter()
        self._m.fill_mask(row)
        self._times.append(time.perf_counter() - t)

    def __getattr__(self, name):
        return getattr(self._m, name)


class TimedGrammar:
    def __init__(self, compiled, times: list[float]) -> None:
        self._c, self._times = compiled, times

    def matcher(self):
        return MaskTimer(self._c.matcher(), self._times)


def draw_prompts(streams: int, per_stream: int, vocab_size: int, seed: int) -> dict[tuple[int, int], list[int]]:
    """Request ``(stream, k)``'s prompt: PROMPT token ids drawn from ``seed`` (the in-process and the served runs
    send the same ones)."""
    rng = np.random.default_rng(seed)
    return {(i, k): rng.integers(10, vocab_size - 10, PROMPT).tolist()
            for i in range(streams) for k in range(per_stream)}


def one_run(lm, spec, streams: int, grammar, lengths: dict | None, seed: int) -> tuple[dict[str, float], dict]:
    """``streams`` closed-loop clients of ``STREAMS[streams]`` requests each on a fresh scheduler. With ``grammar``
    (``(compiled, tokenizer)``) the requests follow the schema; without, request ``(stream, k)`` generates exactly
    ``lengths[(stream, k)]`` tokens. Returns the figures and each request's length."""
    from model_factory.backend.batching.grouping import CostModel
    from model_factory.backend.generation.kv_slots import KVSlots
    from model_factory.backend.generation.sampling import SamplingParams
    from model_factory.backend.generation.scheduler import Generation, Scheduler

    per_stream = STREAMS[streams]
    top = max(STREAMS)
    slots = KVSlots(spec, top, KVSlots(spec, 1, 1 << 40).bytes_for(PROMPT + MAX_TOKENS) * top)
    sched = Scheduler(lm, slots, None, spec.eos_token_ids, max_waiting=64, cost=CostModel(1e-3, 1e-5, 0.0),
                      cancel_check_s=0.0)
    prompts = draw_prompts(streams, per_stream, spec.vocab_size, seed)
    counted = {"tokens": 0, "stop": 0, "parsed": 0, "length": 0}
    made: dict = {}
    which: dict[int, tuple[int, int]] = {}

    def submit(i: int, k: int) -> None:
        if grammar:
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=seed * 1000 + i * 10 + k)
        else:
            n = lengths[(i, k)]
            params = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.8,
                                    seed=seed * 1000 + i * 10 + k)
        gen = sched.submit(Generation(prompts[(i, k)], params, emit, grammar=grammar[0] if grammar else None))
        which[id(gen)] = (i, k)

    def emit(gen, event) -> None:
        if event.token is not None:
            counted["tokens"] += 1
        if event.finish_reason is None:
            return
        i, k = which[id(gen)]
        made[(i, k)] = len(gen.generated)
        if grammar:
            counted[event.finish_reason] = counted.get(event.finish_reason, 0) + 1
            if event.finish_reason == "stop":
                try:
                    json.loads(grammar[1].decode(gen.generated, skip_special_tokens=True))
                    counted["parsed"] += 1
                except ValueError:
                    pass
        if k + 1 < per_stream:
            submit(i, k + 1)  # the stream's next request

    start = time.perf_counter()
    for i in range(streams):
        submit(i, 0)
    while sched.has_work():
        sched.step()
    wall = time.perf_counter() - start
    return {"tokens/s": counted["tokens"] / wall, "tokens": counted["tokens"], "stop": counted["stop"],
            "parsed": counted["parsed"], "length": counted["length"]}, made


# --------------------------------------------------------------------------- served: ours beside vLLM-CPU

SERVED_START, SERVED_END = "<!-- structured_served:start -->", "<!-- structured_served:end -->"
# vLLM's structured-outputs engine: xgrammar, JSON without free whitespace (its default lets the grammar take any
# whitespace between tokens; ours always generates compact JSON), so the two generate the same kind of answers.
VLLM_STRUCTURED = {"backend": "xgrammar", "disable_any_whitespace": True}
GUIDED_FIELD = {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}  # the same body for both


def served_request(model: str, prompt: list[int], seed: int, length: int | None) -> dict:
    """One streamed /v1/completions body: with the schema (vLLM's ``structured_outputs``, which both servers take)
    when ``length`` is None, else exactly ``length`` tokens without it; sampled at 0.8 with the request's seed."""
    body = {"model": model, "prompt": prompt, "temperature": 0.8, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}}
    if length is None:
        return {**body, "max_tokens": MAX_TOKENS, **GUIDED_FIELD}
    return {**body, "max_tokens": length, "min_tokens": length, "ignore_eos": True}


def served_run(url: str, model: str, vocab_size: int, streams: int, lengths: dict | None,
               seed: int) -> tuple[dict, dict]:
    """``streams`` closed-loop clients of ``STREAMS[streams]`` requests each, streamed through the server's OpenAI
    ``/v1/completions`` (``harness.openai_stream``), the prompts of the in-process run. With
    ``lengths`` None the requests follow the schema and every complete answer is parsed and validated (jsonschema);
    else request ``(stream, k)`` generates exactly ``lengths[(stream, k)]`` tokens. Tokens are the servers' own
    streamed ``usage``. Returns the figures and each request's length."""
    import asyncio

    import aiohttp
    import jsonschema
    from benchmarks.harness.openai_stream import stream_completion

    per_stream = STREAMS[streams]
    prompts = draw_prompts(streams, per_stream, vocab_size, seed)
    got: dict = {}

    async def stream(session, i: int) -> None:
        for k in range(per_stream):  # the stream's next request when its last one ended
            body = served_request(model, prompts[(i, k)], seed * 1000 + i * 10 + k,
                                  None if lengths is None else lengths[(i, k)])
            got[(i, k)] = await stream_completion(session, url, body)

    async def drive() -> float:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            start = time.perf_counter()
            await asyncio.gather(*(stream(session, i) for i in range(streams)))
            return time.perf_counter() - start

    wall = asyncio.run(drive())
    counts = {"stop": 0, "length": 0, "parsed": 0, "valid": 0, "no_usage": 0}
    for (i, k), g in got.items():
        if g.usage_of("completion_tokens") is None:
            counts["no_usage"] += 1
        if lengths is not None:
            if g.usage_of("completion_tokens") != lengths[(i, k)]:
                counts["length"] += 1  # a free request that did not make its twin's tokens: counted as off
            continue
        counts[g.finish_reason] = counts.get(g.finish_reason, 0) + 1
        if g.finish_reason == "stop":
            try:
                answer = json.loads(g.text)
                counts["parsed"] += 1
                jsonschema.validate(answer, SCHEMA)
                counts["valid"] += 1
            except (ValueError, jsonschema.ValidationError):
                say(f"not valid: {g.text[:200]!r}")
    tokens = sum(g.usage_of("completion_tokens") or 0 for g in got.values())
    return ({"tokens/s": tokens / wall, "tokens": tokens, **counts},
            {key: max(1, g.usage_of("completion_tokens") or 1) for key, g in got.items()})


def served_cells(who: str, url: str, model: str, vocab_size: int, rounds: int, on_cell=None) -> list[dict]:
    """An untimed guided and free request first (the grammar engine's first compile, the server's warm-up), then
    ``rounds`` rounds of every level, the same work with the schema and without, the order alternating by round
    (round 1 with the schema first); the free run of each round makes the lengths of the level's first guided run.
    ``on_cell(cells)`` after each round of a level (the run so far kept: a run cut short still shows what it made)."""
    served_run(url, model, vocab_size, 1, None, seed=99)
    served_run(url, model, vocab_size, 1, {(0, k): 16 for k in range(STREAMS[1])}, seed=99)
    cells = []
    for streams in STREAMS:
        made = None
        for r in range(rounds):
            if r % 2 == 0:
                guided, lengths = served_run(url, model, vocab_size, streams, None, seed=streams)
                made = made or lengths
                free, _ = served_run(url, model, vocab_size, streams, made, seed=streams)
            else:
                free, _ = served_run(url, model, vocab_size, streams, made, seed=streams)
                guided, _ = served_run(url, model, vocab_size, streams, None, seed=streams)
            cells.append({"streams": streams, "round": r + 1, "free": free, "guided": guided,
                          "ratio": guided["tokens/s"] / free["tokens/s"], "load": os.getloadavg()[0]})
            say(f"{who} {streams} streams, round {r + 1}: without {free['tokens/s']:.1f}, with the schema "
                f"{guided['tokens/s']:.1f} tokens/s ({cells[-1]['ratio']:.2f}x) over {guided['tokens']} / "
                f"{free['tokens']} tokens; {guided['valid']}/{guided['stop']} complete answers valid, "
                f"{guided['length']} cut at {MAX_TOKENS}; load {os.getloadavg()[0]:.1f}")
            if on_cell:
                on_cell(cells)
    return cells


def serve_ours(hf: Path, work: Path, precision: str, rounds: int, on_cell=None) -> dict:
    """The factory's build of ``hf`` (``precision``: fp32, or int8kv8 = INT8 dynamic with the INT8 cache; reused
    from ``work/served-repo``) on the real Triton server behind our OpenAI frontend (bench_generate's set-up)."""
    from model_factory.serving.openai_api import OpenAIFrontend, generative_models
    from model_factory.serving.server import ServerOptions, TritonServer
    from tests.generative_repository import layout_generative_model

    repo, name = work / "served-repo", f"llm_{precision}"
    if not (repo / name / "config.pbtxt").is_file():
        say(f"building ours at {precision}")
        base = precision.removesuffix("kv8")
        lines = (['int8_method = "dynamic"'] if base == "int8" else []) + (
            ['kv_cache = "int8"'] if precision.endswith("kv8") else [])
        layout_generative_model(hf, None, repo, name, precision=base, quantization="\n".join(lines),
                                memory_budget_mib=4096, max_active_sequences=max(STREAMS))
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    start = time.perf_counter()
    server = TritonServer(repo, options=ServerOptions(0, 0, 0, startup_timeout_s=600)).start()
    try:
        assert not server.load_errors, server.load_errors
        with OpenAIFrontend(server.http_url, generative_models(repo, server.ready_models)) as fe:
            ready = time.perf_counter() - start
            cells = served_cells("ours", fe.url, name, vocab, rounds, on_cell)
    finally:
        server.stop()
    return {"who": "ours", "precision": precision, "engine": served_engine("ours", ""), "start_s": ready,
            "cells": cells}


def serve_vllm(python: str, hf: Path, work: Path, rounds: int, lock: str | None, timeout_s: float,
               on_cell=None) -> dict:
    """vLLM-CPU's OpenAI server on the same HF folder (FP32, bench_generate's command and environment, both cores)
    with ``--structured-outputs-config`` VLLM_STRUCTURED; its start under ``flock LOCK`` when given (one vLLM start
    compiling at a time on a shared machine; the wait counts in ``timeout_s``)."""
    from benchmarks.bench_generate import VLLM_ENV, _free_port, _server, vllm_command

    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    port = _free_port()
    cmd = vllm_command(python, hf, port, "--structured-outputs-config", json.dumps(VLLM_STRUCTURED))
    env = {**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0-%d" % ((os.cpu_count() or 1) - 1)}
    with _server("vllm", (["flock", lock] if lock else []) + cmd, env, port, work / "vllm.log", timeout_s) as (
            url, ready):
        cells = served_cells("vllm", url, "llm", vocab, rounds, on_cell)
    return {"who": "vllm", "precision": "fp32", "engine": served_engine("vllm", python), "start_s": ready,
            "cells": cells}


def served_engine(who: str, vllm_python: str) -> str:
    """The server's grammar engine, named with its version."""
    if who == "ours":
        import llguidance

        return f"llguidance {llguidance.__version__}"
    code = "import vllm; from importlib.metadata import version; print(vllm.__version__, version('xgrammar'))"
    version = subprocess.run([vllm_python, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return f"vLLM {version[0]}, xgrammar {version[1]} (--structured-outputs-config '{json.dumps(VLLM_STRUCTURED)}')"


def served_section(runs: list[dict]) -> str:
    """The ``structured_served`` section from each server's run (read back from the work folder: the servers may
    run in separate invocations, each with its own load reading)."""
    who_says = {"ours": "ours (Triton + our OpenAI frontend, llguidance)", "vllm": "vLLM-CPU"}
    rows, notes = [], []
    for run in runs:
        by_level: dict[int, list[dict]] = {}
        for c in run["cells"]:
            by_level.setdefault(c["streams"], []).append(c)
        for streams, cells in by_level.items():
            def figs(key: str) -> str:
                return " / ".join(f"{c[key]['tokens/s']:.1f}" for c in cells)
            ratios = [c["ratio"] for c in cells]
            valid = sum(c["guided"]["valid"] for c in cells)
            parsed = sum(c["guided"]["parsed"] for c in cells)
            stop = sum(c["guided"]["stop"] for c in cells)
            cut = sum(c["guided"]["length"] for c in cells)
            off = sum(c["free"]["length"] + c["free"]["no_usage"] + c["guided"]["no_usage"] for c in cells)
            rows.append(f"| {run['who']} {run['precision']} | {streams} x {STREAMS[streams]} | {figs('free')} | "
                        f"{figs('guided')} | **{statistics.median(ratios):.2f}x** "
                        f"({' / '.join(f'{x:.2f}' for x in ratios)}) | {valid} / {parsed} / {stop} ({cut})"
                        f"{f'; {off} counts off' if off else ''} |")
        notes.append(f"- {who_says[run['who']]}, {run['precision'].upper()}: {run['engine']}; "
                     + ("**cut short**: the rows are the rounds it finished; " if run.get("partial") else
                        f"ready {run['start_s']:.0f} s after its start; ") + run["header"])
    rounds = max(c["round"] for run in runs for c in run["cells"])
    return "\n".join([
        SERVED_START, "## Structured outputs served: ours beside vLLM-CPU's guided decoding "
        "(benchmarks/bench_structured.py --served)", "",
        "The in-process section's model, schema and prompts, served: the 110M Llama's HF folder (random weights, "
        "6,294-token vocabulary) served by ours (the factory's build on the real Triton server behind our OpenAI "
        "frontend) and by vLLM-CPU (FP32, both cores), one server at a time, each driven through its OpenAI "
        "`/v1/completions` by the same streamed client (bench_generate's). N closed-loop streams of R requests "
        f"each ({PROMPT}-token prompts as token ids, sampled at temperature 0.8 with a seed per request). With the "
        "schema the request carries vLLM's `structured_outputs: {json: SCHEMA}` (both servers take it) and ends "
        f"when its JSON is complete (at most {MAX_TOKENS} tokens); every complete answer is parsed and validated "
        "against the schema (Python's `json`, strict as RFC 8259: a raw control character inside a string does not "
        "parse; then jsonschema). Without it the same prompts generate exactly as many tokens as the level's first "
        "guided run made (`min_tokens` = `max_tokens`, `ignore_eos`), so the grammar is what differs. "
        f"{rounds} round(s) per level, with and without interleaved, the order alternating (round 1 with the schema "
        "first); tokens are each server's streamed `usage`. Ratio: with the schema over without, the median of the "
        "rounds (each round's in brackets).", "",
        "| server | streams x requests | output tokens/s without (each round) | with the schema | ratio | answers "
        f"valid against the schema / that parse (strict JSON) / complete (cut at {MAX_TOKENS}) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |", *rows, "", *notes, "", SERVED_END])


def served_main(args, work: Path) -> int:
    from benchmarks.harness.run_header import LoadReading, run_header

    hf = llama_folder(work, "bench-structured-")
    for who in args.served:
        load = LoadReading.begin()

        def keep(run: dict, partial: bool) -> None:
            end = load.finish()
            run.update(load=[end.start, end.end], partial=partial,
                       header=run_header("benchmarks/bench_structured.py --served", end))
            (work / f"served-{who}.json").write_text(json.dumps(run, indent=1))

        engine = {"who": who, "precision": "fp32" if who == "vllm" else args.served_precision,
                  "engine": served_engine(who, args.vllm_python), "start_s": float("nan")}
        on_cell = lambda cells: keep({**engine, "cells": cells}, True)  # noqa: E731
        if who == "ours":
            run = serve_ours(hf, work, args.served_precision, args.served_rounds, on_cell)
        else:
            run = serve_vllm(args.vllm_python, hf, work, args.served_rounds, args.vllm_lock, args.server_timeout,
                             on_cell)
        keep(run, False)
    runs = [json.loads((work / f"served-{w}.json").read_text()) for w in ("ours", "vllm")
            if (work / f"served-{w}.json").is_file()]
    publish(served_section(runs), HERE / "RESULTS.md", SERVED_START, SERVED_END, args.write)
    return 0


def main() -> int:
    from benchmarks.harness.run_header import LoadReading, run_header
    from tokenizers import Tokenizer

    from model_factory.backend.generation.structured.engines import load_engine
    from model_factory.backend.generation.structured.grammar import Grammars, parse_guided

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--built", type=Path, default=None, help="the version folder of the 110M Llama's INT8 build")
    ap.add_argument("--served", type=lambda v: [w for w in v.split(",") if w], default=[],
                    help="ours,vllm: the served comparison instead of the in-process run (section structured_served; "
                    "each server's run kept in --work, so the servers may run in separate invocations; none: only "
                    "the section from the runs kept there)")
    ap.add_argument("--served-precision", default="fp32", choices=("fp32", "int8", "int8kv8"),
                    help="what ours serves (vLLM serves the HF folder in FP32)")
    ap.add_argument("--served-rounds", type=int, default=2)
    ap.add_argument("--vllm-python", default="/work/peers/vllm/bin/python")
    ap.add_argument("--vllm-lock", default=None, help="start vLLM under `flock LOCK` (a machine shared by others "
                    "who start vLLM: one compile at a time)")
    ap.add_argument("--server-timeout", type=float, default=3600, help="seconds vLLM may take to start (its first "
                    "start compiles; the wait for --vllm-lock counts)")
    ap.add_argument("--section-suffix", default="", help="appended to the in-process section's markers and title (a "
                    "run on another machine kept beside the first: --section-suffix epyc)")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    work = args.work or Path(__import__("tempfile").mkdtemp(prefix="bench-structured-"))
    if args.served:
        if set(args.served) - {"ours", "vllm", "none"}:
            ap.error("--served takes ours and / or vllm")
        args.served = [w for w in args.served if w != "none"]  # none: the section from the runs in --work alone
        return served_main(args, work)
    if args.built:
        from model_factory.backend.contract import Files, GenerationSpec, onnx_file
        from model_factory.backend.generation.causal_lm import CausalLM

        spec = GenerationSpec.from_json((args.built / Files.GENERATION).read_text()).for_precision("int8")
        lm = CausalLM(args.built / onnx_file("int8"), threads=2, pad_token_id=spec.pad_token_id or 0)
    else:
        spec, lm = int8_kv8_engine(work, "bench-structured-")
    tok = Tokenizer.from_file(str(llama_folder(work, "bench-structured-") / "tokenizer.json"))
    t = time.perf_counter()
    grammars = Grammars(load_engine(tok.to_str(), spec.vocab_size, spec.eos_token_ids))
    engine_s = time.perf_counter() - t
    t = time.perf_counter()
    compiled = grammars.compile(parse_guided({"json": SCHEMA}))
    compile_s = time.perf_counter() - t
    mask_times: list[float] = []
    timed = TimedGrammar(compiled, mask_times)
    say(f"engine {engine_s * 1e3:.0f} ms, schema compiled in {compile_s * 1e3:.1f} ms; warm-up")
    _, made = one_run(lm, spec, 8, (timed, tok), None, seed=99)
    one_run(lm, spec, 8, None, made, seed=99)
    mask_times.clear()
    load = LoadReading.begin()
    rows = []
    for streams in STREAMS:
        ratios, cells = [], []
        for r in range(2):
            if r == 0:
                guided, made = one_run(lm, spec, streams, (timed, tok), None, seed=streams)
                free, _ = one_run(lm, spec, streams, None, made, seed=streams)
            else:  # the other order: the same work without the schema first
                free, _ = one_run(lm, spec, streams, None, made, seed=streams)
                guided, _ = one_run(lm, spec, streams, (timed, tok), None, seed=streams)
            ratios.append(guided["tokens/s"] / free["tokens/s"])
            cells.append((free, guided))
            say(f"{streams} streams, round {r + 1}: without {free['tokens/s']:.1f}, with the schema "
                f"{guided['tokens/s']:.1f} tokens/s ({ratios[-1]:.2f}x) over {guided['tokens']} / {free['tokens']} "
                f"tokens; {guided['parsed']}/{guided['stop']} complete answers parse, {guided['length']} cut at "
                f"{MAX_TOKENS} tokens")
        (f1, g1), (f2, g2) = cells
        rows.append(f"| {streams} x {STREAMS[streams]} | {f1['tokens/s']:.1f} / {f2['tokens/s']:.1f} | "
                    f"{g1['tokens/s']:.1f} / {g2['tokens/s']:.1f} | **{ratios[0]:.2f}x / {ratios[1]:.2f}x** | "
                    f"{g1['parsed'] + g2['parsed']} / {g1['stop'] + g2['stop']} ({g1['length'] + g2['length']}) |")
    load = load.finish()
    ms = sorted(x * 1e3 for x in mask_times)
    start, end, title = suffixed(START, END, args.section_suffix)
    section = "\n".join([
        start, f"## Structured outputs: a JSON schema against none{title} (benchmarks/bench_structured.py)", "",
        run_header("benchmarks/bench_structured.py", load), "",
        "The 110M Llama of bench_generate (random weights, a 6,294-token vocabulary), INT8 dynamic with the INT8 cache, "
        "on the backend's scheduler in-process (no Triton, no HTTP; 2 threads). N closed-loop streams of R requests "
        f"each ({PROMPT}-token prompts, sampled at temperature 0.8). With the schema (2-4 records of strings, bounded "
        "integers and an enum; compiled once by llguidance, each sequence's mask applied before sampling: made in place at these sizes, StepMasks) a "
        f"request ends when its JSON is complete (at most {MAX_TOKENS} tokens); without it the same prompts generate "
        "exactly as many tokens each, so the work is the same and the grammar is what differs. Two rounds, the "
        "second in the other order: round 1 / round 2.", "",
        "| streams x requests | output tokens/s without | with the schema | ratio | complete answers that parse / "
        f"complete (cut at {MAX_TOKENS}) |",
        "| ---: | ---: | ---: | ---: | ---: |", *rows, "",
        f"llguidance's view of the tokenizer built in {engine_s * 1e3:.0f} ms (once per model, at the first guided "
        f"request); the schema compiled in {compile_s * 1e3:.1f} ms (once: cached by its canonical JSON); a mask "
        f"took p50 {statistics.median(ms):.3f} ms, p99 {ms[int(0.99 * (len(ms) - 1))]:.3f} ms over {len(ms)} "
        "tokens (made in place: below StepMasks' threshold for the worker thread).", "", end])
    publish(section, HERE / "RESULTS.md", start, end, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
