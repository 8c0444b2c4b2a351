"""Structured outputs' cost: output tokens/s with a JSON schema against without, at 1 / 8 / 32 streams (issue 50's
target: at least 0.9x, the mask must not be what decides speed).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_structured.py [--work DIR] [--seconds 15] [--write]

The 110M Llama of bench_generate (SmolLM-135M's shape, random weights, its 6,294-token tokenizer; made here or
reused from ``--work``), built by the factory at INT8 dynamic with the INT8 cache, runs on the backend's own
scheduler in-process (``Scheduler`` over ``CausalLM`` and ``KVSlots``, 2 threads; no Triton, no HTTP: what differs
between the two settings is the grammar alone). ``N`` streams each send one request after another (closed loop:
64-token prompts, up to 160 tokens out) for ``--seconds``; the tokens produced in that time are counted. Without a
schema the requests generate their 160 tokens (``min_tokens``, ``ignore_eos``); with one, ``SCHEMA`` (a list of
records: strings, bounded integers, enums) compiled once by llguidance against the tokenizer, each sequence's
mask computed beside the batched step and applied before sampling, a sequence ending when its JSON is complete
(each answer checked: it parses). Also the schema's compile time, the time to build llguidance's view of the
tokenizer, and the masks' time per token. The section between ``<!-- structured:start -->`` and
``<!-- structured:end -->`` is replaced.
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
STREAMS = (1, 8, 32)
PROMPT, MAX_TOKENS = 64, 160
SCHEMA = {"type": "object", "properties": {"records": {"type": "array", "minItems": 3, "maxItems": 6, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
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


def one_run(lm, spec, streams: int, grammar, seconds: float, seed: int) -> dict[str, float]:
    """``streams`` closed-loop clients for ``seconds`` on a fresh scheduler: output tokens/s and the answers' check."""
    from model_factory.backend.batching.grouping import CostModel
    from model_factory.backend.generation.kv_slots import KVSlots
    from model_factory.backend.generation.sampling import SamplingParams
    from model_factory.backend.generation.scheduler import Generation, Scheduler

    slots = KVSlots(spec, max(STREAMS), KVSlots(spec, 1, 1 << 40).bytes_for(PROMPT + MAX_TOKENS) * max(STREAMS))
    sched = Scheduler(lm, slots, None, spec.eos_token_ids, max_waiting=64, cost=CostModel(1e-3, 1e-5, 0.0),
                      cancel_check_s=0.0)
    rng = np.random.default_rng(seed)
    counted = {"tokens": 0, "answers": 0, "parsed": 0}
    deadline = [float("inf")]
    tok = grammar[1] if grammar else None

    def submit() -> None:
        prompt = rng.integers(10, spec.vocab_size - 10, PROMPT).tolist()
        if grammar:
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=int(rng.integers(1 << 30)))
        else:
            params = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8,
                                    seed=int(rng.integers(1 << 30)))
        sched.submit(Generation(prompt, params, emit, grammar=grammar[0] if grammar else None))

    def emit(gen, event) -> None:
        if event.token is not None and time.perf_counter() < deadline[0]:
            counted["tokens"] += 1
        if event.finish_reason is not None:
            if grammar and time.perf_counter() < deadline[0]:
                counted["answers"] += 1
                try:
                    json.loads(tok.decode(gen.generated, skip_special_tokens=True))
                    counted["parsed"] += 1
                except ValueError:
                    pass
            if time.perf_counter() < deadline[0]:
                submit()  # the next request of this stream

    start = time.perf_counter()
    deadline[0] = start + seconds
    for _ in range(streams):
        submit()
    while sched.has_work():
        sched.step()
    return {"tokens/s": counted["tokens"] / seconds, "answers": counted["answers"], "parsed": counted["parsed"]}


def main() -> int:
    from benchmarks.harness.run_header import LoadReading, run_header
    from tokenizers import Tokenizer

    from model_factory.backend.generation.structured.engines import load_engine
    from model_factory.backend.generation.structured.grammar import Grammars, parse_guided

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    work = args.work or Path(__import__("tempfile").mkdtemp(prefix="bench-structured-"))
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
    one_run(lm, spec, 8, (timed, tok), 3.0, seed=99)
    one_run(lm, spec, 8, None, 3.0, seed=99)
    mask_times.clear()
    load = LoadReading.begin()
    rows = []
    for streams in STREAMS:
        free = one_run(lm, spec, streams, None, args.seconds, seed=streams)
        guided = one_run(lm, spec, streams, (timed, tok), args.seconds, seed=streams)
        ratio = guided["tokens/s"] / free["tokens/s"]
        say(f"{streams} streams: without {free['tokens/s']:.1f}, with the schema {guided['tokens/s']:.1f} tokens/s "
            f"({ratio:.2f}x), {guided['parsed']}/{guided['answers']} answers parsed")
        rows.append(f"| {streams} | {free['tokens/s']:.1f} | {guided['tokens/s']:.1f} | **{ratio:.2f}x** | "
                    f"{guided['parsed']} / {guided['answers']} |")
    load = load.finish()
    ms = sorted(x * 1e3 for x in mask_times)
    section = "\n".join([
        START, "## Structured outputs: a JSON schema against none (benchmarks/bench_structured.py)", "",
        run_header("benchmarks/bench_structured.py", load), "",
        "The 110M Llama of bench_generate (random weights, a 6,294-token vocabulary), INT8 dynamic with the INT8 cache, "
        "on the backend's scheduler in-process (no Triton, no HTTP; 2 threads). N closed-loop streams of "
        f"{PROMPT}-token prompts for {args.seconds:.0f} s each, sampled at temperature 0.8: without a schema each "
        f"request generates {MAX_TOKENS} tokens; with one it follows a JSON schema of 3-6 records (strings, bounded "
        "integers, an enum), compiled once by llguidance, each sequence's mask computed beside the batched step, "
        f"ending when its JSON is complete (at most {MAX_TOKENS} tokens). One run per setting.", "",
        "| streams | output tokens/s without | with the schema | ratio | answers that parse / answered |",
        "| ---: | ---: | ---: | ---: | ---: |", *rows, "",
        f"llguidance's view of the tokenizer built in {engine_s * 1e3:.0f} ms (once per model, at the first guided "
        f"request); the schema compiled in {compile_s * 1e3:.1f} ms (once: cached by its canonical JSON); a mask "
        f"took p50 {statistics.median(ms):.3f} ms, p99 {ms[int(0.99 * (len(ms) - 1))]:.3f} ms over {len(ms)} "
        "tokens (on the mask thread, while the step's launch runs).", "", END])
    publish(section, HERE / "RESULTS.md", START, END, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
