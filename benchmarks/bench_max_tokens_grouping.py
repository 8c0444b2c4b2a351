"""Admission grouped by ``max_tokens`` against arrival order, under KV-memory pressure with short and long requests
mixed (issue 32's "grouping by max_new_tokens ... kept where measured to help, documented with the measurement
either way").

    PYTHONPATH=. .venv/bin/python benchmarks/bench_max_tokens_grouping.py [--work DIR] [--rounds 3] [--write]

The 110M Llama of bench_generate (SmolLM-135M's shape, random weights; made here or reused from ``--work``), built by
the factory at INT8 dynamic with the INT8 cache (the precision bench_generate serves best), on the backend's own
scheduler in-process (``Scheduler`` over ``CausalLM`` and ``KVSlots``, 2 threads; no Triton, no HTTP: what differs
between the settings is the admission order alone). The KV budget holds ``BUDGET_LONG`` long requests (``PROMPT``
+ ``LONG`` tokens). ``REQUESTS`` requests arrive one every ``GAP`` seconds from another thread, each short
(``SHORT`` output tokens) or long at random (half each, the same sequence in every run of a round). Settings:
``max_tokens_grouping_ms`` 0 (arrival order: the first that does not fit waits, nothing overtakes it) against
``BOUNDS`` (waiting requests taken by power-of-two bucket of ``max_tokens``, the smallest first, until one has waited
the bound). Per setting: the short and the long requests' time to first token and to their last token (p50 / p99),
all requests' mean completion time, output tokens per second. Rounds alternate the order of the settings; medians
and ranges. The section between ``<!-- max_tokens_grouping:start -->`` and ``<!-- max_tokens_grouping:end -->`` is
replaced.
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

START, END = "<!-- max_tokens_grouping:start -->", "<!-- max_tokens_grouping:end -->"
PROMPT, SHORT, LONG = 64, 32, 384
BUDGET_LONG, REQUESTS, GAP = 8, 48, 0.4  # offered about 520 output tokens/s: just past what it serves
SETTINGS = {"off (arrival order)": 0.0, "1 s": 1.0, "4 s": 4.0}


def one_run(lm, spec, grouping_s: float, seed: int) -> dict[str, float]:
    """One workload on a fresh scheduler; its timings."""
    from model_factory.backend.batching.grouping import CostModel
    from model_factory.backend.generation.kv_slots import KVSlots
    from model_factory.backend.generation.sampling import SamplingParams
    from model_factory.backend.generation.scheduler import Generation, Scheduler

    probe = KVSlots(spec, 1, 1 << 40)
    slots = KVSlots(spec, 32, BUDGET_LONG * probe.bytes_for(PROMPT + LONG))
    sched = Scheduler(lm, slots, None, spec.eos_token_ids, max_waiting=REQUESTS, cost=CostModel(1e-3, 1e-5, 0.0),
                      max_tokens_grouping_s=grouping_s, cancel_check_s=0.0)
    rng = np.random.default_rng(seed)
    kinds = rng.random(REQUESTS) < 0.5  # True: long
    prompts = [rng.integers(10, spec.vocab_size - 10, PROMPT).tolist() for _ in range(REQUESTS)]
    times = TokenTimes()

    gens: list = []

    def arrivals() -> None:
        for i in range(REQUESTS):
            n = LONG if kinds[i] else SHORT
            gens.append(sched.submit(Generation(prompts[i], SamplingParams(max_tokens=n, min_tokens=n,
                                                                           ignore_eos=True), times.emit)))
            time.sleep(GAP)

    wall = step_while_arriving(sched, arrivals)
    out: dict[str, float] = {}
    for name, want in (("short", SHORT), ("long", LONG)):
        mine = [g for g in gens if g.params.max_tokens == want]
        assert all(len(g.generated) == want for g in mine), "a request ended short"
        ttft = times.ttft(mine)
        done = times.done(mine)
        out.update({f"{name} TTFT p50 (s)": pct(ttft, 0.5), f"{name} TTFT p99 (s)": pct(ttft, 0.99),
                    f"{name} done p50 (s)": pct(done, 0.5), f"{name} done p99 (s)": pct(done, 0.99)})
    out["mean done, all (s)"] = statistics.mean(times.done(gens))
    out["output tokens/s"] = sum(len(g.generated) for g in gens) / wall
    return out


def main() -> int:
    from benchmarks.harness.run_header import LoadReading, run_header

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    spec, lm = int8_kv8_engine(args.work, "bench-grouping-")
    say("warm-up")
    one_run(lm, spec, 0.0, seed=99)
    load = LoadReading.begin()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        order = list(SETTINGS) if r % 2 == 0 else list(reversed(SETTINGS))
        for name in order:
            got = one_run(lm, spec, SETTINGS[name], seed=r)
            runs[name].append(got)
            say(f"round {r + 1} grouping {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()))
    load = load.finish()

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"

    first = next(iter(SETTINGS))
    keys = list(runs[first][0])
    rows = [f"| {k} | " + " | ".join(cell([run[k] for run in runs[name]]) for name in SETTINGS) + " |" for k in keys]
    # Each round's settings ran the same requests: the ratios against arrival order, round by round.
    paired = []
    for name in list(SETTINGS)[1:]:
        for key in ("output tokens/s", "mean done, all (s)", "short TTFT p50 (s)", "long done p99 (s)"):
            ratios = [mine[key] / base[key] for mine, base in zip(runs[name], runs[first])]
            paired.append(f"- grouping {name} / arrival order, {key}: " + ", ".join(f"{x:.2f}" for x in ratios)
                          + f" (median {statistics.median(ratios):.2f})")
    section = "\n".join([
        START, "## Admission grouped by max_tokens under KV-memory pressure (benchmarks/bench_max_tokens_grouping.py)",
        "", run_header("benchmarks/bench_max_tokens_grouping.py", load), "",
        "The 110M Llama of bench_generate (random weights), INT8 dynamic with the INT8 cache, on the backend's "
        "scheduler in-process (no Triton, no HTTP; 2 threads). The KV budget holds exactly "
        f"{BUDGET_LONG} requests of {PROMPT} + {LONG} tokens; {REQUESTS} requests of {PROMPT}-token prompts arrive "
        f"one every {GAP:.2f} s, each short ({SHORT} output tokens) or long ({LONG}) at random, half each (the same "
        "sequence for every setting of a round). `max_tokens_grouping_ms` 0 (arrival order, the default: the first "
        "request that does not fit waits and nothing overtakes it) against the bounds named: waiting requests taken "
        "by power-of-two bucket of `max_tokens`, the smallest first, until one has waited the bound. "
        f"{args.rounds} rounds alternating the order of the settings: medians, the range in brackets; times from "
        "each request's submission.", "",
        "| per run | " + " | ".join(f"grouping {n}" for n in SETTINGS) + " |",
        "| --- |" + " ---: |" * len(SETTINGS), *rows, "",
        "Round by round (each round's settings served the same requests), the setting's value over arrival order's:",
        "", *paired, "", END])
    publish(section, HERE / "RESULTS.md", START, END, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
