"""Soak: the served MiniLM at fixed concurrency for 10 minutes, its memory, descriptors and threads sampled.

    .venv/bin/python benchmarks/soak.py                    # 10 min, writes RESULTS.md
    .venv/bin/python benchmarks/soak.py --seconds 60 --no-write

MiniLM (FP32 ONNX, ONNX Runtime CPU; its cost model measured at load, as in production) served by the
real bundled Triton through model-factory's backend, with the restricted admin API. Requests are
one sequence each, drawn with a fixed seed from ``benchmarks/texts.txt``, sent alternately as
``text`` and as token ids over gRPC, ``--concurrency`` in flight. Every 10 s the RSS, open
descriptors and threads of ``tritonserver`` and of the stub are read from ``/proc``
(:mod:`benchmarks.harness.soak`). Checks: zero errors, no stub restarted, RSS growth after warm-up
(``--warmup-s``, default 120 s) within 5%, descriptors and threads flat. Exit status 1 when a check
fails. The section between ``<!-- soak:start -->`` and ``<!-- soak:end -->`` of RESULTS.md is replaced.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.harness
from model_factory.measure import bench  # noqa: E402
from benchmarks.harness import soak  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # results_file.py is beside this script
from results_file import say  # noqa: E402
START, END = "<!-- soak:start -->", "<!-- soak:end -->"




def render(report: soak.SoakReport, verdict: soak.Verdict, args: argparse.Namespace, instances: int = 1) -> str:
    minutes = ["| minute | requests | errors | p50 ms | p99 ms |", "| --- | --- | --- | --- | --- |"]
    minutes += [f"| {m.minute} | {m.requests} | {m.errors} | {m.p50_ms:.1f} | {m.p99_ms:.1f} |"
                for m in report.minutes]
    samples = ["| at s | server RSS MiB | stub RSS MiB | server fds | stub fds | server threads | stub threads |",
               "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in report.samples:
        samples.append(f"| {s.at:.0f} | {s.server.rss_kib / 1024:.0f} | {sum(x.rss_kib for x in s.stubs) / 1024:.0f} | "
                       f"{s.server.fds} | {'/'.join(str(x.fds) for x in s.stubs)} | {s.server.threads} | "
                       f"{'/'.join(str(x.threads) for x in s.stubs)} |")
    checks = [f"- {'PASS' if ok else 'FAIL'} {name}: {detail}" for name, ok, detail in verdict.checks]
    return "\n".join([
        START, "## Soak: 10 minutes at fixed concurrency (benchmarks/soak.py)", "",
        f"Run {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} on {platform.node() or 'this host'} "
        f"({os.cpu_count()} CPUs, shared with other work). MiniLM FP32 ONNX on ONNX Runtime CPU, "
        f"{'one instance' if instances == 1 else f'{instances} instances (their stubs summed)'}, "
        f"gRPC, concurrency {args.concurrency}, text and token ids alternating ({report.sent_text} text, "
        f"{report.sent_ids} ids), real-text lengths; warm-up {args.warmup_s:.0f} s.", "",
        f"{report.requests} requests in {report.seconds:.0f} s ({report.requests / report.seconds:.1f}/s), "
        f"{report.errors} errors, {report.rejected} rejected; p50 {report.p50_ms:.1f} ms, p99 {report.p99_ms:.1f} ms.",
        "", *checks, "", "Per minute:", "", *minutes, "", "Every sample:", "", *samples, END])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--warmup-s", type=float, default=120.0)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args(argv)

    from benchmarks.harness.minilm import export_minilm, package_variant, start_server

    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        say("export and package")
        recipe, exported = export_minilm(Path(tmp))
        package_variant(recipe, exported)
        tok = bench.load_tokenizer(exported.tokenizer_dir, recipe.shapes.max_sequence_length)
        texts = bench.draw_texts(bench.load_texts(HERE / "texts.txt"), 2000, seed=0)
        payloads = bench.make_payloads(texts, tok)
        say("start the server")
        server = start_server(recipe.repository.path, [recipe.name])
        try:
            say(f"soak for {args.seconds:.0f} s at concurrency {args.concurrency}")
            report = soak.run_soak(server.grpc_url, recipe.name, payloads, server.process.pid,
                                   server.served_repository, concurrency=args.concurrency, seconds=args.seconds,
                                   sample_s=args.sample_s)
        finally:
            rc = server.stop()
        say(f"tritonserver exit code {rc}")
    verdict = soak.judge(report, args.warmup_s)
    section = render(report, verdict, args, recipe.repository.instance_count)
    print(section)
    if not args.no_write:
        sys.path.insert(0, str(HERE))
        from results_file import write_section

        write_section(args.results, START, END, section)
        say(f"wrote {args.results}")
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
