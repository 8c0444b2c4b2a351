"""Prefix caching on and off: one shared 1,024-token document, 32 different questions (issue 51's document Q&A).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_prefix_cache.py [--work DIR] [--rounds 1] [--write]

The 110M Llama of bench_generate (SmolLM-135M's shape, random weights; made here or reused from ``--work``), built by
the factory (``harness.scheduler_run``), runs on the backend's own scheduler in-process (``Scheduler`` over
``CausalLM`` and ``KVSlots``, 2 threads; no Triton, no HTTP: what differs between the settings is the prefix cache
alone). The first request (the document and its first question) is sent alone and runs to its end; then the 31
others (the same document, each its own question of 16-40 tokens) come in two patterns: one client, each request
sent when the one before it has ended (the time to first token of a request alone), and arriving one every ``GAP``
seconds from another thread whatever the server's state (its queueing included). Each generates ``TOKENS`` greedy tokens. Per setting: the first request's time to first
token, the later requests' TTFT p50 / p99 and their p50 over the first's, the tokens found in the cache, and whether
every request's tokens equal the same request's with the cache off. FP32 (exact: the default ``prefix_caching =
"auto"`` caches it), the graph of onnxruntime-genai's builder; with ``--int8`` also the factory's INT8 dynamic with
the INT8 cache (the precision bench_generate serves best; its outputs depend on the batch, so ``auto`` leaves the
cache off there: run with it on, to see what it would give). The section between ``<!-- prefix-cache:start -->`` and ``<!-- prefix-cache:end -->`` is replaced.
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
from benchmarks.harness.scheduler_run import llama_folder, pct, step_while_arriving  # noqa: E402

START, END = "<!-- prefix-cache:start -->", "<!-- prefix-cache:end -->"
DOCUMENT, QUESTIONS, TOKENS, GAP = 1024, 32, 16, 0.5


def workload(vocab: int, seed: int) -> tuple[list[int], list[list[int]]]:
    rng = np.random.default_rng(seed)
    document = rng.integers(10, vocab - 10, DOCUMENT).tolist()
    return document, [rng.integers(10, vocab - 10, int(rng.integers(16, 41))).tolist() for _ in range(QUESTIONS)]


def one_run(lm, spec, cached: bool, seed: int, gap: float) -> dict:
    """The workload on a fresh scheduler: timings, hits and each request's tokens."""
    from model_factory.backend.batching.grouping import CostModel
    from model_factory.backend.generation.kv_slots import KVSlots
    from model_factory.backend.generation.prefix_cache import PrefixCache, identity
    from model_factory.backend.generation.sampling import SamplingParams
    from model_factory.backend.generation.scheduler import Generation, Scheduler

    slots = KVSlots(spec, 32, 1 << 34, max_context=2048)
    cache = PrefixCache(identity(bench="prefix-cache")) if cached else None
    sched = Scheduler(lm, slots, None, spec.eos_token_ids, max_waiting=QUESTIONS, cost=CostModel(1e-3, 1e-5, 0.0),
                      cancel_check_s=0.0, prefix_cache=cache)
    document, questions = workload(spec.vocab_size, seed)
    first: dict[int, float] = {}
    params = SamplingParams(max_tokens=TOKENS, min_tokens=TOKENS, ignore_eos=True)

    def emit(gen, event) -> None:
        first.setdefault(gen.id, time.perf_counter())

    start = time.perf_counter()
    lead = sched.submit(Generation(document + questions[0], params, emit))
    while sched.has_work():
        sched.step()
    later: list = []

    if gap > 0:
        def arrivals() -> None:
            for q in questions[1:]:
                time.sleep(gap)
                later.append(sched.submit(Generation(document + q, params, emit)))

        step_while_arriving(sched, arrivals)
    else:  # one client: each request when the one before it has ended
        for q in questions[1:]:
            later.append(sched.submit(Generation(document + q, params, emit)))
            while sched.has_work():
                sched.step()
    wall = time.perf_counter() - start
    ttft = [first[g.id] - g.arrival for g in later]
    lead_ttft = first[lead.id] - lead.arrival
    return {"first TTFT (s)": lead_ttft, "later TTFT p50 (s)": pct(ttft, 0.5), "later TTFT p99 (s)": pct(ttft, 0.99),
            "later p50 / first": pct(ttft, 0.5) / lead_ttft, "wall (s)": wall,
            "tokens from the cache": float(sum(g.prefix_hit for g in [lead, *later])),
            "tokens": [g.generated for g in [lead, *later]]}


def build_engines(work: Path | None, int8: bool) -> dict[str, tuple]:
    """``{name: (spec, CausalLM)}``, 2 threads each: the 110M Llama's FP32 graph from onnxruntime-genai's builder
    (the graph the factory exports, without the build's gates: minutes less on a shared machine), and with ``int8``
    the factory's build at INT8 dynamic with the INT8 cache (``harness.scheduler_run``)."""
    import tempfile

    from model_factory.backend.contract import Files, GenerationSpec, onnx_file
    from model_factory.backend.generation.causal_lm import CausalLM
    from tests.generative_repository import build_onnx, layout_generative_model

    hf = llama_folder(work, "bench-prefix-cache-")
    onnx_dir = build_onnx(hf, hf.parent / "onnx-fp32", "fp32")
    cfg = __import__("json").loads((hf / "config.json").read_text())
    spec = GenerationSpec(family="llama", num_layers=cfg["num_hidden_layers"], num_attention_heads=cfg[
        "num_attention_heads"], num_kv_heads=cfg["num_key_value_heads"], head_dim=cfg["hidden_size"] // cfg[
        "num_attention_heads"], hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"],
        max_context=cfg["max_position_embeddings"], eos_token_ids=(int(cfg["eos_token_id"]),))
    out = {"FP32": (spec, CausalLM(onnx_dir / "model.onnx", threads=2, pad_token_id=0))}
    if int8:
        repo = Path(tempfile.mkdtemp(prefix="bench-prefix-cache-repo-"))
        vdir = layout_generative_model(hf, None, repo, "llm", precision="int8",
                                       quantization='int8_method = "dynamic"\nkv_cache = "int8"')
        run = GenerationSpec.from_json((vdir / Files.GENERATION).read_text()).for_precision("int8")
        out["INT8 dynamic + INT8 cache"] = (run, CausalLM(vdir / onnx_file("int8"), threads=2,
                                                           pad_token_id=run.pad_token_id or 0))
    return out


def one_warm(lm, spec) -> None:
    from model_factory.backend.generation.kv_slots import KVSlots

    slots = KVSlots(spec, 1, 1 << 34, max_context=2048)
    lm.prefill([[11] * 256], slots.views(0, 1))
    lm.prefill([[12] * 16], slots.views(0, 1), past=[256])


def main() -> int:
    from benchmarks.harness.run_header import LoadReading, run_header

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--int8", action="store_true", help="also the factory's INT8 dynamic + INT8 cache build (slow)")
    args = ap.parse_args()
    engines = build_engines(args.work, args.int8)
    say("warm-up")
    for spec, lm in engines.values():
        one_warm(lm, spec)
    load = LoadReading.begin()
    runs: dict[tuple[str, str], list[dict]] = {}
    patterns = {"one client": 0.0, f"one every {GAP} s": GAP}
    for r in range(args.rounds):
        for name, (spec, lm) in engines.items():
            for pattern, gap in patterns.items():
                for setting in (("off", "on") if r % 2 == 0 else ("on", "off")):
                    got = one_run(lm, spec, setting == "on", seed=r, gap=gap)
                    runs.setdefault((f"{name}, {pattern}", setting), []).append(got)
                    say(f"round {r + 1} {name} {pattern} cache {setting}: " + ", ".join(
                        f"{k} {v:.3f}" for k, v in got.items() if k != "tokens"))
    load = load.finish()
    names = list(dict.fromkeys(name for name, _ in runs))
    same = {name: all(on["tokens"] == off["tokens"] for on, off in zip(runs[(name, "on")], runs[(name, "off")]))
            for name in names}

    def cell(values: list[float], digits: int) -> str:
        if len(values) == 1:
            return f"{values[0]:.{digits}f}"
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"

    keys = [k for k in next(iter(runs.values()))[0] if k != "tokens"]
    columns = [(name, setting) for name in names for setting in ("off", "on")]
    rows = [f"| {k} | " + " | ".join(cell([run[k] for run in runs[c]], 0 if k.startswith("tokens") else 3)
                                      for c in columns) + " |" for k in keys]
    rows.append("| every request's tokens = cache off's | " + " | ".join(
        "–" if setting == "off" else ("yes" if same[name] else "no") for name, setting in columns) + " |")
    section = "\n".join([
        START, "## Prefix caching: one document, 32 questions (benchmarks/bench_prefix_cache.py)", "",
        run_header("benchmarks/bench_prefix_cache.py", load), "",
        "The 110M Llama of bench_generate (random weights) on the backend's scheduler in-process (no Triton, no HTTP; "
        f"2 threads). A {DOCUMENT}-token document and {QUESTIONS} questions of 16-40 tokens, {TOKENS} greedy tokens "
        f"each: the first request alone, to its end; then the {QUESTIONS - 1} others, from one client (each sent when "
        f"the one before it has ended) or arriving one every {GAP} s (queueing included). TTFT from "
        "each request's submission. The cache keeps a finished request's slot; a later request copies the document's "
        "keys and values (64 blocks of 16 tokens) from a kept or running slot and prefills its question alone. "
        f"{args.rounds} round(s){', medians and ranges' if args.rounds > 1 else ''}; the settings one after the "
        "other on a machine shared with other work. FP32: the graph of onnxruntime-genai's builder (the factory's "
        "export without its gates)." + (" INT8 dynamic's outputs depend on the batch (`prefix_caching = \"auto\"` "
                                        "leaves the cache off for it; on here to measure)." if args.int8 else ""), "",
        "| per run | " + " | ".join(f"{n}, cache {s}" for n, s in columns) + " |",
        "| --- | " + " | ".join("---:" for _ in columns) + " |", *rows, "", END])
    publish(section, HERE / "RESULTS.md", START, END, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
