"""A rollout under steady load: time from the command to the switch, latency before / during / after, failures.

    .venv/bin/python benchmarks/bench_rollout.py            # ~2-3 min on 2 cores, writes RESULTS.md

MiniLM (FP32 ONNX, ONNX Runtime CPU, two instances, fixed cost model), signed, released and served by
``start_verified_server``; v2 (the same model packaged again, re-signed, released) is rolled out through
:class:`model_factory.serving.rollout.RolloutControl` (what ``serve --control-port`` runs) while ``--clients``
threads send one text each, back to back, for the whole run. Phases, from the rollout's own states: before,
verify + accept, shadow (the candidate loaded and mirrored), switch (v2 loaded beside v1, which stays loaded for
the grace period), after; then ``undo`` back to v1 (v2 unloaded: nothing loads). The switch's new stubs load quietly
(``backend/quiet_start.py``). Reported per phase: requests, failed, p50 / p99 latency; the seconds from the
command to the switch; and whether v1's stubs are the same processes at the end as before the rollout. The section between ``<!-- rollout:start -->`` and ``<!-- rollout:end -->`` is replaced.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # results_file.py is beside this script
sys.path.insert(0, str(HERE.parent))  # the repository root: benchmarks.harness
from results_file import machine_header, publish, say  # noqa: E402

START, END = "<!-- rollout:start -->", "<!-- rollout:end -->"
MODEL = "minilm"
KEY = "bench-rollout-admin-key-0123456789"


class Clients:
    """``n`` threads sending one text each, back to back: (sent, answered, ok, model_version)."""

    def __init__(self, url: str, n: int, texts: list[str]) -> None:
        self.url, self.texts, self.stop = url, texts, threading.Event()
        self.results: list[tuple[float, float, bool, str | None]] = []
        self.rejected: list[float] = []  # sent times of 503 / UNAVAILABLE answers (the queue bound shedding)
        self.errors: dict[str, int] = {}  # failure message (first 120 characters) -> count
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(n)]

    def _loop(self, i: int) -> None:
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(self.url, network_timeout=120)
        k = i
        try:
            while not self.stop.is_set():
                inp = httpclient.InferInput("text", [1, 1], "BYTES")
                inp.set_data_from_numpy(np.array([[self.texts[k % len(self.texts)].encode()]], dtype=np.object_))
                k += 13
                sent = time.monotonic()
                try:
                    version = client.infer(MODEL, [inp]).get_response().get("model_version")
                    ok = True
                except Exception as exc:  # noqa: BLE001 - counted as failed (or rejected: 503)
                    ok, version = False, None
                    why = " ".join(str(exc).split())[:120]
                    self.errors[why] = self.errors.get(why, 0) + 1
                    if "503" in str(exc) or "unavailable" in str(exc).lower():
                        self.rejected.append(sent)
                self.results.append((sent, time.monotonic(), ok, version))
        finally:
            client.close()

    def start(self) -> "Clients":
        for t in self.threads:
            t.start()
        return self

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=150)


def _phase(results, rejected, start: float, end: float) -> dict:
    rows = [r for r in results if start <= r[0] < end]
    lat = sorted((r[1] - r[0]) * 1000 for r in rows if r[2])
    pick = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan"))
    versions = sorted({r[3] for r in rows if r[3]})
    return {"n": len(rows), "failed": sum(not r[2] for r in rows), "p50": pick(0.5), "p99": pick(0.99),
            "rejected": sum(start <= t < end for t in rejected),
            "rps": len(rows) / max(end - start, 1e-9), "versions": ",".join(versions) or "-"}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--steady-s", type=float, default=15.0, help="seconds of load before the rollout and after")
    ap.add_argument("--min-requests", type=int, default=100)
    ap.add_argument("--queue-bound", action="store_true",
                    help="keep the package's queue bound (503s under load, counted as rejected); default: none")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args(argv)

    from benchmarks.harness.minilm import export_minilm, package_variant
    from model_factory.build.pipeline import provenance_for
    from model_factory.build_engines.golden import write_acceptance_data
    from benchmarks.harness.rollout import (LoadInOwnSession, kept_sentence, release_and_policy, stubs_by_version,
                                            wait_stubs_ended, watch_rollout)
    from model_factory.serving.rollout import RolloutControl
    from model_factory.serving.rollout_plan import RolloutRequest
    from model_factory.serving.server import ServerOptions, start_verified_server
    from model_factory.signing import SignerConfig, generate_keypair, sign_model_version
    from model_factory.signing.release import add_release

    # The example's held-out texts: all within the model's 128 tokens (a longer one is refused, 400, by design).
    texts = [t for t in (HERE.parent / "model_factory" / "examples" / "heldout.txt").read_text().splitlines() if t.strip()]
    header = machine_header(f"{args.clients} clients")
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        root = Path(tmp)
        repo = root / "repo"
        recipe, exported = export_minilm(root, {"repository.path": str(repo),
                                                **({} if args.queue_bound else {"batching.max_queue_size": 0})})
        golden = write_acceptance_data(recipe, exported.onnx_path, exported.tokenizer_dir, root / "golden")
        keys = generate_keypair(root / "keys")
        signer = SignerConfig(private_key=keys.private_key, password=None)
        def prov(v: int):
            return provenance_for(replace(recipe, version=v), {"source_digest": exported.source_digest}, None)
        fixed = {"cost_model": "0.002,1e-6,1e-9"}
        package_variant(recipe, exported, acceptance_dir=golden, parameters=fixed)
        sign_model_version(repo / MODEL, 1, signer, provenance=prov(1))
        k, policy = release_and_policy(root, repo, keys.private_key, keys.public_key)
        say("start v1")
        server, report = start_verified_server(repo, ServerOptions(0, 0, 0, admin_key=KEY), policy)
        try:
            control = RolloutControl(server, report.digests, report.served, poll_s=0.1)
            package_variant(replace(recipe, version=2), exported, acceptance_dir=golden, parameters=fixed)
            for v in (1, 2):
                sign_model_version(repo / MODEL, v, signer, provenance=prov(v))
            add_release(repo, k, k, k)
            v1_before = stubs_by_version(server, MODEL).get("1", set())
            clients = LoadInOwnSession(Clients, server.http_url, args.clients, texts,
                                       keep=("results", "errors", "rejected")).start()
            t0 = time.monotonic()
            time.sleep(args.steady_s)
            say("rollout v1 -> v2")
            command = time.monotonic()
            control.start(RolloutRequest(MODEL, 2, gate=0.99, min_requests=args.min_requests, timeout_s=600))
            states = watch_rollout(control, MODEL, {"switched", "rolled_back", "failed"}, 900, say)
            status = control.status(MODEL)
            done = time.monotonic()
            if status.state != "switched":
                clients.join()
                say(f"rollout ended {status.state}: {status.reason}")
                return 1
            time.sleep(args.steady_s)
            say("undo")
            undo_at = time.monotonic()
            undone = control.undo(MODEL)
            wait_stubs_ended(server, MODEL, "2", 120)  # the undo returns at once; v2 unloads once its requests end
            undo_done = time.monotonic()
            time.sleep(3.0)
            clients.join()
            v1_after = stubs_by_version(server, MODEL).get("1", set())
            end = time.monotonic()
            for why, count in sorted(clients.errors.items(), key=lambda x: -x[1])[:5]:
                say(f"{count} x {why}")
        finally:
            rc = server.stop()
    res = clients.results
    shadow_at = states.get("shadowing", command)
    switch_at = states.get("switching", done)
    phases = [("before", t0, command), ("verify, accept, load candidate", command, shadow_at),
              ("shadow (mirrored to the candidate)", shadow_at, switch_at), ("switch (v2 loaded beside v1)", switch_at, done),
              ("after (v1 kept loaded)", done, undo_at), ("undo (until v2's stubs ended)", undo_at, undo_done),
              ("after undo", undo_done, end)]
    rows = [(name, _phase(res, clients.rejected, a, b), b - a) for name, a, b in phases]

    def phase_of(t: float) -> str:
        return next((name for name, a, b in phases if a <= t < b), "-")

    for sent, answered, ok, version in sorted(res, key=lambda r: r[0] - r[1])[:8]:  # the slowest, for the record
        say(f"slow: sent {sent - command:+.2f} s ({phase_of(sent)}), answered {answered - command:+.2f} s "
            f"({phase_of(answered)}), {1000 * (answered - sent):.0f} ms, v{version}, ok={ok}")
    say("states: " + ", ".join(f"{s} {t - command:+.2f} s" for s, t in states.items()) +
        f"; done {done - command:+.2f} s; undo {undo_at - command:+.2f} .. {undo_done - command:+.2f} s")
    before_p99 = rows[0][1]["p99"]
    lines = [START, "## Rollout: v1 -> v2 under steady load, then undo", "", header, "",
             f"MiniLM FP32 (ONNX Runtime CPU, 2 instances), {args.clients} clients sending one text each back to back "
             f"for the whole run; the rollout mirrored {status.mirrored} requests (agreement {status.agreement:.6f}, "
             f"gate 0.99, min {args.min_requests}). **Command to switch: {status.seconds_to_switch:.1f} s** "
             f"(verify + acceptance + candidate load {shadow_at - command:.1f} s, shadow {switch_at - shadow_at:.1f} s, "
             f"switch {done - switch_at:.1f} s); **undo {undone.seconds_to_switch:.2f} s** (v2's stubs ended "
             f"{undo_done - undo_at:.1f} s after it). {kept_sentence(v1_before, v1_after)}. "
             f"tritonserver exit code {rc}.",
             f"Queue bound: {'the package default (503s are shedding, counted as rejected)' if args.queue_bound else 'none (max_queue_size = 0): every failure would be a lost request'}.",
             "", "| phase | seconds | requests | failed | of them 503 | req/s | p50 ms | p99 ms | p99 / before | versions answering |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, p, secs in rows:
        lines.append(f"| {name} | {secs:.1f} | {p['n']} | {p['failed']} | {p['rejected']} | {p['rps']:.1f} | {p['p50']:.0f} | "
                     f"{p['p99']:.0f} | {p['p99'] / before_p99:.2f}x | {p['versions']} |")
    failed = sum(not r[2] for r in res)
    worst = max(res, key=lambda r: r[1] - r[0])
    lines += ["", f"Failed requests over the whole run: **{failed}** of {len(res)}. Slowest request: "
              f"{1000 * (worst[1] - worst[0]):.0f} ms, sent in the phase '{phase_of(worst[0])}'. "
              "The rollout's own work yields the cores (its thread, the acceptance child and the candidate's stubs "
              "run at nice 19), so the stages before the switch take longer on a busy machine but cost live "
              "traffic little. The switch loads the new version's stubs quietly: each stub's load runs in a thread "
              "at nice 19 while its serving thread keeps the normal priority (backend/quiet_start.py), so the "
              "switch lasts as long as the cores traffic leaves allow. v1 stays loaded beside v2 through the grace "
              "period (serve's own copy of the repository leaves its files untouched: serving/served_view.py), so "
              "the undo loads nothing: Triton answers with v1 at once and unloads v2 once its requests are "
              "answered. Loads go through Triton's gRPC "
              "repository control: through HTTP a load held every connection of the HTTP worker thread that took it "
              "(p99 during the shadow 27.9x before, a few requests waiting 4-5 s).", END]
    publish("\n".join(lines), args.results, START, END, not args.no_write)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
