"""The autoscaling signal, proven on the real server: Triton's queue-to-compute ratio at rising load.

    .venv/bin/python benchmarks/bench_autoscaling.py            # ~3 min on 2 cores, writes RESULTS.md
    .venv/bin/python benchmarks/bench_autoscaling.py --quick    # a smoke run, RESULTS.md untouched

MiniLM (FP32 ONNX, the shipped recipe's batching) is packaged and served by the real Triton
server (the one bundled in nvidia-pytriton) through model-factory's Python backend, one
instance: one replica as the Helm chart runs it. The load is closed-loop (each of N clients
sends its next request when the previous answer arrives), with N rising step by step. Around
each step Triton's /metrics is scraped, and the prometheus-adapter rule shipped in the chart
(rendered by the real Helm engine from deploy/helm/model-factory, the rule's ``metricsQuery``
parsed by benchmarks.harness.scaling) is evaluated on the two scrapes, as Prometheus would over a
window spanning the step. The HPA's target (``autoscaling.targetQueueComputeRatio`` in the
chart's values) is read from the same rendering.

The result replaces the ``<!-- autoscaling:start -->`` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "model-factory"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
TEXTS = Path(__file__).resolve().parent / "texts.txt"
START, END = "<!-- autoscaling:start -->", "<!-- autoscaling:end -->"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def chart_rules() -> tuple[str, float, str]:
    """The adapter rules' metricsQuery (ratio, and the optional mean queue time) and the HPA's ratio target.

    Rendered with the chart's defaults plus ``autoscaling.targetMeanQueueMicroseconds`` set (so that its
    rule is rendered whatever the default); the ratio rule and target are the defaults'.
    """
    import yaml
    from helm_python import chart

    out = chart.Chart.load(CHART).render({"autoscaling": {"targetMeanQueueMicroseconds": "50000"}},
                                         name="mf", namespace="models")
    docs = [d for text in out.values() for d in yaml.safe_load_all(text) if d]
    rules = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("adapter-rules"))
    hpa = next(d for d in docs if d["kind"] == "HorizontalPodAutoscaler")
    ratio_rule, queue_rule = (r["metricsQuery"] for r in yaml.safe_load(rules["data"]["config.yaml"])["rules"])
    target = hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"]
    return ratio_rule, quantity(target), queue_rule


def chart_default_mean_queue_us() -> str:
    """``autoscaling.targetMeanQueueMicroseconds`` as the chart's values.yaml ships it ("" = off)."""
    import yaml

    return str(yaml.safe_load((CHART / "values.yaml").read_text())["autoscaling"]["targetMeanQueueMicroseconds"])


def quantity(text: str) -> float:
    """A Kubernetes quantity as the HPA reads it ("1" -> 1.0, "500m" -> 0.5)."""
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def step(server, rule, queue_rule, payloads, concurrency: int, requests: int, gap_s: float = 0.0) -> dict:
    """Drive ``concurrency`` clients for ``requests`` requests; the rule's value between the scrapes.

    ``gap_s`` > 0 (one client only): the client pauses that long after each answer, so every request
    finds the instance idle: the low-load reference, free of the closed loop's back-to-back arrivals.
    """
    from model_factory.measure.bench import run_load, settled_scrape
    from benchmarks.harness.scaling import evaluate

    metrics = server.metrics_url
    before = settled_scrape(metrics, "minilm")
    t0 = time.monotonic()
    if gap_s > 0:
        from model_factory.measure.bench import merge_results

        parts = []
        for i in range(requests):
            parts.append(run_load(server.http_url, "minilm", payloads[i:i + 1], concurrency=1, warmup=0))
            time.sleep(gap_s)
        result = merge_results(parts)
    else:
        result = run_load(server.http_url, "minilm", payloads[:requests], concurrency=concurrency, warmup=0)
    after = settled_scrape(metrics, "minilm")
    seconds = time.monotonic() - t0
    return {"concurrency": f"1, {gap_s * 1000:.0f} ms apart" if gap_s > 0 else concurrency, "ratio": evaluate(rule, before, after, seconds),
            "mean_queue_ms": evaluate(queue_rule, before, after, seconds) / 1000,
            "throughput": result.throughput, "p50_ms": result.p50_ms, "p99_ms": result.p99_ms,
            "requests": result.requests, "errors": result.errors}


def median_row(rounds: list[dict]) -> dict:
    """One level's rounds: the median of each figure, every round's ratio kept, requests and errors summed."""
    import statistics

    out = {k: statistics.median(r[k] for r in rounds)
           for k in ("ratio", "mean_queue_ms", "throughput", "p50_ms", "p99_ms")}
    return {**out, "concurrency": rounds[0]["concurrency"], "ratios": [r["ratio"] for r in rounds],
            "requests": sum(r["requests"] for r in rounds), "errors": sum(r["errors"] for r in rounds)}


def serve_minilm(work: Path):
    """Export and package the shipped MiniLM recipe (FP32), then start the real server on it."""
    from benchmarks.harness.minilm import export_minilm, package_variant, start_server

    recipe, exported = export_minilm(work)
    server = start_server(package_variant(recipe, exported))
    return server, exported.tokenizer_dir, recipe


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few steps and requests; RESULTS.md untouched")
    ap.add_argument("--levels", default="1,2,4,8,16,32,64,128,256", help="client concurrency per step")
    ap.add_argument("--seconds", type=float, default=8.0, help="about this long per step (sets the request count)")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the levels; the report takes medians")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.harness
    from results_file import write_section

    from model_factory.measure.bench import draw_texts, load_texts, load_tokenizer, make_payloads, run_load
    from benchmarks.harness.scaling import parse_ratio_rule

    query, target, queue_query = chart_rules()
    rule, queue_rule = parse_ratio_rule(query), parse_ratio_rule(queue_query)
    levels = [1, 16, 128] if args.quick else [int(x) for x in args.levels.split(",")]
    from benchmarks.harness.run_header import LoadReading

    load = LoadReading.begin()
    with tempfile.TemporaryDirectory(prefix="bench-autoscaling-") as tmp:
        server, tokenizer_dir, recipe = serve_minilm(Path(tmp))
        try:
            tokenizer = load_tokenizer(tokenizer_dir, recipe.shapes.max_sequence_length)
            payloads = make_payloads(draw_texts(load_texts(TEXTS), 20000, seed=0), tokenizer)
            # Warm-up (not measured); then the rate at full load and the latency of one client size each
            # step to about --seconds.
            run_load(server.http_url, "minilm", payloads[:128], concurrency=64, warmup=64)
            peak = run_load(server.http_url, "minilm", payloads[:256], concurrency=64, warmup=0).throughput
            alone_s = run_load(server.http_url, "minilm", payloads[:20], concurrency=1, warmup=0).p50_ms / 1000
            runs: dict[object, list[dict]] = {"paced": []}
            runs.update({c: [] for c in levels})
            for round_ in range(1 if args.quick else args.rounds):
                row = step(server, rule, queue_rule, payloads, 1, 10 if args.quick else 40, gap_s=0.05)
                runs["paced"].append(row)
                print(f"round {round_ + 1} paced single client: ratio {row['ratio']:.3f}  mean queue "
                      f"{row['mean_queue_ms']:.1f} ms  p50 {row['p50_ms']:.1f} ms", flush=True)
                for c in levels:
                    count = int(max(c * 4, 20, min(peak, c / max(alone_s, 1e-3)) * args.seconds))
                    if args.quick:
                        count = max(c * 2, 60)
                    row = step(server, rule, queue_rule, payloads, c, min(count, len(payloads)))
                    runs[c].append(row)
                    print(f"round {round_ + 1} concurrency {c:4d}: ratio {row['ratio']:.3f} (target {target:g})  "
                          f"mean queue {row['mean_queue_ms']:.1f} ms  "
                          f"{row['throughput']:.1f} seq/s  p50 {row['p50_ms']:.1f} ms  p99 {row['p99_ms']:.1f} ms  "
                          f"errors {row['errors']}", flush=True)
            rows = [median_row(runs[c]) for c in ["paced", *levels]]
        finally:
            rc = server.stop()
    assert rc == 0, f"tritonserver exited with {rc}"
    if args.quick:
        return 0
    write_section(RESULTS, START, END, report(rows, query, target, queue_query, recipe, args.rounds, load.finish()))
    print(f"wrote {RESULTS}")
    return 0


def report(rows: list[dict], query: str, target: float, queue_query: str, recipe, rounds: int, load) -> str:
    from benchmarks.harness.run_header import run_header

    instances = recipe.repository.instance_count
    default_us = chart_default_mean_queue_us()
    second = (f"on by default at \"{default_us}\" µs" if default_us else "off by default")
    peak = max(r["throughput"] for r in rows[1:])  # the paced row is not a throughput figure
    first_over = next((r["concurrency"] for r in rows if r["ratio"] > target), None)
    lines = [
        START,
        "## Autoscaling signal (Helm chart's prometheus-adapter rule on the real server)",
        "",
        run_header("benchmarks/bench_autoscaling.py", load, own_processes=3) + " "
        f"MiniLM FP32 on ONNX Runtime (CPU), {instances} instance{'s' if instances != 1 else ''} "
        f"(max batch {recipe.shapes.max_batch}, queue delay {recipe.batching.max_queue_delay_us} µs), served by the "
        "bundled Triton 2.51 through our Python backend; closed-loop clients sending token ids, rising step by step. "
        "Each step is scraped before and after, and the chart's rule, rendered by the real Helm engine, is "
        "evaluated on the two scrapes (rate = increase over the step):",
        "",
        f"`{query}`",
        "",
        f"HPA target (`autoscaling.targetQueueComputeRatio`): **{target:g}**. The optional second metric "
        f"(`autoscaling.targetMeanQueueMicroseconds`, {second}), evaluated the same way from its rule "
        f"`{queue_query}`, is the mean queue time per request (column \"mean queue ms\").",
        "",
        "| clients | queue/compute ratio | vs target | mean queue ms | seq/s | share of peak | p50 ms | "
        "p50 / p50 paced | p99 ms | requests | errors | ratio per pass |",
        "| ---: | ---: | :---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :--- |",
    ]
    base = rows[0]["p50_ms"]  # the paced single client
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['ratio']:.3f} | {'over' if r['ratio'] > target else 'under'} | "
                     f"{r['mean_queue_ms']:.1f} | {r['throughput']:.1f} | "
                     f"{'—' if isinstance(r['concurrency'], str) else format(r['throughput'] / peak, '.0%')} | "
                     f"{r['p50_ms']:.1f} | "
                     f"{r['p50_ms'] / base:.1f}x | {r['p99_ms']:.1f} | {r['requests']} | {r['errors']} | "
                     f"{', '.join(f'{x:.2f}' for x in r['ratios'])} |")
    near_peak = next(r["concurrency"] for r in rows[1:] if r["throughput"] >= 0.9 * peak)
    lines += ["", (f"The ratio first exceeds the target at {first_over} clients" if first_over else
                   "The ratio never exceeded the target in this run") +
              f"; throughput first reached 90% of its peak at {near_peak} clients.", "",
              "The first row is the low-load reference: one client that pauses 50 ms after each answer, so every "
              "request finds the instance idle. A closed-loop client sends its next request the moment an answer "
              "arrives, while the instance may still be finishing the execution that answered it; on a loaded "
              "machine that tail shows up as queue time even at one client (compare the first two rows). "
              "docs/fleet.md discusses picking the target.", END]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
