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
replaced. Not run: vLLM-CPU's multi-LoRA on the same adapters (the section says why).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
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


def adapters(folder: Path, shapes: dict[str, tuple[int, int]], count: int) -> list:
    """``count`` adapter entries of random rank-``RANK`` pairs on every module of ``shapes``."""
    from model_factory.backend.generation.lora import Found
    from model_factory.backend.lora_contract import ADAPTER_WEIGHTS, AdapterSpec

    out = []
    for n in range(count):
        rng = np.random.default_rng(n)
        vdir = folder / f"a{n}" / "1"
        vdir.mkdir(parents=True, exist_ok=True)
        arrays = {}
        for module, (fan_in, fan_out) in shapes.items():
            arrays[module + ".A"] = rng.normal(0, 0.02, (fan_in, RANK)).astype(np.float32)
            arrays[module + ".B"] = rng.normal(0, 0.02, (RANK, fan_out)).astype(np.float32)
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
    args = ap.parse_args()
    load = LoadReading.begin()
    hf = llama_folder(args.work, "mf-bench-lora-")
    built = args.work / "repo" / "llm" / "1" if args.work else None
    if built is not None and (built / Files.ONNX).is_file():
        vdir = built  # the factory's build made by an earlier run with this --work
    else:
        say("building the FP32 graph with the factory")
        repo = args.work / "repo" if args.work else Path(tempfile.mkdtemp(prefix="mf-bench-lora-repo-"))
        vdir = layout_generative_model(hf, None, repo, "llm")
    spec = GenerationSpec.from_json((vdir / Files.GENERATION).read_text())
    graph = vdir / Files.ONNX
    import onnx

    modules = sorted({m for m in (graph_module(n.name) for n in onnx.load(str(graph), load_external_data=False)
                                  .graph.node) if m})
    base = CausalLM(graph, threads=2, pad_token_id=spec.pad_token_id or 0)
    prepared = prepare(graph, modules)
    lm = CausalLM(graph, threads=2, pad_token_id=spec.pad_token_id or 0, lora=prepared)
    found = adapters(Path(tempfile.mkdtemp(prefix="mf-bench-lora-adapters-")), prepared.shapes, max(ADAPTER_COUNTS))
    table = AdapterTable(found, {}, lm.lora_shapes, max_loras=max(ADAPTER_COUNTS))
    lm.lora_table = table
    say(f"{len(modules)} projections adapted, rank {RANK}, stacks {table.bytes / 2**20:.0f} MiB")
    rows = []
    for streams in STREAMS:
        for count in ADAPTER_COUNTS:
            pairs = []
            for rnd in range(2):
                order = ("base", "lora") if rnd == 0 else ("lora", "base")
                got = {}
                for which in order:
                    got[which] = one_run(base if which == "base" else lm, spec, streams, table,
                                         0 if which == "base" else count, seed=rnd)
                pairs.append((got["base"], got["lora"]))
                say(f"{streams} streams, {count} adapters, round {rnd + 1}: base {got['base']:.1f}, "
                    f"adapters {got['lora']:.1f} tokens/s ({got['lora'] / got['base']:.2f}x)")
            rows.append((streams, count, pairs))
    lines = [START, "## LoRA adapters per request (`lora`)", "", run_header("benchmarks/bench_lora.py", load.finish()), "",
             f"110M Llama (SmolLM-135M's shape, random weights), FP32, the backend's scheduler in-process with 2 threads; "
             f"rank-{RANK} adapters on all {len(modules)} projections; closed loop, {PROMPT}-token prompts, "
             f"{TOKENS} greedy tokens each; two rounds in alternating order.", "",
             "| streams | adapters | base tokens/s | with adapters tokens/s | ratio (round 1, round 2) |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for streams, count, pairs in rows:
        lines.append(f"| {streams} | {count} | {' / '.join(f'{b:.1f}' for b, _ in pairs)} | "
                     f"{' / '.join(f'{a:.1f}' for _, a in pairs)} | "
                     f"{', '.join(f'{a / b:.2f}x' for b, a in pairs)} |")
    lines += ["", "The rewrite measured: each row's adapter columns kept by a mask over the pairs of the adapters a launch "
              "binds (generation/lora.py). The form before it, each row's pairs gathered (`Gather` on a row index, paid "
              "by base rows too), ran 0.70-0.79x the base at 8 streams in this script's run of 2026-12-06 09:45 UTC "
              "(this section in git before commit 'LoRA rewrite: ...masked').", "",
              "Not run: vLLM-CPU's multi-LoRA on the same adapters. vLLM-CPU 0.32 is installed on the machine of this "
              "run (benchmarks/install_peers.sh vllm), but this script does not drive it yet: it needs the adapters "
              "written as PEFT folders (the packed qkv pair split back into q, k and v modules) and a server started "
              "with --enable-lora --max-loras 16 --max-lora-rank 16 --lora-modules, whose first start compiles for "
              "6-22 minutes on these 2 cores (docs/environment.md).", END]
    publish("\n".join(lines), HERE / "RESULTS.md", START, END, args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
