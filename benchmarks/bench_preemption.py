"""Preemption on and off under KV-memory pressure: short requests arriving behind long ones (issue 32's "kept where
measured to help, documented with the measurement either way").

    PYTHONPATH=. .venv/bin/python benchmarks/bench_preemption.py [--work DIR] [--rounds 3] [--write]

The 110M Llama of bench_generate (SmolLM-135M's shape, random weights; made here or reused from ``--work``), built by
the factory at INT8 dynamic with the INT8 cache (the precision bench_generate serves best), runs on the backend's own
scheduler in-process (``Scheduler`` over ``CausalLM`` and ``KVSlots``, 2 threads; no Triton, no HTTP: what differs
between the two settings is the scheduler alone). The KV budget holds exactly ``LONG`` sequences of the long kind
(128 prompt + 384 generated tokens); ``LONG`` of them are submitted at once, then ``SHORT`` short requests (64 + 32
tokens) arrive one every ``GAP`` seconds from another thread, as clients would. Without preemption a short request
waits until a long one ends; with ``preemption_wait_ms`` = 200 (the seed's default bound) one that waited 200 ms
evicts the running sequence with the most tokens left, which resumes later by prefilling its prompt and what it had
generated (its output unchanged). Per setting: the short requests' time to first token and to their last token
(p50 / p99), the long ones' completion time, all output tokens per second, the preemptions and the tokens prefilled
again. Rounds alternate the settings; medians and ranges. The section between ``<!-- preemption:start -->`` and
``<!-- preemption:end -->`` is replaced.
"""

from __future__ import annotations

import argparse
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
from benchmarks.harness.scheduler_run import TokenTimes, int8_kv8_engine, pct, step_while_arriving  # noqa: E402

START, END = "<!-- preemption:start -->", "<!-- preemption:end -->"
LONG, LONG_PROMPT, LONG_TOKENS = 8, 128, 384
SHORT, SHORT_PROMPT, SHORT_TOKENS, GAP = 24, 64, 32, 0.25
SETTINGS = {"off": 0.0, "200 ms": 0.2}


def one_run(lm, spec, preemption_wait_s: float, seed: int) -> dict[str, float]:
    """One workload on a fresh scheduler; the timings and counts of it."""
    from model_factory.backend.batching.grouping import CostModel
    from model_factory.backend.generation.kv_slots import KVSlots
    from model_factory.backend.generation.sampling import SamplingParams
    from model_factory.backend.generation.scheduler import Generation, Scheduler

    probe = KVSlots(spec, 1, 1 << 40)
    budget = LONG * probe.bytes_for(LONG_PROMPT + LONG_TOKENS)
    slots = KVSlots(spec, LONG + SHORT, budget)
    counted = {"preempted": 0}

    class Metrics:  # what the scheduler reports, the preemptions counted
        def preempted(self) -> None:
            counted["preempted"] += 1

        def __getattr__(self, _name):
            return lambda *a, **k: None

    prefilled = {"tokens": 0}

    class Counting:  # the runtime, its prefilled tokens counted
        def prefill(self, prompts, views):
            prefilled["tokens"] += sum(len(p) for p in prompts)
            return lm.prefill(prompts, views)

        def decode(self, tokens, lengths, views):
            return lm.decode(tokens, lengths, views)

    sched = Scheduler(Counting(), slots, None, spec.eos_token_ids, max_waiting=LONG + SHORT,
                      cost=CostModel(1e-3, 1e-5, 0.0), preemption_wait_s=preemption_wait_s, metrics=Metrics(),
                      cancel_check_s=0.0)
    rng = np.random.default_rng(seed)
    times = TokenTimes()

    def submit(prompt_len: int, tokens: int):
        prompt = rng.integers(10, spec.vocab_size - 10, prompt_len).tolist()
        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
        return sched.submit(Generation(prompt, params, times.emit))  # its arrival: the scheduler's clock at submit

    longs = [submit(LONG_PROMPT, LONG_TOKENS) for _ in range(LONG)]
    shorts: list = []

    def arrivals() -> None:
        for _ in range(SHORT):
            time.sleep(GAP)
            shorts.append(submit(SHORT_PROMPT, SHORT_TOKENS))

    wall = step_while_arriving(sched, arrivals)
    tokens = sum(len(g.generated) for g in longs + shorts)
    again = prefilled["tokens"] - LONG * LONG_PROMPT - SHORT * SHORT_PROMPT
    ttft = sorted(times.ttft(shorts))
    done = sorted(times.done(shorts))
    long_done = sorted(times.done(longs))
    return {"short TTFT p50 (s)": pct(ttft, 0.5), "short TTFT p99 (s)": pct(ttft, 0.99),
            "short done p50 (s)": pct(done, 0.5), "short done p99 (s)": pct(done, 0.99),
            "long done p50 (s)": pct(long_done, 0.5), "long done max (s)": long_done[-1],
            "output tokens/s": tokens / wall, "preemptions": float(counted["preempted"]),
            "tokens prefilled again": float(again)}


def main() -> int:
    from benchmarks.harness.run_header import LoadReading, run_header

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    spec, lm = int8_kv8_engine(args.work, "bench-preemption-")
    say("warm-up")
    one_run(lm, spec, 0.0, seed=99)
    load = LoadReading.begin()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        order = list(SETTINGS) if r % 2 == 0 else list(reversed(SETTINGS))
        for name in order:
            got = one_run(lm, spec, SETTINGS[name], seed=r)
            runs[name].append(got)
            say(f"round {r + 1} preemption {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()))
    load = load.finish()

    def cell(values: list[float], digits: int) -> str:
        return (f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})")

    keys = list(runs["off"][0])
    rows = [f"| {k} | " + " | ".join(cell([run[k] for run in runs[name]], 0 if "prefilled" in k or k == "preemptions"
                                                else 2) for name in SETTINGS) + " |" for k in keys]
    section = "\n".join([
        START, "## Preemption under KV-memory pressure (benchmarks/bench_preemption.py)", "",
        run_header("benchmarks/bench_preemption.py", load), "",
        "The 110M Llama of bench_generate (random weights), INT8 dynamic with the INT8 cache, on the backend's "
        "scheduler in-process (no Triton, no HTTP; 2 threads). The KV budget holds exactly "
        f"{LONG} sequences of {LONG_PROMPT} + {LONG_TOKENS} tokens; {LONG} such long requests are submitted at once, "
        f"then {SHORT} short ones ({SHORT_PROMPT} + {SHORT_TOKENS} tokens) arrive one every {GAP:.2f} s. "
        "`preemption_wait_ms` 0 (off, the default) against 200: a request that waited 200 ms for memory evicts "
        "the running sequence with the most tokens left, which resumes by prefilling its prompt and what it had "
        f"generated. {args.rounds} rounds alternating the settings: medians, the range in brackets; times from each "
        "request's submission.", "",
        "| per run | preemption off | preemption 200 ms |", "| --- | ---: | ---: |", *rows, "", END])
    publish(section, HERE / "RESULTS.md", START, END, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
