"""Paged KV admission against whole reservations at one KV budget: sequences of 128 + 128 tokens whose clients ask
``max_tokens`` 1024 or 128 (issue 51's "the most concurrent sequences of 128 + 128 tokens admitted, paged against
slots").

    PYTHONPATH=. .venv/bin/python benchmarks/bench_paged_kv.py [--work DIR] [--rounds 2] [--write]

The 110M Llama of bench_generate (SmolLM-135M's shape, random weights; made here or reused from ``--work``), built by
the factory at INT8 dynamic with the INT8 cache, runs on the backend's scheduler in-process (``Scheduler`` over
``CausalLM`` and ``KVSlots``, 2 threads; no Triton, no HTTP: what differs between the settings is the admission alone).
The KV budget is what ``BUDGET_SEQUENCES`` reservations of 128 + 1024 tokens commit; ``REQUESTS`` requests of a
128-token prompt are submitted at once, each text ending at its 128th generated token (``EndsAt``: end-of-sequence
made the 128th token's choice, as a model's text ends before the bound its client set), with ``max_tokens`` 1024
(a client's generous bound) or 128 (the exact length). ``kv_admission`` reserve (``prompt + max_tokens`` at
admission) against paged (blocks of 16 tokens as the sequence grows, preempting when none is left). Per run: the most
sequences running at once, the mean over decode steps, output tokens/s, time to first token p50 and the last
request's completion, the preemptions and tokens prefilled again. Rounds alternate the settings' order; medians and
ranges. The section between ``<!-- paged-kv:start -->`` and ``<!-- paged-kv:end -->`` is replaced.
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
from benchmarks.harness.scheduler_run import TokenTimes, int8_kv8_engine, pct  # noqa: E402

START, END = "<!-- paged-kv:start -->", "<!-- paged-kv:end -->"
PROMPT, TEXT, BOUND = 128, 128, 1024
BUDGET_SEQUENCES, REQUESTS, SLOTS = 8, 48, 64
SETTINGS = [("reserve", 1024), ("paged", 1024), ("reserve", 128), ("paged", 128)]


def one_run(lm, spec, admission: str, max_tokens: int, seed: int) -> dict[str, float]:
    """One burst on a fresh scheduler; its counts and timings."""
    from model_factory.backend.generation.kv_blocks import block_tokens
    from model_factory.backend.generation.kv_slots import KVSlots
    from model_factory.backend.generation.sampling import SamplingParams
    from model_factory.backend.generation.scheduler import Generation, Scheduler
    from tests.generative_repository import EndsAt

    probe = KVSlots(spec, 1, 1 << 40)
    budget = BUDGET_SEQUENCES * probe.bytes_for(PROMPT + BOUND)
    slots = KVSlots(spec, SLOTS, budget, block_tokens=block_tokens(admission))
    counted = {"preempted": 0, "prefilled": 0}

    class Metrics:  # what the scheduler reports, the preemptions counted
        def preempted(self) -> None:
            counted["preempted"] += 1

        def __getattr__(self, _name):
            return lambda *a, **k: None

    ending = EndsAt(lm, spec.eos_token_ids[0], PROMPT, TEXT)

    class Counting:  # the runtime, its prefilled tokens counted
        def prefill(self, prompts, views, past=None, **kw):
            counted["prefilled"] += sum(len(p) for p in prompts)
            return ending.prefill(prompts, views, past=past, **kw)

        def decode(self, tokens, lengths, views, **kw):
            return ending.decode(tokens, lengths, views, **kw)

    sched = Scheduler(Counting(), slots, None, spec.eos_token_ids, max_waiting=REQUESTS, metrics=Metrics(),
                      cancel_check_s=0.0)
    rng = np.random.default_rng(seed)
    times = TokenTimes()

    params = SamplingParams(max_tokens=max_tokens, min_tokens=TEXT - 1)
    start = time.perf_counter()
    gens = [sched.submit(Generation(rng.integers(10, spec.vocab_size - 10, PROMPT).tolist(), params, times.emit))
            for _ in range(REQUESTS)]
    running: list[int] = []
    while sched.has_work():
        sched.step()
        running.append(len(sched.running))
        usage = slots.usage()
        assert usage.reserved_bytes + usage.cached_bytes <= budget, usage
    wall = time.perf_counter() - start
    assert all(len(g.generated) == TEXT and g.finish_reason == "stop" for g in gens)
    tokens = sum(len(g.generated) for g in gens)
    return {"most running at once": float(max(running)), "mean running per step": statistics.fmean(running),
            "output tokens/s": tokens / wall, "TTFT p50 (s)": pct(times.ttft(gens), 0.5),
            "last request done (s)": max(times.last.values()) - start, "preemptions": float(counted["preempted"]),
            "tokens prefilled again": float(counted["prefilled"] - REQUESTS * PROMPT)}


def main() -> int:
    from benchmarks.harness.run_header import LoadReading, run_header

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    spec, lm = int8_kv8_engine(args.work, "bench-paged-kv-")
    say("warm-up")
    from model_factory.backend.generation.kv_slots import KVSlots

    warm = KVSlots(spec, 8, 1 << 40)
    lm.prefill([[5] * PROMPT] * 8, warm.views(0, 8))
    lm.decode([5] * 8, [PROMPT] * 8, warm.views(0, 8))
    warm.close()
    load = LoadReading.begin()
    runs: dict[tuple[str, int], list[dict[str, float]]] = {s: [] for s in SETTINGS}
    for r in range(args.rounds):
        order = SETTINGS if r % 2 == 0 else list(reversed(SETTINGS))
        for setting in order:
            got = one_run(lm, spec, *setting, seed=r)
            runs[setting].append(got)
            say(f"round {r + 1} {setting[0]} max_tokens {setting[1]}: "
                + ", ".join(f"{k} {v:.2f}" for k, v in got.items()))
    load = load.finish()

    def cell(values: list[float], digits: int) -> str:
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"

    keys = list(runs[SETTINGS[0]][0])
    whole = {"most running at once", "preemptions", "tokens prefilled again"}
    rows = [f"| {k} | " + " | ".join(cell([run[k] for run in runs[s]], 0 if k in whole else 2) for s in SETTINGS)
            + " |" for k in keys]

    def ratio(key: str, bound: int) -> str:
        paged = statistics.median(run[key] for run in runs[("paged", bound)])
        reserve = statistics.median(run[key] for run in runs[("reserve", bound)])
        return f"{paged / reserve:.2f}x"

    section = "\n".join([
        START, "## Paged KV admission against whole reservations (benchmarks/bench_paged_kv.py)", "",
        run_header("benchmarks/bench_paged_kv.py", load), "",
        "The 110M Llama of bench_generate (random weights), INT8 dynamic with the INT8 cache, on the backend's "
        f"scheduler in-process (no Triton, no HTTP; 2 threads; {SLOTS} slots, so the budget decides). The KV budget is "
        f"what {BUDGET_SEQUENCES} reservations of {PROMPT} + {BOUND} tokens commit; {REQUESTS} requests of a "
        f"{PROMPT}-token prompt are submitted at once, each text ending at its {TEXT}th generated token, its client "
        f"asking `max_tokens` {BOUND} or {TEXT}. `kv_admission` reserve (prompt + max_tokens at admission) against "
        "paged (blocks of 16 tokens taken as a sequence grows; when none is left, the running sequence with the "
        f"most tokens left is preempted and prefills again later). {args.rounds} rounds alternating the order: "
        "medians, the range in brackets; times from the burst's submission.", "",
        "| per run | reserve, max_tokens 1024 | paged, max_tokens 1024 | reserve, max_tokens 128 "
        "| paged, max_tokens 128 |",
        "| --- | ---: | ---: | ---: | ---: |", *rows, "",
        f"Paged against reserve, max_tokens {BOUND}: most running at once {ratio('most running at once', BOUND)}, mean "
        f"running {ratio('mean running per step', BOUND)}, output tokens/s {ratio('output tokens/s', BOUND)}; "
        f"max_tokens {TEXT}: {ratio('most running at once', TEXT)}, {ratio('mean running per step', TEXT)}, "
        f"{ratio('output tokens/s', TEXT)}.", "", END])
    publish(section, HERE / "RESULTS.md", START, END, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
