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

``--shared``: issue 51's document Q&A at one KV budget, the KV layout in blocks against slots (``kv_layout``; a block
several sequences share counted once against the budget on blocks, once per holder on slots)::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_paged_kv.py --shared [--work DIR] [--rounds 2] [--write]

The same build, its attention on the factory's INT8-cache kernel in both layouts (``int8_attention = "kernel"``; with
``kv_block_tokens`` 16 for blocks), paged admission, prefix caching on (INT8 dynamic's outputs depend on the batch,
so ``auto`` would leave it off: the tokens of the two layouts are compared, not required equal), ``SHARED_SLOTS``
slots. A first request (bench_prefix_cache's 1,024-token document and its first question) runs alone to its end, its
prefix kept; then ``QUESTIONS`` requests on the same document, each its own question of 16-40 tokens, are submitted at
once, each generating ``SHARED_TOKENS`` greedy tokens. The budget is what ``SHARED_BUDGET_SEQUENCES`` such sequences
(the document, the longest question and the tokens) commit on slots. Per run: the sequences running after the burst's
first step (admitted at once) and the most at once, output tokens/s of the burst (its submission to its last token),
TTFT p50, the last request done, the KV bytes held at most (``KVSlots.held_bytes``) against what the sequences reserve
one by one (each holder's own count), the prompt tokens prefilled, preemptions, and how many requests' tokens equal
the other layout's in the same round; before the rounds, 3 requests sent one at a time on each layout (the same
launches on both: their tokens must agree). The factory's build is kept in ``--work`` (``int8kv8-repo``) and reused.
Section ``<!-- paged-kv-shared:start -->``.

``--cold``: the same burst without the first request, on a document nobody holds yet, the prefix cache's hold-back
(``prefix_cache.PendingBlocks``) on against off (``PrefixCache.pending`` returning None), in both layouts; the same
columns and the admissions held back. Section ``<!-- paged-kv-cold:start -->``.
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
SHARED_START, SHARED_END = "<!-- paged-kv-shared:start -->", "<!-- paged-kv-shared:end -->"
SHARED_SLOTS, SHARED_BUDGET_SEQUENCES, SHARED_TOKENS, QUESTION_MAX = 32, 8, 64, 40
LAYOUTS = ("slots", "blocks")
COLD_START, COLD_END = "<!-- paged-kv-cold:start -->", "<!-- paged-kv-cold:end -->"


class _Metrics:
    """What the scheduler reports, its preemptions counted in ``counted``."""

    def __init__(self, counted: dict) -> None:
        self.counted = counted

    def preempted(self) -> None:
        self.counted["preempted"] += 1

    def prefix_held_back(self) -> None:
        self.counted["held back"] += 1

    def __getattr__(self, _name):
        return lambda *a, **k: None


def _no_hold_back():
    """A :class:`PrefixCache` without the hold-back (``pending`` None: the scheduler then admits as before it)."""
    from model_factory.backend.generation.prefix_cache import PrefixCache

    class NoHoldBack(PrefixCache):
        def pending(self):
            return None

    return NoHoldBack


class _Counting:
    """``engine`` (a CausalLM or a stand-in of it), the prompt tokens it prefills counted in ``counted``."""

    def __init__(self, engine, counted: dict) -> None:
        self.engine, self.counted = engine, counted

    def prefill(self, prompts, views, past=None, **kw):
        self.counted["prefilled"] += sum(len(p) for p in prompts)
        return self.engine.prefill(prompts, views, past=past, **kw)

    def decode(self, tokens, lengths, views, **kw):
        return self.engine.decode(tokens, lengths, views, **kw)


def shared_run(lm, spec, layout: str, seed: int, first_alone: bool = True, hold_back: bool = True) -> dict:
    """``--shared``: the document's first question alone, then the burst of questions, on a fresh scheduler over
    ``lm``'s layout; its counts, timings and every burst request's tokens. ``first_alone`` False (``--cold``): the
    burst alone, on a document nobody holds; ``hold_back`` False: the prefix cache without its hold-back (a waiting
    prompt sharing a block with one admitted in the same step is admitted at once and prefills it too, as before
    ``PendingBlocks``)."""
    from bench_prefix_cache import DOCUMENT, QUESTIONS, workload
    from model_factory.backend.generation.kv_pool import kv_storage
    from model_factory.backend.generation.kv_slots import KVSlots
    from model_factory.backend.generation.prefix_cache import PrefixCache, identity
    from model_factory.backend.generation.sampling import SamplingParams
    from model_factory.backend.generation.scheduler import Generation, Scheduler

    probe = KVSlots(spec, 1, 1 << 40, block_tokens=16)
    budget = SHARED_BUDGET_SEQUENCES * probe.bytes_for(probe.held(DOCUMENT + QUESTION_MAX + SHARED_TOKENS))
    storage = kv_storage(lm, spec, SHARED_SLOTS)
    assert (storage is not None) == (layout == "blocks"), "the engine's layout is not the one asked for"
    slots = KVSlots(spec, SHARED_SLOTS, budget, storage=storage, block_tokens=16)
    counted = {"preempted": 0, "prefilled": 0, "held back": 0}
    cache = (PrefixCache if hold_back else _no_hold_back())(identity(bench="paged-kv-shared"))
    sched = Scheduler(_Counting(lm, counted), slots, None, spec.eos_token_ids, max_waiting=QUESTIONS,
                      metrics=_Metrics(counted), cancel_check_s=0.0, prefix_cache=cache)
    document, questions = workload(spec.vocab_size, seed)
    params = SamplingParams(max_tokens=SHARED_TOKENS, min_tokens=SHARED_TOKENS, ignore_eos=True)
    times = TokenTimes()
    peak = {"held": 0, "one by one": 0}

    def step() -> None:
        sched.step()
        held = slots.held_bytes()
        assert held <= slots.budget_bytes, (held, slots.budget_bytes)
        usage = slots.usage()  # a pool's reservations and kept prefixes are whole blocks: counted exactly
        one_by_one = slots.bytes_for(usage.reserved_tokens + usage.cached_tokens) if slots.shares_blocks else held
        peak["held"] = max(peak["held"], held)
        peak["one by one"] = max(peak["one by one"], one_by_one)

    if first_alone:
        sched.submit(Generation(document + questions[0], params, times.emit))
        while sched.has_work():
            step()
    start = time.perf_counter()
    counted["prefilled"] = 0
    gens = [sched.submit(Generation(document + q, params, times.emit)) for q in questions]
    step()
    at_once = len(sched.running)
    running = [at_once]
    while sched.has_work():
        step()
        running.append(len(sched.running))
    wall = time.perf_counter() - start
    assert all(len(g.generated) == SHARED_TOKENS for g in gens)
    mib = 1 << 20
    return {"admitted at once": float(at_once), "most running at once": float(max(running)),
            "output tokens/s": sum(len(g.generated) for g in gens) / wall,
            "TTFT p50 (s)": pct(times.ttft(gens), 0.5), "last request done (s)": max(times.last.values()) - start,
            "KV held at most (MiB)": peak["held"] / mib,
            "the same counted per holder (MiB)": peak["one by one"] / mib,
            "prompt tokens prefilled": float(counted["prefilled"]), "preemptions": float(counted["preempted"]),
            "held back": float(counted["held back"]), "budget (MiB)": slots.budget_bytes / mib,
            "tokens": [g.generated for g in gens]}


def _cell(values: list[float], digits: int) -> str:
    """A table cell: the median, the range in brackets."""
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


WHOLE = {"admitted at once", "most running at once", "prompt tokens prefilled", "preemptions", "held back"}


def _shared_rows(runs: dict, columns, keys: list[str]) -> list[str]:
    """``shared_run``'s figures as table rows, one column per setting of ``columns`` (counts whole)."""
    return [f"| {k} | " + " | ".join(_cell([run[k] for run in runs[c]], 0 if k in WHOLE else 2) for c in columns)
            + " |" for k in keys]


def _layout_engines(work):
    """The INT8-cache build on the factory's kernel in both layouts (``LAYOUTS``), each warmed up once."""
    engines = {"slots": int8_kv8_engine(work, "bench-paged-kv-", int8_attention="kernel"),
               "blocks": int8_kv8_engine(work, "bench-paged-kv-", int8_attention="kernel", kv_block_tokens=16)}
    say("warm-up")
    for spec, lm in engines.values():
        shared_warm(lm, spec)
    return engines


def shared_main(args) -> int:
    """``--shared``: both layouts, rounds alternating their order, and the section."""
    from benchmarks.harness.run_header import LoadReading, run_header
    from bench_prefix_cache import DOCUMENT, QUESTIONS

    engines = _layout_engines(args.work)
    alone = {layout: one_at_a_time(lm, spec) for layout, (spec, lm) in engines.items()}
    alike = sum(a == b for a, b in zip(alone["slots"], alone["blocks"]))
    say(f"one request at a time (the same launches on both layouts): {alike} of {len(alone['slots'])} the same")
    load = LoadReading.begin()
    runs: dict[str, list[dict]] = {layout: [] for layout in LAYOUTS}
    same: list[float] = []
    for r in range(args.rounds):
        for layout in (LAYOUTS if r % 2 == 0 else tuple(reversed(LAYOUTS))):
            spec, lm = engines[layout]
            got = shared_run(lm, spec, layout, seed=r)
            runs[layout].append(got)
            say(f"round {r + 1} {layout}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items() if k != "tokens"))
        pair = [runs[layout][-1]["tokens"] for layout in LAYOUTS]
        same.append(float(sum(a == b for a, b in zip(*pair))))
    load = load.finish()

    keys = [k for k in runs["slots"][0] if k != "tokens"]
    rows = _shared_rows(runs, LAYOUTS, keys)

    def ratio(key: str) -> str:
        blocks, slots = (statistics.median(r[key] for r in runs[layout]) for layout in ("blocks", "slots"))
        return f"{blocks / slots:.2f}x"

    section = "\n".join([
        SHARED_START, "## Shared prefix blocks counted once: the KV layout in blocks against slots "
        "(benchmarks/bench_paged_kv.py --shared)", "",
        run_header("benchmarks/bench_paged_kv.py --shared", load), "",
        "The 110M Llama of bench_generate (random weights), INT8 dynamic with the INT8 cache, its attention on the "
        "factory's kernel in both layouts, on the backend's scheduler in-process (no Triton, no HTTP; 2 threads; "
        f"{SHARED_SLOTS} slots, paged admission, prefix caching on). A first request (a {DOCUMENT}-token document and "
        "its first question) runs alone, its prefix kept; then "
        f"{QUESTIONS} requests on the same document, each its own question of 16-{QUESTION_MAX} tokens, are submitted "
        f"at once, {SHARED_TOKENS} greedy tokens each. The KV budget is what {SHARED_BUDGET_SEQUENCES} such sequences "
        "commit on slots. `kv_layout` slots (a prefix-cache hit copies the document and counts it again; the kept "
        "prefix is taken over by the first question, the others wait a step for it (held back: no holder until its "
        "prefill) and then copy the document from it) against blocks (a hit shares the document's blocks, counted "
        "once; a step admits at most "
        "`max_prefill_batch`, 16, hits). "
        f"{args.rounds} rounds alternating the order: medians, the range in brackets; times from the burst's "
        "submission. 'KV held at most' is the account's figure the budget bounds (`KVSlots.held_bytes`); 'the "
        "same counted per holder' adds up each running sequence's blocks and the kept prefixes as if none were "
        "shared.", "",
        "| per run | slots | blocks |", "| --- | ---: | ---: |", *rows, "",
        f"Blocks against slots: admitted at once {ratio('admitted at once')}, most running at once "
        f"{ratio('most running at once')}, output tokens/s {ratio('output tokens/s')}, TTFT p50 "
        f"{ratio('TTFT p50 (s)')}, last request done {ratio('last request done (s)')}. Requests whose {SHARED_TOKENS} "
        f"tokens are the same in both layouts, round by round: {', '.join(f'{n:.0f}' for n in same)} of {QUESTIONS} "
        "(INT8 dynamic's activation scales are per launch: the batches differ, so the tokens do). Sent one at a "
        f"time (the same launches in both layouts: the first whole, the next two as hits on it), {alike} of "
        f"{len(alone['slots'])} requests give the same tokens.", "",
        SHARED_END])
    publish(section, HERE / "RESULTS.md", SHARED_START, SHARED_END, args.write)
    return 0


COLD_SETTINGS = (("slots", True), ("slots", False), ("blocks", True), ("blocks", False))


def cold_main(args) -> int:
    """``--cold``: the burst on a document nobody holds yet, the prefix cache's hold-back on against off, in both
    layouts; rounds rotating the order, and the section."""
    from benchmarks.harness.run_header import LoadReading, run_header
    from bench_prefix_cache import DOCUMENT, QUESTIONS

    engines = _layout_engines(args.work)
    load = LoadReading.begin()
    runs: dict[tuple[str, bool], list[dict]] = {s: [] for s in COLD_SETTINGS}
    for r in range(args.rounds):
        order = COLD_SETTINGS[r % len(COLD_SETTINGS):] + COLD_SETTINGS[:r % len(COLD_SETTINGS)]
        for layout, hold in (order if r % 2 == 0 else tuple(reversed(order))):
            spec, lm = engines[layout]
            got = shared_run(lm, spec, layout, seed=r, first_alone=False, hold_back=hold)
            runs[(layout, hold)].append(got)
            say(f"round {r + 1} {layout} hold-back {'on' if hold else 'off'}: "
                + ", ".join(f"{k} {v:.2f}" for k, v in got.items() if k != "tokens"))
    load = load.finish()
    same = {layout: sum(a == b for r_on, r_off in zip(runs[(layout, True)], runs[(layout, False)])
                        for a, b in zip(r_on["tokens"], r_off["tokens"])) for layout in LAYOUTS}

    keys = [k for k in runs[COLD_SETTINGS[0]][0] if k != "tokens"]
    rows = _shared_rows(runs, COLD_SETTINGS, keys)

    def ratio(layout: str, key: str) -> str:
        on, off = (statistics.median(r[key] for r in runs[(layout, hold)]) for hold in (True, False))
        return f"{on / off:.2f}x"

    section = "\n".join([
        COLD_START, "## A burst on a document nobody holds yet: the prefix cache's hold-back on against off "
        "(benchmarks/bench_paged_kv.py --cold)", "",
        run_header("benchmarks/bench_paged_kv.py --cold", load), "",
        "The same build and scheduler as `--shared` (the 110M Llama, random weights, INT8 dynamic with the INT8 cache, "
        f"the factory's kernel; in-process, 2 threads; {SHARED_SLOTS} slots, paged admission, prefix caching on, the "
        f"KV budget of {SHARED_BUDGET_SEQUENCES} sequences on slots), without the first request: {QUESTIONS} requests "
        f"on one {DOCUMENT}-token document nobody holds, each its own question of 16-{QUESTION_MAX} tokens, are "
        f"submitted at once, {SHARED_TOKENS} greedy tokens each. Hold-back on (`prefix_cache.PendingBlocks`, SGLang's "
        "rule: a waiting prompt that shares a whole block or more with one admitted in the same step waits a step, "
        "once, and finds it in the cache) against off (the same cache with `PrefixCache.pending` returning None: "
        "each prompt admitted in that first step prefills the document itself). "
        f"{args.rounds} rounds rotating the order: medians, the range in brackets; times from the burst's "
        "submission; 'held back' counts the admissions that waited.", "",
        "| per run | slots, hold-back on | slots, off | blocks, hold-back on | blocks, off |",
        "| --- | ---: | ---: | ---: | ---: |", *rows, "",
        "Hold-back on against off: " + "; ".join(
            f"{layout}: prompt tokens prefilled {ratio(layout, 'prompt tokens prefilled')}, TTFT p50 "
            f"{ratio(layout, 'TTFT p50 (s)')}, last request done {ratio(layout, 'last request done (s)')}, output "
            f"tokens/s {ratio(layout, 'output tokens/s')}" for layout in LAYOUTS)
        + ". Requests whose tokens are the same on and off, over all rounds: " + ", ".join(
            f"{layout} {same[layout]} of {QUESTIONS * args.rounds}" for layout in LAYOUTS)
        + " (INT8 dynamic's activation scales are per launch: different batches, different tokens).", "",
        COLD_END])
    publish(section, HERE / "RESULTS.md", COLD_START, COLD_END, args.write)
    return 0


def one_at_a_time(lm, spec, count: int = 3) -> list[list[int]]:
    """``count`` requests on the document sent one after another (each alone in its launches: the first prefilled
    whole, the others hits on it), 24 greedy tokens each; their tokens."""
    from bench_prefix_cache import workload
    from model_factory.backend.generation.kv_pool import kv_storage
    from model_factory.backend.generation.kv_slots import KVSlots
    from model_factory.backend.generation.prefix_cache import PrefixCache, identity
    from model_factory.backend.generation.sampling import SamplingParams
    from model_factory.backend.generation.scheduler import Generation, Scheduler

    slots = KVSlots(spec, 4, 1 << 30, storage=kv_storage(lm, spec, 4), block_tokens=16)
    sched = Scheduler(lm, slots, None, spec.eos_token_ids, prefix_cache=PrefixCache(identity(bench="alone")))
    document, questions = workload(spec.vocab_size, 0)
    params = SamplingParams(max_tokens=24, min_tokens=24, ignore_eos=True)
    out = []
    for q in questions[:count]:
        gen = sched.submit(Generation(document + q, params, lambda g, e: None))
        while sched.has_work():
            sched.step()
        out.append(gen.generated)
    slots.close()
    return out


def shared_warm(lm, spec) -> None:
    """One untimed prefill and decode through the layout's own storage (the kernel built, the pool's pages touched)."""
    from model_factory.backend.generation.kv_pool import kv_storage
    from model_factory.backend.generation.kv_slots import KVSlots

    warm = KVSlots(spec, 8, 1 << 40, storage=kv_storage(lm, spec, 8), block_tokens=16)
    for slot in range(8):
        warm.admit(PROMPT + 1)
    lm.prefill([[5] * PROMPT] * 8, warm.views(0, 8))
    lm.decode([5] * 8, [PROMPT] * 8, warm.views(0, 8))
    warm.clear()
    warm.close()


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
    counted = {"preempted": 0, "prefilled": 0, "held back": 0}
    ending = EndsAt(lm, spec.eos_token_ids[0], PROMPT, TEXT)
    sched = Scheduler(_Counting(ending, counted), slots, None, spec.eos_token_ids, max_waiting=REQUESTS,
                      metrics=_Metrics(counted),
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
    ap.add_argument("--shared", action="store_true", help="the document Q&A, kv_layout blocks against slots")
    ap.add_argument("--cold", action="store_true",
                    help="the burst on a document nobody holds: the prefix cache's hold-back on against off")
    args = ap.parse_args()
    if args.cold:
        return cold_main(args)
    if args.shared:
        return shared_main(args)
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

    keys = list(runs[SETTINGS[0]][0])
    whole = {"most running at once", "preemptions", "tokens prefilled again"}
    rows = [f"| {k} | " + " | ".join(_cell([run[k] for run in runs[s]], 0 if k in whole else 2) for s in SETTINGS)
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
