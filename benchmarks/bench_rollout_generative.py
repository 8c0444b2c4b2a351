"""A text-generation model's rollout under steady streamed load: first-token and inter-token latency per phase.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_rollout_generative.py [--work DIR]   # writes RESULTS.md

A Llama in SmolLM-135M's shape (random weights, made here or reused from ``--work``), built by the factory (FP32,
the build's own export and checks), signed, released and served by ``start_verified_server`` with a cost cache
(as ``serve`` has by default); v2 (the same
version folder again, signed, released) is rolled out through :class:`model_factory.serving.rollout.RolloutControl`
(what ``serve --control-port`` runs) while ``--streams`` threads each send greedy streamed ``generate_stream``
requests (``--prompt`` token-id prompts, ``--tokens`` new tokens), pausing ``--pause-s`` between their requests,
for the whole run. Phases, from the rollout's own states: before; verify + accept + the candidate's load; shadow (finished requests generated
again by the candidate, token agreement scored); switch (v2 loaded beside v1, which stays loaded for the grace
period); after; undo (back to v1: v2 unloaded, nothing loads; the phase lasts until v2's stubs ended); after undo. Per phase, over the requests sent in it: requests, failed, TTFT p50 / p99, and over the tokens
received in it the inter-token gap p99 and the output tokens/s. The section between
``<!-- rollout_generative:start -->`` and ``<!-- rollout_generative:end -->`` is replaced.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Sequence

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # results_file.py is beside this script
sys.path.insert(0, str(HERE.parent))  # the repository root: benchmarks.harness, tests.*
from results_file import machine_header, publish, say  # noqa: E402

START, END = "<!-- rollout_generative:start -->", "<!-- rollout_generative:end -->"
MODEL = "llm"
KEY = "bench-rollout-generative-key-0123456789"
SHAPE = dict(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab_size=16384, max_positions=2048,
             tie=True)


class Streams:
    """``n`` threads, each keeping one streamed greedy generate request in flight, back to back. Per request:
    (sent, ok, model_version, token arrival times)."""

    def __init__(self, url: str, n: int, prompt: int, tokens: int, vocab: int, pause_s: float = 0.0) -> None:
        self.url, self.prompt, self.tokens, self.vocab, self.pause_s = url, prompt, tokens, vocab, pause_s
        self.stop = threading.Event()
        self.results: list[tuple[float, bool, str | None, list[float]]] = []
        self.errors: dict[str, int] = {}
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(n)]

    def _loop(self, i: int) -> None:
        rng = random.Random(i)
        while not self.stop.is_set():
            body = {"prompt_ids": [rng.randrange(3, self.vocab) for _ in range(self.prompt)],
                    "max_tokens": self.tokens, "min_tokens": self.tokens, "temperature": 0.0, "stream": True}
            req = urllib.request.Request(f"http://{self.url}/v2/models/{MODEL}/generate_stream",
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
            sent, arrivals, version, ok = time.monotonic(), [], None, False
            try:
                with urllib.request.urlopen(req, timeout=300) as resp:
                    for raw in resp:
                        line = raw.decode().strip()
                        if not line.startswith("data:"):
                            continue
                        event = json.loads(line[5:])
                        if "error" in event:
                            raise RuntimeError(event["error"])
                        if event.get("output_ids"):
                            arrivals.append(time.monotonic())
                        version = str(event.get("model_version", version))
                ok = len(arrivals) == self.tokens
                if not ok:
                    self._error(f"{len(arrivals)} of {self.tokens} tokens")
            except Exception as exc:  # noqa: BLE001 - every failure is counted
                self._error(f"{type(exc).__name__}: {exc}"[:120])
            self.results.append((sent, ok, version, arrivals))
            self.stop.wait(self.pause_s)  # a client's think time: the load leaves the cores some idle time

    def _error(self, why: str) -> None:
        self.errors[why] = self.errors.get(why, 0) + 1

    def start(self) -> "Streams":
        for t in self.threads:
            t.start()
        return self

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _phase(results: list, start: float, end: float) -> dict:
    sent_in = [r for r in results if start <= r[0] < end]
    ttft = [r[3][0] - r[0] for r in sent_in if r[3]]
    gaps = [b - a for r in results for a, b in zip(r[3], r[3][1:]) if start <= b < end]
    tokens = sum(1 for r in results for t in r[3] if start <= t < end)
    versions = sorted({r[2] for r in sent_in if r[1] and r[2]})
    return {"n": len(sent_in), "failed": sum(not r[1] for r in sent_in), "ttft50": _pct(ttft, 50),
            "ttft99": _pct(ttft, 99), "itl99": _pct(gaps, 99), "tps": tokens / max(end - start, 1e-9),
            "versions": ",".join(versions) or "-"}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--pause-s", type=float, default=2.0,
                    help="each stream's pause between requests (0: back to back, which saturates the cores and "
                         "starves the candidate's load at nice 19)")
    ap.add_argument("--steady-s", type=float, default=20.0, help="seconds of load before the rollout and after")
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument("--share", type=float, default=1.0)
    ap.add_argument("--work", type=Path, default=None, help="keeps the model folder and its build between runs")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args(argv)

    from benchmarks.harness.rollout import (LoadInOwnSession, kept_sentence, release_and_policy, stubs_by_version,
                                            wait_stubs_ended, watch_rollout)
    from model_factory.serving.rollout import RolloutControl
    from model_factory.serving.rollout_plan import RolloutRequest
    from model_factory.serving.server import ServerOptions, start_verified_server
    from model_factory.signing import SignerConfig, generate_keypair, sign_model_version
    from model_factory.signing.release import add_release
    from tests.generative_models import make_causal_lm
    from tests.generative_repository import layout_generative_model

    header = machine_header(f"{args.streams} streams")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-rollout-gen-"))
    hf = work / "llama-116m"
    if not (hf / "config.json").is_file():
        say("making the 116M Llama folder")
        make_causal_lm("llama", hf, **SHAPE)
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    with tempfile.TemporaryDirectory(prefix="bench-rollout-gen-") as tmp:
        root = Path(tmp)
        repo = root / "repo"
        say("building v1 (FP32) with the factory")
        v1 = layout_generative_model(hf, None, repo, MODEL, memory_budget_mib=4096,
                                     max_active_sequences=max(8, args.streams), max_waiting_sequences=64)
        model_dir = v1.parent
        keys = generate_keypair(root / "keys")
        signer = SignerConfig(private_key=keys.private_key, password=None)
        sign_model_version(model_dir, 1, signer)
        k, policy = release_and_policy(root, repo, keys.private_key, keys.public_key, require_provenance=False)
        say("start v1")
        log_file = work / "tritonserver.log"  # kept: the run's server log
        server, report = start_verified_server(repo, ServerOptions(0, 0, 0, admin_key=KEY, startup_timeout_s=600),
                                               policy, log_file=log_file,
                                               cost_cache=root / "cost-cache")  # as `serve` has one by default
        try:
            assert report.served == (MODEL,), report.refused
            control = RolloutControl(server, report.digests, report.served, poll_s=0.1)
            shutil.copytree(v1, model_dir / "2")
            sign_model_version(model_dir, 2, signer)
            add_release(repo, k, k, k)
            v1_before = stubs_by_version(server, MODEL).get("1", set())
            streams = LoadInOwnSession(Streams, server.http_url, args.streams, args.prompt, args.tokens, vocab,
                                       args.pause_s).start()
            t0 = time.monotonic()
            time.sleep(args.steady_s)
            say("rollout v1 -> v2")
            command = time.monotonic()
            control.start(RolloutRequest(MODEL, 2, gate=0.99, min_requests=args.min_requests, share=args.share,
                                         timeout_s=900))
            states = watch_rollout(control, MODEL, {"switched", "rolled_back", "failed"}, 1200, say)
            status = control.status(MODEL)
            done = time.monotonic()
            time.sleep(args.steady_s)
            undo_at = time.monotonic()
            undone = control.undo(MODEL) if status.state == "switched" else None
            if undone is not None:
                wait_stubs_ended(server, MODEL, "2", 300)  # the undo returns at once; v2 unloads once its requests end
            undo_done = time.monotonic()
            v1_after = stubs_by_version(server, MODEL).get("1", set())
            time.sleep(args.steady_s / 2)
            streams.join()
            end = time.monotonic()
            for why, count in sorted(streams.errors.items(), key=lambda x: -x[1])[:5]:
                say(f"{count} x {why}")
        finally:
            rc = server.stop()
    if status.state != "switched":
        say(f"rollout ended {status.state}: {status.reason}")
        return 1
    res = streams.results
    shadow_at = states.get("shadowing", command)
    switch_at = states.get("switching", done)
    phases = [("before", t0, command), ("verify, accept, load candidate", command, shadow_at),
              ("shadow (finished requests generated again by the candidate)", shadow_at, switch_at),
              ("switch (v2 loaded beside v1)", switch_at, done), ("after (v1 kept loaded)", done, undo_at),
              ("undo (until v2's stubs ended)", undo_at, undo_done), ("after undo", undo_done, end)]
    rows = [(name, _phase(res, a, b), b - a) for name, a, b in phases]
    base = rows[0][1]
    failed = sum(not r[1] for r in res)
    lines = [START, "## Rollout of a text-generation model under steady streamed load (benchmarks/bench_rollout_generative.py)",
             "", header, "",
             f"A 116M Llama (SmolLM-135M's shape, random weights), the factory's FP32 build, ONNX Runtime CPU; "
             f"{args.streams} streams each keeping one greedy `generate_stream` request in flight ({args.prompt}-token "
             f"prompts, exactly {args.tokens} new tokens), each stream pausing {args.pause_s:g} s between its requests, for "
             f"the whole run. The rollout mirrored "
             f"{status.mirrored} finished requests (share {args.share:g}; agreement {status.agreement:.4f}, gate 0.99, "
             f"min {args.min_requests}; {status.skipped} skipped by a full mirror queue). **Command to switch: "
             f"{status.seconds_to_switch:.1f} s** (verify + acceptance + candidate load {shadow_at - command:.1f} s, "
             f"shadow {switch_at - shadow_at:.1f} s, switch {done - switch_at:.1f} s); **undo "
             f"{undone.seconds_to_switch:.2f} s** (v2's stubs ended {undo_done - undo_at:.1f} s after it). "
             f"{kept_sentence(v1_before, v1_after)}. tritonserver exit code {rc}.", "",
             "| phase | seconds | requests sent | failed | TTFT p50 s | TTFT p99 s | TTFT p99 / before | "
             "inter-token p99 ms | ITL p99 / before | output tokens/s | versions answering |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, p, secs in rows:
        lines.append(f"| {name} | {secs:.1f} | {p['n']} | {p['failed']} | {p['ttft50']:.2f} | {p['ttft99']:.2f} | "
                     f"{p['ttft99'] / base['ttft99']:.2f}x | {1000 * p['itl99']:.0f} | {p['itl99'] / base['itl99']:.2f}x | "
                     f"{p['tps']:.1f} | {p['versions']} |")
    lines += ["", f"Failed requests over the whole run: **{failed}** of {len(res)} (a request counts in the phase it "
              "was sent in; its tokens in the phases they arrived in). The candidate's stub runs at nice 19 and "
              "generates each mirrored request again in full, so on cores the live streams keep busy the shadow "
              "takes what they leave. The switch loads v2 quietly: reading, hashing and the session's graph work on a "
              "thread of its own at nice 19, the prefill cost model read from `serve`'s cost cache (measured by the "
              "earlier load of the same graph) instead of a warm-up beside live traffic; its engine loop and the "
              "session's pool start at the normal priority. "
              f"The switch's load, from the server's log: {switch_load_note(log_file)}. v1 stays loaded beside v2 "
              "through the grace period, so the undo loads nothing.", END]
    publish("\n".join(lines), args.results, START, END, not args.no_write)
    return 0 if failed == 0 else 1


def switch_load_note(log_file: Path) -> str:
    """What the backend logged of the last load of the served name (the switch's): start, cost model, duration."""
    import re

    lines = [line for line in log_file.read_text(errors="replace").splitlines()
             if f"model-factory backend: {MODEL} generates" in line]
    if not lines:
        return "not found"
    cost = re.search(r"prefill cost [^(]*\(([^)]*)\)", lines[-1])
    start = re.search(r"load quiet \(([^)]*)\)", lines[-1])
    took = re.search(r"loaded in ([0-9.]+ s)", lines[-1])
    return (f"{'quiet, ' + start.group(1) if start else 'at the normal priority'}; prefill cost "
            f"{cost.group(1) if cost else '?'}; {took.group(1) if took else '?'} from initialize to loaded")


if __name__ == "__main__":
    sys.exit(main())
