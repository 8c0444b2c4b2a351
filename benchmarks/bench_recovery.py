"""Time to recover from a killed Python-backend stub, as ``model-factory serve`` heals it.

    .venv/bin/python benchmarks/bench_recovery.py            # ~2 min on 2 cores, writes RESULTS.md

MiniLM (FP32 ONNX, ONNX Runtime CPU), signed and served by ``start_verified_server`` with the stub
watch of ``serve`` (:class:`model_factory.serving.supervise.StubWatch`, polling every 0.5 s). Each round
SIGKILLs the stub while a client keeps sending requests, and times: the kill to the model reading
not ready, the kill to ready again (unload, re-verification, reload: the reload measures the cost
model again, as every production load does), and the kill to the first answer that is right again.
The section between ``<!-- recovery:start -->`` and ``<!-- recovery:end -->`` of RESULTS.md is replaced.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # results_file.py is beside this script
sys.path.insert(0, str(HERE.parent))  # the repository root: benchmarks.harness
from results_file import say  # noqa: E402
START, END = "<!-- recovery:start -->", "<!-- recovery:end -->"




def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{url}/v2/models/minilm/ready", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args(argv)

    from benchmarks.harness.minilm import export_minilm, package_variant
    from model_factory.measure.client import embed_texts
    from model_factory.demo import write_key_policy
    from model_factory.build.pipeline import provenance_for
    from functools import partial

    from model_factory.serving.server import ServerOptions, reverify_model, start_verified_server
    from model_factory.signing import SignerConfig, generate_keypair, sign_model_version
    from model_factory.serving.supervise import SETTLE_S, StubWatch, stub_processes

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        root = Path(tmp)
        recipe, exported = export_minilm(root, {"repository.path": str(root / "repo")})
        package_variant(recipe, exported)
        keys = generate_keypair(root / "keys")
        sign_model_version(root / "repo" / "minilm", 1, SignerConfig(private_key=keys.private_key, password=None),
                           provenance=provenance_for(recipe, {"source_digest": exported.source_digest}, None))
        policy = write_key_policy(root / "policy.toml", [keys.public_key])
        say("start")
        server, report = start_verified_server(root / "repo", ServerOptions(0, 0, 0), policy)
        url = server.http_url
        try:
            reference = embed_texts(url, "minilm", ["recovering"])
            with StubWatch(server, ["minilm"], interval_s=0.5, echo=say,
                           reverify=partial(reverify_model, report.digests)):
                for i in range(args.rounds):
                    stop = threading.Event()
                    outcomes: list[tuple[float, bool]] = []

                    def client() -> None:
                        while not stop.is_set():
                            try:
                                out = embed_texts(url, "minilm", ["recovering"])
                                outcomes.append((time.monotonic(), bool(np.allclose(out, reference, atol=1e-5))))
                            except Exception:  # refused while down: that is what is measured
                                outcomes.append((time.monotonic(), False))
                                time.sleep(0.05)

                    t = threading.Thread(target=client)
                    t.start()
                    time.sleep(1.0)
                    (stub,) = stub_processes(server.process.pid, server.served_repository)
                    killed = time.monotonic()
                    os.kill(stub.pid, signal.SIGKILL)
                    not_ready = killed + 60
                    while time.monotonic() - killed < 60:
                        if not ready(url):
                            not_ready = time.monotonic()
                            break
                        time.sleep(0.02)
                    while not ready(url) and time.monotonic() - killed < 300:
                        time.sleep(0.05)
                    back = time.monotonic()
                    # A request the dying instance answered just after the kill is not a recovery: count
                    # the first right answer after the first refusal.
                    def down_since() -> float:
                        return min((ts for ts, ok in outcomes if ts > killed and not ok), default=killed)

                    while not any(ts > down_since() and ok for ts, ok in outcomes) and time.monotonic() - killed < 300:
                        time.sleep(0.05)
                    stop.set()
                    t.join()
                    first_ok = min(ts for ts, ok in outcomes if ts > down_since() and ok)
                    failed = sum(1 for ts, ok in outcomes if ts > killed and not ok)
                    # The request in flight at the kill: the first answer after it.
                    first_answer = min(ts for ts, _ in outcomes if ts > killed)
                    rows.append((not_ready - killed, back - killed, first_ok - killed, failed,
                                 first_answer - killed))
                    say(f"round {i + 1}: not ready after {rows[-1][0]:.2f} s, ready after {rows[-1][1]:.1f} s, "
                        f"first right answer after {rows[-1][2]:.1f} s, {failed} requests refused meanwhile")
        finally:
            rc = server.stop()
            say(f"tritonserver exit code {rc}")
    table = ["| round | kill → not ready (s) | kill → request in flight answered (s) | kill → ready (s) | "
             "kill → first right answer (s) | requests refused meanwhile |", "| --- | --- | --- | --- | --- | --- |"]
    table += [f"| {i + 1} | {a:.2f} | {f:.1f} | {b:.1f} | {c:.1f} | {n} |" for i, (a, b, c, n, f) in enumerate(rows)]
    section = "\n".join([
        START, "## Dead stub: time to recover (benchmarks/bench_recovery.py)", "",
        f"Run {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} on {platform.node() or 'this host'} "
        f"({os.cpu_count()} CPUs, shared with other work). Signed MiniLM FP32 on ONNX Runtime CPU, served with the "
        "stub watch polling every 0.5 s; the stub SIGKILLed while a client sends requests.", "",
        *table, "",
        f"Median kill → ready {statistics.median(r[1] for r in rows):.1f} s: the watch's {SETTLE_S:g} s settle (the "
        "dead instance fails the requests it holds first), then re-verification and the reload (the backend's "
        "short cost-model warm-up, then it learns online). \"First right answer\" counts from the first refusal "
        "on, so an answer the dying instance gave just after the kill is not taken for a recovery. Detection "
        "and the unload take well under a second; meanwhile requests are refused at once (404: no available "
        f"version). Triton 2.51 never finishes unloading the dead instance, so this server's exit took its exit "
        f"timeout (exit code {rc}).", END])
    print(section)
    if not args.no_write:
        sys.path.insert(0, str(HERE))
        from results_file import write_section

        write_section(args.results, START, END, section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
