"""Goodput under a retry storm: clients that resend at once after every 503, against the replica's knee.

    .venv/bin/python benchmarks/bench_retry_storm.py            # about 6 min on 2 cores, writes RESULTS.md
    .venv/bin/python benchmarks/bench_retry_storm.py --quick    # a smoke run, RESULTS.md untouched

MiniLM exported once (FP32), its cost measured once, packaged twice from the same files with the example's
batching (two instances, preferred batches 16/32/64), each on its own real Triton in this process:

(count)  ``shed_by = "count"``: ``max_queue_size = "auto"``, the bound sized from the measured cost to
         ``queue_budget_ms`` (300 ms) of work. Past it Triton answers 503 / UNAVAILABLE at once.
(age)    the default, ``shed_by = "age"``: Triton's queue timeout as ``serve`` derives it (the budget, at least twice
         a full launch of the longest sequences by the same cost: ``queue_bound.shed_wait_us``), the bound 8 x the
         count bound (a safety net): a request is shed when it has waited that long, not when it arrives behind a full
         queue.

The knee: closed-loop goodput (answered requests/s) at 8, 16 and 32 in flight, where nothing is shed; the best of
them is the knee's goodput. The storm: 64 and 256 clients that resend the moment they get a 503 (no back-off, as
``wrk`` or a naive retry loop does), token ids of real-text lengths over gRPC (the soak's loop). Per variant and
level: goodput, its ratio to the knee, p50 / p99 of the answered requests, attempts/s and the 503 share. Variants
alternate within each round. The section between ``<!-- retrystorm:start -->`` and ``<!-- retrystorm:end -->`` of
benchmarks/RESULTS.md is replaced.
"""

from __future__ import annotations

import argparse
import os
import statistics
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # results_file.py is beside this script
from results_file import publish, say  # noqa: E402

START, END = "<!-- retrystorm:start -->", "<!-- retrystorm:end -->"


def build(work: Path) -> dict[str, Any]:
    """Export, measure the FP32 cost once, package (count) and (age) with the same fixed cost-model constants."""
    import dataclasses

    from benchmarks.harness.minilm import export_minilm, package_variant
    from benchmarks.harness.onnx_cost import measured_queue_bound
    from model_factory.build.repository import config_to_pbtxt, read_config
    from model_factory.serving.queue_bound import derived_config

    recipe, exported = export_minilm(work, {"batching.shed_by": "age"})
    size, cost = measured_queue_bound(exported.onnx_path, recipe)
    batching = recipe.batching
    params = {"cost_model": ",".join(repr(float(x)) for x in cost)} if cost else {}
    count = dataclasses.replace(recipe, batching=dataclasses.replace(batching, max_queue_size=size))
    repos = {"count": package_variant(count, exported, work / "count", parameters=params),
             "age": package_variant(recipe, exported, work / "age", parameters=params)}
    # (age): the recipe's shed_by = "age", its queue as `serve` derives it on this machine from the same cost.
    config = work / "age" / "minilm" / "config.pbtxt"
    derived = derived_config(read_config(config.parent), cost) if cost else None
    if derived is not None:
        config.write_text(config_to_pbtxt(derived))
    policies = {k: read_config(v / "minilm").dynamic_batching.default_queue_policy for k, v in repos.items()}
    return {"repos": repos, "exported": exported, "recipe": recipe, "size": size, "cost": cost, "policies": policies}


def _goodput(r: soak.SoakReport) -> float:
    return (r.requests - r.rejected - r.errors) / r.seconds if r.seconds else 0.0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=12.0, help="length of each loaded run")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--knee", default="8,16,32", help="in-flight levels for the knee (nothing shed there)")
    ap.add_argument("--storm", default="64,256", help="in-flight levels of clients that retry at once")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (RESULTS.md untouched)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds, args.rounds, args.no_write, args.knee, args.storm = 3.0, 1, True, "8", "64"
    knee_levels = [int(x) for x in args.knee.split(",")]
    storm_levels = [int(x) for x in args.storm.split(",")]
    load = LoadReading.begin()
    from benchmarks.harness.minilm import start_server

    runs: dict[tuple[str, int], list[soak.SoakReport]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-retry-storm-") as tmp:
        b = build(Path(tmp))
        age = b["policies"]["age"]
        say(f"count bound {b['size']}, age: bound {age.max_queue_size} and "
            f"{age.default_timeout_microseconds / 1000:g} ms in the queue")
        tok = bench.load_tokenizer(b["exported"].tokenizer_dir, 128)
        stream = bench.make_payloads(bench.draw_texts(bench.load_texts(HERE / "texts.txt"), 600, seed=0), tok)
        servers = {}
        try:
            for label, repo in b["repos"].items():
                servers[label] = start_server(repo, exit_timeout_s=30)
            for i in range(args.rounds):
                order = ("count", "age") if i % 2 == 0 else ("age", "count")
                for level in knee_levels + storm_levels:
                    for label in order:
                        srv = servers[label]
                        r = soak.run_soak(srv.grpc_url, "minilm", stream, srv.process.pid, srv.served_repository,
                                          concurrency=level, seconds=args.seconds, sample_s=3600,
                                          reject_pause_s=0.0, send="ids")
                        runs.setdefault((label, level), []).append(r)
                        say(f"round {i + 1} {label} @{level}: {_goodput(r):.1f} answered/s, p99 {r.p99_ms:.0f} ms, "
                            f"503 {r.rejected}/{r.requests}, errors {r.errors}")
        finally:
            for s in servers.values():
                s.stop()

    def med(label: str, level: int, f) -> float:
        return statistics.median(f(r) for r in runs[(label, level)])

    def rng(label: str, level: int, f, fmt: str) -> str:
        values = [f(r) for r in runs[(label, level)]]
        return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"

    knee = max(med(label, level, _goodput) for label in ("count", "age") for level in knee_levels)
    knee_at = max(((label, level) for label in ("count", "age") for level in knee_levels),
                  key=lambda k: med(*k, _goodput))
    rows = ["| queue policy | in flight | answered/s | / knee | p50 ms | p99 ms (answered) | attempts/s | 503 share | "
            "errors |", "|" + " --- |" * 9]
    for level in knee_levels + storm_levels:
        for label in ("count", "age"):
            rs = runs[(label, level)]
            rows.append(
                f"| {label} | {level}{' (retry at once)' if level in storm_levels else ''} | "
                f"{rng(label, level, _goodput, '.1f')} | {med(label, level, _goodput) / knee:.2f} | "
                f"{statistics.median(r.p50_ms for r in rs):.0f} | {rng(label, level, lambda r: r.p99_ms, '.0f')} | "
                f"{med(label, level, lambda r: r.requests / r.seconds):.0f} | "
                f"{med(label, level, lambda r: r.rejected / max(r.requests, 1)):.1%} | {sum(r.errors for r in rs)} |")
    verdicts = []
    for level in storm_levels:
        for label in ("count", "age"):
            ratio = med(label, level, _goodput) / knee
            p99 = med(label, level, lambda r: r.p99_ms)
            verdicts.append(f"({label}) at {level}: {ratio:.2f}x the knee, p99 {p99:.0f} ms"
                            f" ({'meets' if ratio >= 0.9 else 'misses'} >= 0.9x)")
    budget = b["recipe"].batching.queue_budget_ms
    age = b["policies"]["age"]
    section = "\n".join([
        START, "## Goodput under a retry storm (benchmarks/bench_retry_storm.py)", "",
        run_header("benchmarks/bench_retry_storm.py", load.finish(), own_processes=3) + " MiniLM FP32, the example's "
        "batching (two instances, preferred batches 16/32/64), gRPC token ids of real-text lengths, closed loop; "
        f"{args.rounds} round(s) of {args.seconds:g} s per cell, the variants alternating; medians with (min-max).",
        "",
        f"- (count): `shed_by = \"count\"`, `max_queue_size = \"auto\"`, here {b['size']} requests (the FP32 cost measured in this run, "
        f"{budget} ms of work): past it Triton answers 503 at once.",
        f"- (age): the default, `shed_by = \"age\"` (with `max_queue_size = \"auto\"`), as `serve` derives it here: "
        f"Triton's `max_queue_size = {age.max_queue_size}` (a safety bound) and `default_timeout_microseconds = "
        f"{age.default_timeout_microseconds}`: a request is shed once it has waited "
        f"{age.default_timeout_microseconds / 1000:.0f} ms (the {budget} ms budget, or twice a full launch of the "
        f"longest sequences by the cost model, whichever is longer).",
        f"- The knee: the best goodput at {', '.join(map(str, knee_levels))} in flight, {knee:.1f} answered/s "
        f"(({knee_at[0]}) at {knee_at[1]}).", "",
        *rows, "",
        "Clients that retry at once: " + "; ".join(verdicts) + ".", END])
    publish(section, args.results, START, END, not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
