"""Triton's dynamic batcher with a queue policy, without our backend: does the ~500 ms stall remain?

    .venv/bin/python benchmarks/bench_queue_policy_stall.py           # ~4 min on 2 cores, writes RESULTS.md
    .venv/bin/python benchmarks/bench_queue_policy_stall.py --quick   # a smoke run, RESULTS.md untouched

A minimal Python-backend model (``spin``: copies its FP32 input to its output after spinning the CPU for
``--work-ms`` per execution, as a model's compute would) is served by the bundled Triton, side by side
in this one process, with configs that differ only in the queue policy:

(none)    ``dynamic_batching {}``: no policy (Triton prefetches payloads);
(policy)  ``dynamic_batching { default_queue_policy { max_queue_size: N } }`` with a bound no run reaches,
          so nothing is ever rejected;
(policy-after-return) the same policy, the model answering through each request's response sender from
          a thread once ``execute()`` has returned None (model-factory's backend does this,
          ``deferred_responses``): the workaround;

each with one and with two model instances (``--instances``).

Closed-loop gRPC clients (one thread and one client each) send one-row requests for ``--seconds`` per
configuration and client count, in alternating order over rounds. The table gives throughput, p50, p99, the
slowest request and the share of requests slower than 400 ms. The cause read from Triton's core is in
RESULTS.md ("Overload"); the section between ``<!-- queue-stall:start -->`` and ``<!-- queue-stall:end -->``
of benchmarks/RESULTS.md is replaced.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # results_file.py is beside this script
from results_file import say  # noqa: E402
START, END = "<!-- queue-stall:start -->", "<!-- queue-stall:end -->"
MODEL = "spin"
SLOW_MS = 400.0

MODEL_PY = '''
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.work_s = float(WORK_MS) / 1000.0
        self.deferred = DEFERRED
        if self.deferred:  # answer through the response senders, from a thread, after execute() returned
            import queue
            import threading

            self.windows = queue.SimpleQueue()
            threading.Thread(target=self._send, daemon=True).start()

    def _send(self):
        while True:
            senders, responses = self.windows.get()
            for sender, response in zip(senders, responses):
                sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def execute(self, requests):
        end = time.perf_counter() + self.work_s  # one execution's compute, whatever its batch
        while time.perf_counter() < end:
            pass
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x.astype(np.float32))]))
        if self.deferred:
            self.windows.put(([request.get_response_sender() for request in requests], out))
            return None
        return out
'''




def write_repository(root: Path, policy: bool, work_ms: float, bound: int, instances: int = 1,
                     deferred: bool = False) -> Path:
    """One repository holding ``spin``, its config written through Triton's protobuf."""
    from model_factory.build.repository import config_to_pbtxt

    batching: dict = {}
    if policy:
        batching["default_queue_policy"] = {"max_queue_size": bound, "timeout_action": "REJECT"}
    config = {"name": MODEL, "backend": "python", "max_batch_size": 64,
              "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]}],
              "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}],
              "dynamic_batching": batching, "instance_group": [{"count": instances, "kind": "KIND_CPU"}]}
    version = root / MODEL / "1"
    version.mkdir(parents=True)
    (root / MODEL / "config.pbtxt").write_text(config_to_pbtxt(config))
    (version / "model.py").write_text(MODEL_PY.replace("WORK_MS", repr(float(work_ms)))
                                      .replace("DEFERRED", repr(bool(deferred))))
    return root


def closed_loop(url: str, clients: int, seconds: float) -> tuple[list[float], int]:
    """``clients`` threads, each sending its next request when the last is answered; latencies in ms, errors."""
    import tritonclient.grpc as grpcclient

    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors = [0] * clients
    stop = time.monotonic() + seconds
    data = np.ones((1, 4), dtype=np.float32)

    def loop(i: int) -> None:
        client = grpcclient.InferenceServerClient(url)
        inp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(data)
        try:
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                try:
                    client.infer(MODEL, [inp])
                except Exception:  # counted; the table says how many
                    errors[i] += 1
                    continue
                latencies[i].append((time.perf_counter() - t0) * 1e3)
        finally:
            client.close()

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [x for per in latencies for x in per], sum(errors)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="length of each run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", default="1,4,16", help="closed-loop client counts")
    ap.add_argument("--work-ms", type=float, default=5.0, help="spin per execution (the model's compute)")
    ap.add_argument("--bound", type=int, default=1000, help="max_queue_size of (policy): never reached")
    ap.add_argument("--instances", default="1,2", help="model instance counts (instance_group count) to compare")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (RESULTS.md untouched)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds, args.rounds, args.clients, args.instances, args.no_write = 2.0, 1, "4", "1", True

    from model_factory.serving.server import ServerOptions, TritonServer

    counts = [int(x) for x in args.clients.split(",")]
    instance_counts = [int(x) for x in args.instances.split(",")]
    keys = [(label, n) for n in instance_counts for label in ("none", "policy", "policy-after-return")]
    runs: dict[tuple[tuple[str, int], int], list[float]] = {}
    errs: dict[tuple[tuple[str, int], int], int] = {}
    secs: dict[tuple[tuple[str, int], int], float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-queue-stall-") as tmp:
        servers = {}
        try:
            for key in keys:
                label, n = key
                repo = write_repository(Path(tmp) / f"{label}-{n}", label != "none", args.work_ms, args.bound, n,
                                        deferred=label == "policy-after-return")
                servers[key] = TritonServer(repo, [MODEL], ServerOptions(0, 0, 0)).start()
            for rnd in range(args.rounds):
                for clients in counts:
                    order = keys if (rnd + clients) % 2 == 0 else keys[::-1]
                    for key in order:
                        lat, err = closed_loop(servers[key].grpc_url, clients, args.seconds)
                        runs.setdefault((key, clients), []).extend(lat)
                        errs[(key, clients)] = errs.get((key, clients), 0) + err
                        secs[(key, clients)] = secs.get((key, clients), 0.0) + args.seconds
                        p99 = float(np.percentile(lat, 99)) if lat else float("nan")
                        say(f"round {rnd + 1}, {clients} clients, {key}: {len(lat) / args.seconds:.0f} req/s, "
                            f"p99 {p99:.1f} ms, max {max(lat, default=0):.0f} ms, errors {err}")
        finally:
            for s in servers.values():
                s.stop()

    rows = ["| instances | clients | queue policy | req/s | p50 ms | p99 ms | slowest ms | > 400 ms | errors |",
            "|" + " --- |" * 9]
    for key in keys:
        for clients in counts:
            lat = runs.get((key, clients), [])
            if not lat:
                continue
            label, n = key
            slow = sum(x > SLOW_MS for x in lat) / len(lat)
            policy = {"none": "none", "policy": f"max_queue_size {args.bound}",
                      "policy-after-return": f"max_queue_size {args.bound}, responses sent after execute() returns"}
            rows.append(f"| {n} | {clients} | {policy[label]} | "
                        f"{len(lat) / secs[(key, clients)]:.0f} | {statistics.median(lat):.1f} | "
                        f"{float(np.percentile(lat, 99)):.1f} | {max(lat):.0f} | {slow:.1%} | "
                        f"{errs[(key, clients)]} |")
    section = "\n".join([
        START, "## Triton's batcher with a queue policy, without our backend (benchmarks/bench_queue_policy_stall.py)", "",
        f"Run {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} on {platform.node() or 'this host'} "
        f"({os.cpu_count()} CPUs, load average before the write {' '.join(f'{x:.2f}' for x in os.getloadavg())}). "
        f"The bundled Triton 2.51, a minimal Python-backend model that spins {args.work_ms:g} ms per execution and "
        f"copies its input (max_batch_size 64, {args.instances} CPU instances), servers side by side whose configs "
        f"differ only in `default_queue_policy` (a bound of {args.bound}, never reached: nothing is rejected) "
        "and, in the third, in sending the responses after execute() returns. "
        f"Closed-loop gRPC clients (a thread each), {args.rounds} rounds of {args.seconds:g} s per count and "
        "configuration, alternating order; latencies pooled over rounds.", "",
        *rows, "", END])
    from results_file import publish

    publish(section, args.results, START, END, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
