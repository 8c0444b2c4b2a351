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
"""

from __future__ import annotations

import argparse
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
from results_file import publish, say  # noqa: E402
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
    rng = np.random.default_rng(seed)
    prompts = {(i, k): rng.integers(10, spec.vocab_size - 10, PROMPT).tolist()
               for i in range(streams) for k in range(per_stream)}
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


def main() -> int:
    from benchmarks.harness.run_header import LoadReading, run_header
    from tokenizers import Tokenizer

    from model_factory.backend.generation.structured.engines import load_engine
    from model_factory.backend.generation.structured.grammar import Grammars, parse_guided

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--built", type=Path, default=None, help="the version folder of the 110M Llama's INT8 build")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    work = args.work or Path(__import__("tempfile").mkdtemp(prefix="bench-structured-"))
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
    section = "\n".join([
        START, "## Structured outputs: a JSON schema against none (benchmarks/bench_structured.py)", "",
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
        "tokens (made in place: below StepMasks' threshold for the worker thread).", "", END])
    publish(section, HERE / "RESULTS.md", START, END, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
