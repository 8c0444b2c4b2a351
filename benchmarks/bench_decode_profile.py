"""Where a decode step's time goes: a built text-generation version on the backend's own scheduler, in-process.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_decode_profile.py --version VERSION_DIR [--precision int8]
        [--streams 1,8,32] [--tokens 64] [--rounds 2] [--write]

Issue 49 asks where Gemma 3 270M's decode step goes at 8 and 32 streams (``bench_generate --model gemma3`` serves it
through Triton and the OpenAI frontend, below OpenVINO GenAI there). Here the version's graph runs as the stub runs
it: ``CausalLM`` (2 threads, spinning, the INT8-cache attention kernel where the graph's cache is INT8) under
``Scheduler`` with ``KVSlots`` and the version's tokenizer (detokenizing included), no Triton, no HTTP. ``S`` streams
submit at once (128-token prompts of word pieces, ``--tokens`` greedy tokens each, ``min_tokens`` = ``max_tokens``
and ``ignore_eos`` as bench_generate asks); only the steps that launch a decode alone are counted. Each such step is
split into the graph's launch (``CausalLM.decode``), the tokens out (``Scheduler._accept``: the sampler, the
detokenizer, the event) and the rest of the step; CPU time (every thread of the process) beside the wall time.

Two variants of the sampler, alternating round by round: greedy rows chosen in place (``Sampler._plain_greedy``,
what the backend does) and the full path forced (a copy of each row, then its argmax: what it did before).

Then one ONNX Runtime profile per row count (8 and 32 rows, ``--profile-steps`` decode steps after a 128-token
prefill): each operator type's share of the steps' kernel time and the LM head node's (the session made through
the backend's ``_cpu_session`` with ``enable_profiling`` set: a benchmark's patch, not a backend option).
The section between ``<!-- decode_profile:start -->`` and ``<!-- decode_profile:end -->`` is replaced.

``--against VERSION_DIR`` compares two builds instead (``decode_compare``): both loaded in the one process, each
round runs every stream count on both, their order alternating round by round, greedy rows in place; per build the
step's wall and CPU time (medians over a run's decode steps, then median and range over the rounds) and tokens/s,
and the second's CPU per step over the first's, round by round (no operator profile).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks.results_file import publish, say  # noqa: E402

START, END = "<!-- decode_profile:start -->", "<!-- decode_profile:end -->"
CSTART, CEND = "<!-- decode_compare:start -->", "<!-- decode_compare:end -->"
PROMPT = 128


def _engine(vdir: Path, precision: str, profile_prefix: str | None = None, int8_matmul: str = "auto"):
    """``(spec, CausalLM)`` of the version's ``precision`` as the stub loads it on a CPU (2 threads); ``int8_matmul``
    the contract's setting for grouped per-row INT8 MatMuls."""
    from model_factory.backend.contract import Files, GenerationSpec, onnx_file
    from model_factory.backend.generation.causal_lm import CausalLM, attention_kernel
    import model_factory.backend.engines.onnxruntime as engine

    spec = GenerationSpec.from_json((vdir / Files.GENERATION).read_text()).for_precision(precision)
    made = engine._cpu_session
    if profile_prefix:
        def profiled(ort, graph, opts):
            opts.enable_profiling = True
            opts.profile_file_prefix = profile_prefix
            return made(ort, graph, opts)
        engine._cpu_session = profiled
    try:
        lm = CausalLM(vdir / onnx_file(precision), threads=2, pad_token_id=spec.pad_token_id or 0,
                      int8_attention=attention_kernel("auto", spec.kv_dtype), int8_matmul=int8_matmul)
    finally:
        engine._cpu_session = made
    return spec, lm


def _prompts(tokenizer, count: int, seed: int, bos: int) -> list[list[int]]:
    vocab = tokenizer.get_vocab()
    pool = sorted(i for t, i in vocab.items() if t.startswith("\u2581") and t[1:].isalpha() and t[1:].islower())
    rng = np.random.default_rng(seed)
    return [[bos] + rng.choice(pool, PROMPT - 1).tolist() for _ in range(count)]


def scheduler_for(lm, spec, tokenizer, streams: int, length: int, max_waiting: int = 64):
    """The backend's scheduler over ``lm`` in this process, with KV room for ``streams`` sequences of ``length`` tokens
    and all of them prefilled in one group (no cancellation checks: nobody cancels here)."""
    from model_factory.backend.generation.kv_slots import KVSlots
    from model_factory.backend.generation.scheduler import Scheduler

    slots = KVSlots(spec, streams, KVSlots(spec, 1, 1 << 40).bytes_for(length) * streams)
    return Scheduler(lm, slots, tokenizer, spec.eos_token_ids, max_waiting=max_waiting, cancel_check_s=0.0,
                     max_prefill_batch=streams)


def one_run(lm, spec, tokenizer, streams: int, tokens: int, in_place: bool, seed: int) -> dict:
    """Per decode-only step: wall and CPU of the step, of its launch and of its tokens out (medians), tokens/s."""
    from model_factory.backend.generation.sampling import SamplingParams
    from model_factory.backend.generation.scheduler import Generation

    sched = scheduler_for(lm, spec, tokenizer, streams, PROMPT + tokens)
    clock = {"launch": 0.0, "launch_cpu": 0.0, "accept": 0.0, "accept_cpu": 0.0, "prefill": False}
    decode, prefill, accept = lm.decode, lm.prefill, sched._accept

    def timed(key, fn):
        def run(*a, **k):
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **k)
            finally:
                clock[key] += time.perf_counter() - w
                clock[key + "_cpu"] += time.process_time() - c
        return run

    def prefilled(*a, **k):
        clock["prefill"] = True
        return prefill(*a, **k)

    lm.decode, lm.prefill = timed("launch", decode), prefilled
    sched._accept = timed("accept", accept)
    out = {"tokens": 0}
    params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
    bos = spec.bos_token_id if spec.bos_token_id is not None else 2
    for prompt in _prompts(tokenizer, streams, seed, bos):
        gen = sched.submit(Generation(prompt, params, lambda g, e: out.__setitem__(
            "tokens", out["tokens"] + (e.token is not None))))
        gen.sampler._plain = gen.sampler._plain and in_place
    rows = []
    start = time.perf_counter()
    try:
        while sched.has_work():
            for key in ("launch", "launch_cpu", "accept", "accept_cpu"):
                clock[key] = 0.0
            clock["prefill"] = False
            w, c = time.perf_counter(), time.process_time()
            sched.step()
            if not clock["prefill"] and clock["launch"] > 0:
                rows.append((time.perf_counter() - w, time.process_time() - c, clock["launch"], clock["launch_cpu"],
                             clock["accept"], clock["accept_cpu"]))
    finally:
        lm.decode, lm.prefill = decode, prefill
    wall = time.perf_counter() - start
    med = [statistics.median(col) * 1000 for col in zip(*rows)]
    return {"steps": len(rows), "step": med[0], "step_cpu": med[1], "launch": med[2], "launch_cpu": med[3],
            "accept": med[4], "accept_cpu": med[5], "tps": out["tokens"] / wall}


def op_profile(vdir: Path, precision: str, rows: int, steps: int) -> dict:
    """Each operator type's share of ``steps`` decode steps' kernel time at ``rows`` rows, and the LM head node's."""
    from model_factory.backend.generation.kv_slots import KVSlots

    prefix = tempfile.mkdtemp(prefix="decode-profile-") + "/ort"
    spec, lm = _engine(vdir, precision, prefix)
    slots = KVSlots(spec, rows, KVSlots(spec, 1, 1 << 40).bytes_for(PROMPT + steps + 1) * rows)
    for _ in range(rows):
        slots.admit(PROMPT + steps + 1)
    views = slots.views(0, rows)
    rng = np.random.default_rng(rows)
    lm.prefill([rng.integers(1000, 9000, PROMPT).tolist() for _ in range(rows)], views)
    for s in range(steps):
        lm.decode(rng.integers(1000, 9000, rows).tolist(), [PROMPT + s] * rows, views)
    events = json.loads(Path(lm.session.end_profiling()).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"][-steps:]
    first = runs[0]["ts"]
    by_op: collections.Counter = collections.Counter()
    by_node: collections.Counter = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= first:
            by_op[e["args"]["op_name"]] += e["dur"]
            by_node[e["name"].removesuffix("_kernel_time")] += e["dur"]
    kernels = sum(by_op.values())
    head = sum(v for k, v in by_node.items() if k.startswith("/lm_head/"))
    down = sum(v for k, v in by_node.items() if "down_proj" in k)
    down_ops = sorted({e["args"]["op_name"] for e in events if e.get("cat") == "Node"
                       and "down_proj" in e["name"] and e["name"].endswith("_kernel_time")})
    lm.close()
    return {"run_ms": sum(r["dur"] for r in runs) / steps / 1000, "kernel_ms": kernels / steps / 1000,
            "ops": {k: v / kernels for k, v in by_op.most_common()}, "lm_head": head / kernels,
            "down_proj": down / kernels, "down_ops": down_ops, "attention": lm.attention}


def main() -> int:
    from tokenizers import Tokenizer

    from benchmarks.harness.run_header import LoadReading, run_header

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", required=True, help="a built version folder (model.<precision>.onnx, generation.json)")
    ap.add_argument("--precision", default="int8")
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile-rows", default="8,32")
    ap.add_argument("--profile-steps", type=int, default=6)
    ap.add_argument("--against", help="a second built version: the two compared round by round (decode_compare)")
    ap.add_argument("--labels", default="A,B", help="the two versions' names in the compare table")
    ap.add_argument("--int8-matmul", default="auto,auto",
                    help="the contract's int8_matmul for the version and --against (a comma pair; the same version "
                         "twice with onnxruntime,auto compares the per-row MatMuls' standard ops with the kernel)")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    vdir = Path(args.version)
    load = LoadReading.begin()
    tokenizer = Tokenizer.from_file(str(vdir / "tokenizer" / "tokenizer.json"))
    tokenizer.no_padding()
    if args.against:
        return compare(args, vdir, Path(args.against), tokenizer, load)
    spec, lm = _engine(vdir, args.precision, int8_matmul=args.int8_matmul.split(",")[0])
    say(f"{vdir}: {args.precision}, attention {lm.attention}; per-row MatMuls {lm.matmul or '-'}")
    one_run(lm, spec, tokenizer, 2, 4, True, 99)  # warm
    results: dict = collections.defaultdict(list)
    for r in range(args.rounds):
        for streams in (int(s) for s in args.streams.split(",")):
            order = (True, False) if r % 2 == 0 else (False, True)
            for in_place in order:
                got = one_run(lm, spec, tokenizer, streams, args.tokens, in_place, seed=r * 100 + streams)
                results[(streams, in_place)].append(got)
                say(f"round {r + 1} streams {streams} {'in place' if in_place else 'copy'}: {got}")
    lm.close()
    profiles = {}
    for rows in (int(x) for x in args.profile_rows.split(",")):
        profiles[rows] = op_profile(vdir, args.precision, rows, args.profile_steps)
        say(f"profile {rows} rows: {profiles[rows]}")

    def cell(runs: list[dict], key: str, fmt: str = "{:.1f}") -> str:
        values = [x[key] for x in runs]
        mid = fmt.format(statistics.median(values))
        return mid if len(values) == 1 else f"{mid} ({fmt.format(min(values))}-{fmt.format(max(values))})"

    lines = [START, "## Where a decode step goes, in-process (`decode_profile`)", "",
             run_header("benchmarks/bench_decode_profile.py", load.finish()), "",
             f"`{vdir}` at `{args.precision}` on the backend's scheduler in-process (CausalLM, 2 threads, attention: "
             f"{profiles and next(iter(profiles.values()))['attention']}); {PROMPT}-token prompts submitted at once, "
             f"{args.tokens} greedy tokens each (min_tokens = max_tokens, ignore_eos), the version's tokenizer "
             f"detokenizing; medians over the decode-only steps of each run, then the median (range) over "
             f"{args.rounds} rounds; CPU = every thread of the process (ONNX Runtime's spinning threads included).", "",
             "| streams | greedy rows | step ms | launch ms | tokens out ms | rest ms | launch share | step CPU ms "
             "| launch CPU ms | tokens out CPU ms | tokens/s |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (streams, in_place), runs in sorted(results.items(), key=lambda kv: (kv[0][0], not kv[0][1])):
        for x in runs:
            x["rest"] = x["step"] - x["launch"] - x["accept"]
            x["share"] = 100 * x["launch"] / x["step"]
        lines.append(f"| {streams} | {'in place (now)' if in_place else 'copied (before)'} | {cell(runs, 'step')} | "
                     f"{cell(runs, 'launch')} | {cell(runs, 'accept', '{:.2f}')} | {cell(runs, 'rest', '{:.2f}')} | "
                     f"{cell(runs, 'share', '{:.0f}')} % | {cell(runs, 'step_cpu')} | {cell(runs, 'launch_cpu')} | "
                     f"{cell(runs, 'accept_cpu', '{:.2f}')} | {cell(runs, 'tps')} |")
    ops = sorted({op for p in profiles.values() for op in p["ops"]},
                 key=lambda op: -max(p["ops"].get(op, 0.0) for p in profiles.values()))[:10]
    rows = sorted(profiles)
    lines += ["", f"ONNX Runtime's profile of {args.profile_steps} decode steps after a {PROMPT}-token prefill "
              "(share of the steps' kernel time; one run per row count):", "",
              "| | " + " | ".join(f"{r} rows" for r in rows) + " |", "| --- |" + " ---: |" * len(rows),
              "| model_run ms / step | " + " | ".join(f"{profiles[r]['run_ms']:.1f}" for r in rows) + " |",
              "| **LM head node** (`/lm_head/`) | " + " | ".join(f"{100 * profiles[r]['lm_head']:.1f} %" for r in rows)
              + " |",
              f"| down_proj nodes ({', '.join(profiles[rows[0]]['down_ops'])}) | "
              + " | ".join(f"{100 * profiles[r]['down_proj']:.1f} %" for r in rows) + " |"]
    for op in ops:
        lines.append(f"| {op} | " + " | ".join(f"{100 * profiles[r]['ops'].get(op, 0.0):.1f} %" for r in rows) + " |")
    lines.append(END)
    publish("\n".join(lines), HERE / "RESULTS.md", START, END, args.write)
    return 0


def compare(args, a: Path, b: Path, tokenizer, load) -> int:
    """Two versions' decode steps round by round, their order alternating (``--against``)."""
    from benchmarks.harness.run_header import run_header

    labels = args.labels.split(",")
    kernels = args.int8_matmul.split(",")
    engines = [_engine(a, args.precision, int8_matmul=kernels[0]), _engine(b, args.precision, int8_matmul=kernels[-1])]
    for label, (_spec, lm) in zip(labels, engines):
        say(f"{label}: attention {lm.attention}; per-row MatMuls {lm.matmul or '-'}")
    for spec, lm in engines:
        one_run(lm, spec, tokenizer, 2, 4, True, 99)  # warm
    results: dict = collections.defaultdict(list)
    for r in range(args.rounds):
        for streams in (int(x) for x in args.streams.split(",")):
            for v in ((0, 1) if r % 2 == 0 else (1, 0)):
                spec, lm = engines[v]
                got = one_run(lm, spec, tokenizer, streams, args.tokens, True, seed=r * 100 + streams)
                results[(streams, v)].append(got)
                say(f"round {r + 1} streams {streams} {labels[v]}: {got}")
    for _spec, lm in engines:
        lm.close()

    def cell(values: list[float], fmt: str = "{:.1f}") -> str:
        mid = fmt.format(statistics.median(values))
        return mid if len(values) == 1 else f"{mid} ({fmt.format(min(values))}-{fmt.format(max(values))})"

    lines = [CSTART, "## Two builds' decode steps, in-process (`decode_compare`)", "",
             run_header("benchmarks/bench_decode_profile.py --against", load.finish()), "",
             f"{labels[0]}: `{a}`; {labels[1]}: `{b}`; both at `{args.precision}`, loaded in one process, on the "
             f"backend's scheduler (CausalLM, 2 threads, attention {engines[0][1].attention}; per-row INT8 MatMuls "
             f"{labels[0]}: {engines[0][1].matmul or '-'}, {labels[1]}: {engines[1][1].matmul or '-'}); "
             f"{PROMPT}-token prompts "
             f"submitted at once, {args.tokens} greedy tokens each; {args.rounds} rounds, each running every stream "
             "count on both builds, their order alternating round by round; per run the medians over its decode-only "
             "steps, then the median (range) over the rounds; CPU = every thread of the process. Ratio: "
             f"{labels[1]}'s step CPU over {labels[0]}'s in the same round.", "",
             "| streams | build | step ms | step CPU ms | launch CPU ms | tokens/s | step CPU ratio |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for streams in sorted({k[0] for k in results}):
        ratios = [y["step_cpu"] / x["step_cpu"] for x, y in zip(results[(streams, 0)], results[(streams, 1)])]
        for v in (0, 1):
            runs = results[(streams, v)]
            lines.append(f"| {streams} | {labels[v]} | {cell([x['step'] for x in runs])} | "
                         f"{cell([x['step_cpu'] for x in runs])} | {cell([x['launch_cpu'] for x in runs])} | "
                         f"{cell([x['tps'] for x in runs])} | {cell(ratios, '{:.3f}') if v else ''} |")
    lines.append(CEND)
    publish("\n".join(lines), HERE / "RESULTS.md", CSTART, CEND, args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
