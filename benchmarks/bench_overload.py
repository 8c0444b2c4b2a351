"""Overload: at 4x the concurrency the replica can serve, a bounded queue against an unbounded one.

    .venv/bin/python benchmarks/bench_overload.py            # ~8 min on 2 cores, writes RESULTS.md
    .venv/bin/python benchmarks/bench_overload.py --quick    # a smoke run, RESULTS.md untouched

MiniLM (FP32 ONNX, ONNX Runtime CPU) served by the real bundled Triton through model-factory's
backend, packaged three times, each on its own server in this one process:

(policy)        the bound ``max_queue_size = "auto"`` (the default with two or more instances) gives:
                ``dynamic_batching.default_queue_policy.max_queue_size`` sized from the cost model
                measured on this machine at packaging (about ``batching.queue_budget_ms`` = 300 ms of
                work), ``REJECT`` past it: an overloaded replica answers 503 / UNAVAILABLE at once
                (written as a number, so that ``--instances 1`` gets it too);
(policy-inline) the same bound, with the backend's responses returned from ``execute()``
                (``respond_after_return = false``), as before ``deferred_responses``: the A/B of the
                lost batcher wake-up that sending after the return avoids;
(unbounded)     ``max_queue_size = 0``: Triton queues every request.

All run ``--instances`` model instances (2, the default; on a CPU they split the cores), and the cost
model measured once at packaging as fixed constants, so they split windows alike.

Requests are one sequence each, drawn with a fixed seed from ``benchmarks/texts.txt``. First the
unloaded p99 (concurrency 1) and the concurrency the replica can serve (the smallest of a sweep reaching
90% of the best throughput) are measured on (unbounded), and the unloaded latency on (policy) beside it,
with ``model-factory bench``'s load generator (token ids, gRPC). Then the configurations run for the same wall time at 4x that concurrency and at twice
what the replica admits when its queue is full (the bound, plus a window of the largest preferred batch in
each instance: Triton's bound counts only requests not yet handed to an instance), in alternating order over rounds, with the soak's load loop
(:func:`benchmarks.harness.soak.run_soak` with token ids only — Triton batches only requests with the same
input names, so a text/ids mix runs nearly every request alone —, rejections counted apart from errors; closed loop, where a rejected client waits one unloaded p50 before its next request, as one
that retried on another replica would be away; the rejected share is of attempts). The section between ``<!-- overload:start -->`` and
``<!-- overload:end -->`` of benchmarks/RESULTS.md is replaced.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.harness
from model_factory.measure import bench  # noqa: E402
from benchmarks.harness import soak  # noqa: E402
from benchmarks.harness.run_header import LoadReading, run_header  # noqa: E402


def accepted(r: "soak.SoakReport") -> int:
    return r.requests - r.rejected - r.errors


def merge(reports: "list[soak.SoakReport]") -> "soak.SoakReport":
    """Rounds of one configuration pooled: totals add up, percentiles over all latencies."""
    return soak.SoakReport(sum(r.seconds for r in reports), sum(r.requests for r in reports),
                           sum(r.errors for r in reports), sum(r.rejected for r in reports),
                           [m for r in reports for m in r.error_messages][:5], [], [],
                           latencies_ms=[x for r in reports for x in r.latencies_ms])

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # results_file.py is beside this script
from results_file import say  # noqa: E402
START, END = "<!-- overload:start -->", "<!-- overload:end -->"




def build(work: Path, instances: int = 2, preferred: list[int] | None = None
          ) -> tuple[dict[str, Path], Any, int, tuple[float, float, float] | None, Any]:
    """Export once; package (policy) and (unbounded) into their own repositories."""
    from benchmarks.harness.minilm import export_minilm, package_variant
    from benchmarks.harness.onnx_cost import measure_onnx_cost_model
    from model_factory.build.repository import fallback_queue_size
    from model_factory.serving.queue_bound import queue_size

    overrides: dict[str, Any] = {"repository.instance_count": instances}
    if preferred:
        overrides["batching.preferred_batch_sizes"] = preferred
    recipe, exported = export_minilm(work, overrides)
    cost = measure_onnx_cost_model(exported.onnx_path, recipe)
    shapes = recipe.shapes
    size = (queue_size(cost, max_batch=shapes.max_batch, length=(shapes.sequence_buckets or (shapes.max_sequence_length,))[0],
                       preferred=recipe.batching.preferred_batch_sizes, budget_ms=recipe.batching.queue_budget_ms)
            if cost else None) or fallback_queue_size(recipe)
    repos = {}
    for label, queue, inline in (("policy", size, False), ("policy-inline", size, True), ("unbounded", 0, False)):
        r = dataclasses.replace(recipe, batching=dataclasses.replace(recipe.batching, max_queue_size=queue))
        # All servers split with the same constants: measured at each load on a busy machine they differ
        # by up to 13x, and the comparison would be of two cost models instead of two queue policies.
        params = {"cost_model": ",".join(repr(float(x)) for x in cost)} if cost else {}
        if inline:  # the responses returned from execute(), as before deferred_responses
            params["respond_after_return"] = "false"
        repos[label] = package_variant(r, exported, work / label, parameters=params)
    return repos, exported, size, cost, recipe


def run(server: Any, payloads: Sequence[bench.Payload], concurrency: int, label: str, warmup: int) -> bench.BenchResult:
    return bench.run_load(server.grpc_url, "minilm", payloads, protocol="grpc", concurrency=concurrency,
                          warmup=warmup, send="ids", label=label)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each overload run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backoff-s", type=float, default=1.0, help="retry back-off of a rejected client (policy+backoff)")
    ap.add_argument("--sweep", default="1,2,4,8,16,32,64", help="concurrencies tried to find what the replica serves")
    ap.add_argument("--instances", type=int, default=2,
                    help="model instances of both servers (2, the default; any other count gets its own RESULTS section)")
    ap.add_argument("--preferred", default="", help="preferred batch sizes of both servers, e.g. 8,16 "
                    "(default: the example recipe's); windows under overload are cut at the largest")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (RESULTS.md untouched)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds, args.rounds, args.sweep, args.no_write = 5.0, 1, "4,16", True
    # Other instance counts and preferred sizes get a section of their own beside the default's.
    load = LoadReading.begin()
    tag = "".join([f"-{args.instances}" if args.instances != 2 else "",
                   f"-preferred-{args.preferred.replace(',', '-')}" if args.preferred else ""])
    start, end = (START, END) if not tag else (f"<!-- overload{tag}:start -->", f"<!-- overload{tag}:end -->")

    from benchmarks.harness.minilm import start_server

    with tempfile.TemporaryDirectory(prefix="bench-overload-") as tmp:
        work = Path(tmp)
        say("export and package")
        preferred = [int(x) for x in args.preferred.split(",")] if args.preferred else None
        repos, exported, size, cost, recipe = build(work, args.instances, preferred)
        say(f"queue bound from the measured cost model {cost}: {size} requests")
        tok = bench.load_tokenizer(exported.tokenizer_dir, 128)
        texts = bench.load_texts(HERE / "texts.txt")
        stream = bench.make_payloads(bench.draw_texts(texts, 600, seed=0), tok)
        servers = {}
        try:
            for label, repo in repos.items():
                say(f"start {label}")
                servers[label] = start_server(repo, exit_timeout_s=30)
            # The replica's own latency and capacity come from the unbounded server: with a queue policy
            # Triton 2.51's batcher loses wake-ups at low load (RESULTS.md, "Overload"), which would set the
            # baseline by the defect. The policy server's unloaded latency is measured beside it.
            few = stream[:200 if not args.quick else 40]
            unloaded = run(servers["unbounded"], few, 1, "unloaded", 8)
            unloaded_policy = run(servers["policy"], few, 1, "unloaded (policy)", 8)
            say(f"unloaded p99 {unloaded.p99_ms:.1f} ms, with the policy {unloaded_policy.p99_ms:.1f} ms")
            sweep = {}
            for c in (int(x) for x in args.sweep.split(",")):
                sweep[c] = run(servers["unbounded"], stream[:max(4 * c, 120)], c, f"c={c}", c)
                say(f"concurrency {c}: {sweep[c].throughput:.1f} seq/s, rejected {sweep[c].rejected}")
            best = max(r.throughput for r in sweep.values())
            serves = min(c for c, r in sweep.items() if r.throughput >= 0.9 * best)
            overload = 4 * serves
            # 4x what the replica serves; and twice what it admits with a full queue, where the bound must act.
            admits = size + args.instances * max(recipe.batching.preferred_batch_sizes or (recipe.shapes.max_batch,))
            levels = sorted({overload, max(overload, 2 * admits)})
            # A rejected client retries elsewhere: away from this replica for about one unloaded request
            # (policy), or for a client's retry back-off of --backoff-s (policy+backoff).
            pauses = {"policy": unloaded.p50_ms / 1e3, "policy+backoff": args.backoff_s,
                      "policy-inline+backoff": args.backoff_s, "unbounded": 0.0}
            rounds: dict[tuple[str, int], list[soak.SoakReport]] = {}
            for i in range(args.rounds):
                order = list(pauses) if i % 2 == 0 else list(reversed(pauses))
                for level in levels:
                    for label in order:
                        # The same wall time for all: rejections return at once, so a count of requests
                        # would leave (policy) with a handful of accepted ones.
                        srv = servers[label.split("+")[0]]
                        r = soak.run_soak(srv.grpc_url, "minilm", stream, srv.process.pid, srv.served_repository,
                                          concurrency=level, seconds=args.seconds, sample_s=3600,
                                          reject_pause_s=pauses[label], send="ids")
                        rounds.setdefault((label, level), []).append(r)
                        say(f"round {i + 1} {label} at {level}: {accepted(r) / r.seconds:.1f} seq/s accepted, "
                            f"p99 {r.p99_ms:.0f} ms, rejected {r.rejected}/{r.requests}, errors {r.errors}")
        finally:
            for s in servers.values():
                s.stop()
        merged = {k: merge(v) for k, v in rounds.items()}

    rows = ["| in flight | config | queue bound | seq/s (accepted) | p50 ms | p99 ms (accepted) | "
            "p99 / unloaded p99 | rejected share | errors |", "|" + " --- |" * 9]
    for (label, level), r in sorted(merged.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        bound = "none (0)" if label == "unbounded" else f"{size} requests"
        share = r.rejected / r.requests if r.requests else 0.0
        rows.append(f"| {level} | {label} | {bound} | {accepted(r) / r.seconds:.1f} | {r.p50_ms:.0f} | "
                    f"{r.p99_ms:.0f} | {r.p99_ms / unloaded.p99_ms:.1f}x | {share:.1%} | {r.errors} |")
    sweep_txt = ", ".join(f"c={c}: {r.throughput:.1f} seq/s" for c, r in sweep.items())
    section = "\n".join([
        start, "## Overload: a bounded queue sheds at once (benchmarks/bench_overload.py"
        + (f" --instances {args.instances}" if args.instances != 2 else "")
        + (f" --preferred {args.preferred}" if args.preferred else "") + ")", "",
        run_header("benchmarks/bench_overload.py", load.finish(), own_processes=4) + " MiniLM FP32 "
        f"ONNX on ONNX Runtime CPU, {'one instance' if args.instances == 1 else f'{args.instances} instances'} "
        "per server (the backend splits the cores between them), gRPC, token ids of real-text lengths, closed loop.", "",
        f"- Unloaded (concurrency 1, the unbounded server): p50 {unloaded.p50_ms:.1f} ms, p99 {unloaded.p99_ms:.1f} ms; "
        f"the same on the (policy) server: p50 {unloaded_policy.p50_ms:.1f} ms, p99 {unloaded_policy.p99_ms:.1f} ms. "
        "*p99 / unloaded p99* below divides by the unbounded server's.",
        f"- What the replica serves (unbounded server): {sweep_txt}; the smallest within 90% of the best is **{serves}**, "
        f"so overload is **{overload}** in flight (4x); a second level, {levels[-1]} in flight, is twice what the "
        f"replica admits with a full queue ({admits}: the bound and a window of the largest preferred batch in each "
        "instance), where the bound must act.",
        f"- Preferred batch sizes {list(recipe.batching.preferred_batch_sizes)}, max batch {recipe.shapes.max_batch}: "
        "with a long queue Triton cuts each window at the largest preferred size.",
        f"- Queue bound of (policy): {size} requests, from the cost model measured at packaging "
        f"(a, b, c = {', '.join(f'{x:.3g}' for x in cost) if cost else 'n/a'} s) and a 300 ms budget; both "
        "servers split windows with these same fixed constants.",
        f"- {args.rounds} rounds of {args.seconds:.0f} s per configuration and level, alternating order, token ids "
        "only (the soak's load loop with send=ids: Triton batches only requests with the same inputs). A rejected client waits before its next request, as one "
        f"that retried on another replica: one unloaded p50 in (policy), {args.backoff_s:g} s (a client's "
        "retry back-off) in (policy+backoff) and (policy-inline+backoff), the latter with the responses returned "
        "from execute() (the A/B of sending them after the return). The rejected share is of attempts. Client and server share "
        "these 2 cores: every rejection the client makes and the server answers takes CPU from the model.", "",
        *rows, "",
        "Rejected requests are answered 503 / UNAVAILABLE without waiting (counted by `model-factory bench` "
        "apart from errors); a client or load balancer retries them on another replica.", end])
    from results_file import publish

    publish(section, args.results, start, end, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
