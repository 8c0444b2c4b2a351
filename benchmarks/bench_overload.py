"""Overload: at 4x the concurrency the replica can serve, a bounded queue against an unbounded one.

    .venv/bin/python benchmarks/bench_overload.py            # ~5 min on 2 cores, writes RESULTS.md
    .venv/bin/python benchmarks/bench_overload.py --quick    # a smoke run, RESULTS.md untouched

MiniLM (FP32 ONNX, ONNX Runtime CPU) served by the real bundled Triton through model-factory's
backend, packaged twice, each on its own server in this one process:

(policy)    the default: ``dynamic_batching.default_queue_policy.max_queue_size`` sized from the cost
            model measured on this machine at packaging (about ``batching.queue_budget_ms`` = 300 ms of
            work), ``REJECT`` past it: an overloaded replica answers 503 / UNAVAILABLE at once;
(unbounded) ``max_queue_size = 0``: Triton queues every request (the behaviour before this policy).

Requests are one sequence each, drawn with a fixed seed from ``benchmarks/texts.txt`` and sent as
token ids over gRPC by ``model-factory bench``'s load generator (closed loop: a rejected client sends
its next request at once, so the rejected share is of attempts). First the unloaded p99 (concurrency 1)
and the concurrency the replica can serve (the smallest of a sweep reaching 90% of the best
throughput) are measured on (policy); then both configurations run at 4x that concurrency, in
alternating order over rounds. The section between ``<!-- overload:start -->`` and
``<!-- overload:end -->`` of benchmarks/RESULTS.md is replaced.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from model_factory import bench  # noqa: E402

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "model_factory" / "examples" / "minilm.toml"
START, END = "<!-- overload:start -->", "<!-- overload:end -->"


def say(msg: str) -> None:
    print(f"[{_dt.datetime.now().strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build(work: Path) -> tuple[dict[str, Path], Any, int, tuple[float, float, float] | None]:
    """Export once; package (policy) and (unbounded) into their own repositories."""
    from model_factory.build_engines.export import export_model
    from model_factory.pipeline import measure_onnx_cost_model
    from model_factory.recipe import load_recipe
    from model_factory.repository import default_queue_size, package_model

    recipe = load_recipe(EXAMPLE, {"repository.path": str(work / "unused"), "precisions": ["fp32"]})
    exported = export_model(recipe)
    cost = measure_onnx_cost_model(exported.onnx_path, recipe)
    size = default_queue_size(recipe, cost)
    repos = {}
    for label, queue in (("policy", None), ("unbounded", 0)):
        r = dataclasses.replace(recipe, repository=dataclasses.replace(recipe.repository, path=work / label),
                                batching=dataclasses.replace(recipe.batching, max_queue_size=queue))
        package_model(r, {"model.onnx": exported.onnx_path}, tokenizer_dir=exported.tokenizer_dir, cost_model=cost)
        repos[label] = work / label
    return repos, exported, size, cost


def run(server: Any, payloads: Sequence[bench.Payload], concurrency: int, label: str, warmup: int) -> bench.BenchResult:
    return bench.run_load(server.grpc_url, "minilm", payloads, protocol="grpc", concurrency=concurrency,
                          warmup=warmup, send="ids", label=label)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=600, help="measured requests per overload run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sweep", default="1,2,4,8,16,32", help="concurrencies tried to find what the replica serves")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (RESULTS.md untouched)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.rounds, args.sweep, args.no_write = 120, 1, "4,16", True

    from model_factory.serve import ServerOptions, TritonServer

    with tempfile.TemporaryDirectory(prefix="bench-overload-") as tmp:
        work = Path(tmp)
        say("export and package")
        repos, exported, size, cost = build(work)
        say(f"queue bound from the measured cost model {cost}: {size} requests")
        tok = bench.load_tokenizer(exported.tokenizer_dir, 128)
        texts = bench.load_texts(HERE / "texts.txt")
        stream = bench.make_payloads(bench.draw_texts(texts, max(args.requests, 200), seed=0), tok)
        servers = {}
        try:
            for label, repo in repos.items():
                say(f"start {label}")
                servers[label] = TritonServer(repo, ["minilm"], ServerOptions(0, 0, 0, exit_timeout_s=30)).start()
            unloaded = run(servers["policy"], stream[:100 if not args.quick else 40], 1, "unloaded", 8)
            say(f"unloaded p99 {unloaded.p99_ms:.1f} ms")
            sweep = {}
            for c in (int(x) for x in args.sweep.split(",")):
                sweep[c] = run(servers["policy"], stream[:max(4 * c, 120)], c, f"c={c}", c)
                say(f"concurrency {c}: {sweep[c].throughput:.1f} seq/s, rejected {sweep[c].rejected}")
            best = max(r.throughput for r in sweep.values())
            serves = min(c for c, r in sweep.items() if r.throughput >= 0.9 * best)
            overload = 4 * serves
            rounds: dict[str, list[bench.BenchResult]] = {"policy": [], "unbounded": []}
            for i in range(args.rounds):
                order = ("policy", "unbounded") if i % 2 == 0 else ("unbounded", "policy")
                for label in order:
                    r = run(servers[label], stream[:args.requests], overload, label, overload)
                    rounds[label].append(r)
                    say(f"round {i + 1} {label} at {overload}: {r.throughput:.1f} seq/s, p99 {r.p99_ms:.0f} ms, "
                        f"rejected {r.rejected}/{r.requests}, errors {r.errors}")
        finally:
            for s in servers.values():
                s.stop()
        merged = {k: bench.merge_results(v) for k, v in rounds.items()}

    rows = ["| config | queue bound | seq/s (accepted) | p50 ms | p99 ms (accepted) | p99 / unloaded p99 | "
            "rejected share | errors |", "|" + " --- |" * 8]
    for label, r in merged.items():
        bound = f"{size} requests" if label == "policy" else "none (0)"
        share = r.rejected / r.requests if r.requests else 0.0
        rows.append(f"| {label} | {bound} | {r.throughput:.1f} | {r.p50_ms:.0f} | {r.p99_ms:.0f} | "
                    f"{r.p99_ms / unloaded.p99_ms:.1f}x | {share:.1%} | {r.errors} |")
    sweep_txt = ", ".join(f"c={c}: {r.throughput:.1f} seq/s" for c, r in sweep.items())
    section = "\n".join([
        START, "## Overload: a bounded queue sheds at once (benchmarks/bench_overload.py)", "",
        f"Run {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} on {platform.node() or 'this host'} "
        f"({os.cpu_count()} CPUs, shared with other work: compare only figures from this one run). MiniLM FP32 "
        "ONNX on ONNX Runtime CPU, one instance, gRPC, token ids of real-text lengths, closed loop.", "",
        f"- Unloaded (concurrency 1): p50 {unloaded.p50_ms:.1f} ms, p99 {unloaded.p99_ms:.1f} ms.",
        f"- What the replica serves: {sweep_txt}; the smallest within 90% of the best is **{serves}**, "
        f"so overload is **{overload}** in flight.",
        f"- Queue bound of (policy): {size} requests, from the cost model measured at packaging "
        f"(a, b, c = {', '.join(f'{x:.3g}' for x in cost) if cost else 'n/a'} s) and a 300 ms budget.",
        f"- {args.rounds} rounds of {args.requests} requests per configuration, alternating order.", "",
        *rows, "",
        "Rejected requests are answered 503 / UNAVAILABLE without waiting (counted by `model-factory bench` "
        "apart from errors); a client or load balancer retries them on another replica.", END])
    print(section)
    if not args.no_write:
        from results_file import write_section

        write_section(args.results, START, END, section)
        say(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
