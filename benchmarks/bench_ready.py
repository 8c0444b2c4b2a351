"""``serve`` → READY of the README's example (MiniLM, the default package: queue bound ``auto``), median of 5 starts.

    .venv/bin/python benchmarks/bench_ready.py            # ~1 min on 2 cores, writes RESULTS.md
    .venv/bin/python benchmarks/bench_ready.py --quick    # 2 starts each, RESULTS.md untouched

Each start is ``start_verified_server`` (what ``model-factory serve`` runs) until it returns with the model
loaded, then a stop. Two kinds, alternating:

(no cost cache)   ``serve --no-cost-cache``: the queue bound's cost model is measured in a child process at
                  every start, and each instance runs its short warm-up;
(cost cache)      ``serve`` as it runs by default (a cost cache folder): after one priming start, the measured
                  cost and the learned constants are read back, and nothing is measured.

and the same two through the command itself: ``model-factory serve REPO --allow-unsigned`` as a child process,
timed from its launch until ``/v2/models/minilm/ready`` answers 200 (its imports and the verification included),
then SIGTERM.

The section between ``<!-- ready:start -->`` and ``<!-- ready:end -->`` of RESULTS.md is replaced.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from results_file import machine_header, publish, say  # noqa: E402

EXAMPLE = HERE.parent / "model_factory" / "examples" / "minilm.toml"
START, END = "<!-- ready:start -->", "<!-- ready:end -->"
TARGET_S = 3.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 starts each; RESULTS.md untouched")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args()
    starts = 2 if args.quick else args.starts

    from model_factory.build.repository import package_model
    from model_factory.build_engines.export import export_model
    from model_factory.recipe import load_recipe
    from model_factory.serving.server import ServerOptions, start_verified_server

    work = Path(tempfile.mkdtemp(prefix="bench-ready-"))
    try:
        recipe = load_recipe(EXAMPLE, {"repository.path": str(work / "repo"), "precisions": ["fp32"]})
        recipe = replace(recipe, work_dir=work / "build")
        say("exporting MiniLM (FP32)")
        exported = export_model(recipe)
        package_model(recipe, {"model.onnx": exported.onnx_path}, tokenizer_dir=exported.tokenizer_dir)
        cache = work / "cost-cache"

        def start(cached: bool, n: int) -> float:
            t0 = time.perf_counter()
            server, report = start_verified_server(work / "repo", ServerOptions(0, 0, 0), None, allow_unsigned=True,
                                                   log_file=work / f"triton-{cached}-{n}.log",
                                                   cost_cache=cache if cached else None)
            seconds = time.perf_counter() - t0
            try:
                if report.served != (recipe.name,) or recipe.name not in report.queue_costs:
                    raise SystemExit(f"the model did not load with a derived queue bound: {report.refused}")
            finally:
                server.stop()
            return seconds

        def start_cli(cached: bool, n: int) -> float:
            import signal
            import subprocess
            import urllib.request

            from model_factory.serving.server import free_ports

            http, grpc, metrics = free_ports(3)
            cmd = [str(Path(sys.executable).parent / "model-factory"), "serve", str(work / "repo"), "--allow-unsigned",
                   "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                   "--watch-interval", "0"] + ([] if cached else ["--no-cost-cache"])
            env = {**os.environ, "MODEL_FACTORY_COST_CACHE": str(cache)}
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                while True:
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/{recipe.name}/ready",
                                                    timeout=1) as r:
                            if r.status == 200:
                                return time.perf_counter() - t0
                    except OSError:
                        pass
                    if proc.poll() is not None or time.perf_counter() - t0 > 120:
                        raise SystemExit(f"model-factory serve exited {proc.returncode} before READY")
                    time.sleep(0.02)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)

        first = start(True, -1)  # primes the cache: the cost measured, the instances' constants saved at unload
        say(f"first start with an empty cache: {first:.2f} s")
        times: dict[bool, list[float]] = {False: [], True: []}
        cli: dict[bool, list[float]] = {False: [], True: []}
        for n in range(starts):
            for cached in ((False, True) if n % 2 == 0 else (True, False)):
                times[cached].append(start(cached, n))
                cli[cached].append(start_cli(cached, n))
                say(f"start {n + 1}: {'cost cache' if cached else 'no cost cache'} {times[cached][-1]:.2f} s, "
                    f"model-factory serve {cli[cached][-1]:.2f} s (load {os.getloadavg()[0]:.2f})")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in cli.items()}
    rows = [("`start_verified_server`, no cost cache (measured at every start)", times[False]),
            ("`start_verified_server`, cost cache, after one start", times[True]),
            ("`model-factory serve --no-cost-cache` → READY", cli[False]),
            ("`model-factory serve` (default cost cache) → READY", cli[True])]
    lines = [START, "## serve → READY (benchmarks/bench_ready.py)", "", machine_header(), "",
             "The README's example (MiniLM FP32, default package: 2 instances, queue bound `auto`): "
             "`start_verified_server` (what `model-factory serve` runs) until it returns with the model loaded, and "
             "the command itself from its launch until `/v2/models/minilm/ready` answers; kinds alternate.", "",
             "| start | median s | each start (s) |", "| --- | --- | --- |"]
    lines += [f"| {title} | {statistics.median(v):.2f} | {', '.join(f'{x:.2f}' for x in v)} |" for title, v in rows]
    lines += ["", f"The priming start (empty cache: cost measured, constants learned): {first:.2f} s.", "",
              f"- Target `model-factory serve` → READY ≤ {TARGET_S:g} s: "
              f"{'met' if med[True] <= TARGET_S else 'missed'} with the cost cache ({med[True]:.2f} s), "
              f"{'met' if med[False] <= TARGET_S else 'missed'} without it ({med[False]:.2f} s: the queue bound's "
              "cost measured in a child process at every start).", END]
    publish("\n".join(lines), args.results, START, END, write=not args.quick)


if __name__ == "__main__":
    main()
