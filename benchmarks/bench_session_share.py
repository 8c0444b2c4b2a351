"""Background work at nice 19 beside a served LLM: in the server's session, or in a session of its own.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_session_share.py [--work DIR]   # ~4 min, writes RESULTS.md

Why ``TritonServer`` starts tritonserver in the session of the process that starts it (``serve``): Linux's
autogroup scheduler (``/proc/sys/kernel/sched_autogroup_enabled``) shares the CPU between sessions as equals before
any nice value counts, so a nice-19 process in a session of its own ranks level with a whole server. The 116M Llama
of ``bench_rollout_generative.py`` (FP32, the factory's build) is served by ``start_verified_server`` (this
process's session); ``--streams`` streams (in a session of their own, as other machines) each keep one greedy
64 + 64-token ``generate_stream`` request in flight with a 2 s pause. Windows of ``--window-s`` seconds, ``--rounds``
rounds in rotating order: no hog; two nice-19 busy-loop processes in this (the server's) session; the same two in a
session of their own (``setsid``). Per kind: TTFT p50 / p99, inter-token p99 and output tokens/s over the window,
medians with (min-max) over the rounds. The section between ``<!-- session_share:start -->`` and
``<!-- session_share:end -->`` is replaced.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # results_file.py is beside this script
sys.path.insert(0, str(HERE.parent))  # the repository root: benchmarks.harness, tests.*
from results_file import machine_header, publish, say  # noqa: E402

START, END = "<!-- session_share:start -->", "<!-- session_share:end -->"
KINDS = ("none", "server's session", "own session")


def _hogs(kind: str, seconds: float) -> list[subprocess.Popen]:
    """Two nice-19 busy loops of ``seconds`` (one per core here), in this process's session or a new one."""
    if kind == "none":
        return []
    code = f"import time\nt = time.monotonic()\nwhile time.monotonic() - t < {seconds}:\n    pass\n"
    return [subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", code], start_new_session=kind == "own session")
            for _ in range(2)]


def _range(values: list[float], fmt: str) -> str:
    return f"{format(float(np.median(values)), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--window-s", type=float, default=12.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=None, help="keeps the Llama folder between runs")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args(argv)

    from bench_rollout_generative import MODEL, SHAPE, Streams, _phase
    from benchmarks.harness.rollout import LoadInOwnSession
    from model_factory.serving.server import ServerOptions, start_verified_server
    from tests.generative_models import make_causal_lm
    from tests.generative_repository import layout_generative_model

    header = machine_header(f"{args.streams} streams")
    autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled")
    autogroup_on = autogroup.is_file() and autogroup.read_text().strip() == "1"
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-session-share-"))
    hf = work / "llama-116m"
    if not (hf / "config.json").is_file():
        say("making the 116M Llama folder")
        make_causal_lm("llama", hf, **SHAPE)
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    windows: dict[str, list[dict]] = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory(prefix="bench-session-share-") as tmp:
        say("building the FP32 model with the factory")
        layout_generative_model(hf, None, Path(tmp) / "repo", MODEL, memory_budget_mib=4096,
                                max_active_sequences=max(8, args.streams), max_waiting_sequences=64)
        server, report = start_verified_server(Path(tmp) / "repo", ServerOptions(0, 0, 0, startup_timeout_s=600),
                                               None, allow_unsigned=True)
        try:
            assert report.served == (MODEL,), report.refused
            streams = LoadInOwnSession(Streams, server.http_url, args.streams, 64, 64, vocab, 2.0).start()
            time.sleep(10.0)  # the streams settle
            spans = []
            for r in range(args.rounds):
                for kind in KINDS[r % 3:] + KINDS[:r % 3]:
                    say(f"round {r + 1}: {kind}")
                    a = time.monotonic()
                    hogs = _hogs(kind, args.window_s)
                    time.sleep(args.window_s)
                    for h in hogs:
                        h.wait()
                    spans.append((kind, a, time.monotonic()))
                    time.sleep(3.0)
            streams.join()
        finally:
            rc = server.stop()
    for kind, a, b in spans:
        windows[kind].append(_phase(streams.results, a, b))
    failed = sum(not r[1] for r in streams.results)
    base = float(np.median([w["ttft99"] for w in windows["none"]]))
    lines = [START, "## Background work beside a served LLM: in the server's session or in one of its own "
             "(benchmarks/bench_session_share.py)", "", header, "",
             f"The 116M Llama (FP32, ONNX Runtime CPU) served by `start_verified_server`, in this process's session; "
             f"{args.streams} streams in a session of their own, each keeping one greedy 64 + 64-token `generate_stream` "
             f"request in flight with a 2 s pause. {args.rounds} rounds of {args.window_s:g} s windows in rotating order: no "
             "hog, two nice-19 busy loops in the server's session, the same in a session of their own. Autogroup "
             f"scheduling {'on' if autogroup_on else 'off'} (`/proc/sys/kernel/sched_autogroup_enabled`). Medians with "
             f"(min-max) over the rounds; failed requests over the run: {failed} of {len(streams.results)}; tritonserver "
             f"exit code {rc}.", "",
             "| nice-19 hogs | TTFT p50 s | TTFT p99 s | TTFT p99 / no hog | inter-token p99 ms | output tokens/s |",
             "|---|---:|---:|---:|---:|---:|"]
    for kind in KINDS:
        w = windows[kind]
        lines.append(f"| {kind} | {_range([x['ttft50'] for x in w], '.2f')} | {_range([x['ttft99'] for x in w], '.2f')} | "
                     f"{float(np.median([x['ttft99'] for x in w])) / base:.2f}x | "
                     f"{_range([1000 * x['itl99'] for x in w], '.0f')} | {_range([x['tps'] for x in w], '.1f')} |")
    lines += ["", "A nice value ranks threads within a session's group; between groups the autogroup scheduler shares "
              "the CPU as equals. So background work must run in the server's session to yield to it: `TritonServer` "
              "starts tritonserver in the session of the process that starts it (`serve`), whose rollout work (hashing, "
              "acceptance, copying) runs at nice 19 (docs/operations.md, step 6).", END]
    publish("\n".join(lines), args.results, START, END, not args.no_write)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
