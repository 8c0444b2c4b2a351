"""Grouped batching against Triton's own dynamic batching and against padding to the longest.

    .venv/bin/python benchmarks/bench_batching.py              # ~10 min on 2 cores, writes RESULTS.md
    .venv/bin/python benchmarks/bench_batching.py --quick      # a smoke run, RESULTS.md untouched
    python3 benchmarks/bench_batching.py --kind gpu --engine torch --source DIR --random-weights
                                                               # on a GPU machine (gpu_checks.sh runs it)

MiniLM (all-MiniLM-L6-v2, FP32 ONNX) on ONNX Runtime's CPU provider, served by the
real Triton server (the one bundled in nvidia-pytriton) through model-factory's
Python backend, in three configurations, each on its own freshly packaged
repository and its own server, all in this one process:

(a) ours: ``allow_ragged_batch`` on, the backend splits each window by the cost
    model measured at load (``grouping = "cost_model"``);
(b) Triton's dynamic batching without ragged batching: only requests of equal
    shape are batched; the backend runs what it gets as one launch
    (``ragged = false``, ``grouping = "pad_to_longest"``, so no padding happens);
(c) ragged batches padded to the longest request of the window
    (``ragged = true``, ``grouping = "pad_to_longest"``).

Every configuration gets the same request stream: one sequence per request,
drawn with a fixed seed from ``benchmarks/texts.txt`` and sent as token ids
(tokenized here with the model's tokenizer; a ``text`` request would have the
same [1, 1] shape whatever its length, and (b) would then batch everything).
For each concurrency (regime) and round, the configurations (and the bare-ORT
replay below) run one after the other in a fresh seeded random order, so drift on
a shared machine spreads over all of them; each run starts with a warm-up that is
not counted. Throughputs are medians over rounds, ratios are taken within a round.
A what-if (a′), (a) with another ``max_queue_delay_us`` (default 2000, where the
recipe has 0), runs in the same rounds (``--what-if-delay-us -1`` leaves it out).

Server overhead: the same groups run in-process on bare ONNX Runtime (the
backend's own engine class and padding code, no Triton, no client): the stream is
cut into windows of (a)'s measured mean batch, each split by the cost model that
(a)'s server measured at load. Our throughput over that is the overhead ratio.

GPU machines: ``--kind gpu --engine torch`` serves the same three configurations on
a KIND_GPU instance with the torch engine (the export's TorchScript on CUDA; there is
no TensorRT on the GPU machine lent to this project), and replays the groups on a
bare in-process ``TorchEngine``. ``--source`` points at a Hugging Face folder and
``--random-weights`` gives that architecture fresh random weights (seeded) when only
its config and tokenizer were carried there: speed does not depend on the weights.

The result replaces this run's section (``<!-- batching:start -->`` for the CPU run,
``<!-- batching-<kind>-<engine>:start -->`` for others) in benchmarks/RESULTS.md,
leaving other sections alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file.py is beside this script
import results_file  # noqa: E402
from results_file import say  # noqa: E402

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# model_factory comes installed (scripts/setup.sh) or mapped on PYTHONPATH (gpu_checks.sh): the bare
# checkout is not importable as model_factory (its backend and build_engines live elsewhere).

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from model_factory.measure import bench  # noqa: E402

RECIPE = ROOT / "model_factory" / "examples" / "minilm.toml"
TEXTS = Path(__file__).with_name("texts.txt")
MODEL = "minilm"


@dataclasses.dataclass(frozen=True)
class Setup:
    """Where the benchmark runs: the instance kind and the engine the backend serves with."""

    kind: str = "cpu"  # Triton instance kind: cpu | gpu
    engine: str = "onnxruntime"  # the backend's engine parameter: onnxruntime | torch
    source: Path | None = None  # a Hugging Face folder instead of the recipe's packaged MiniLM
    random_weights: bool = False  # fresh seeded weights for the source's architecture
    name: str | None = None  # the RESULTS.md section to write (default: by kind and engine)
    # Model instances per server. One, as in the recorded runs: this compares batching, not instance counts
    # (the recipe's default is two; benchmarks/bench_overload.py runs that).
    instances: int = 1

    @property
    def section(self) -> str:
        """The RESULTS.md section this run writes (the CPU run keeps its historical name)."""
        if self.name:
            return self.name
        return "batching" if (self.kind, self.engine) == ("cpu", "onnxruntime") else f"batching-{self.kind}-{self.engine}"

    @property
    def markers(self) -> tuple[str, str]:
        return f"<!-- {self.section}:start -->", f"<!-- {self.section}:end -->"

    @property
    def device(self) -> str:
        """The device the bare in-process replay runs on."""
        return "cuda:0" if self.kind == "gpu" else "cpu"

    @property
    def title(self) -> str:
        engine = {"onnxruntime": "ONNX Runtime", "torch": "torch (TorchScript)"}[self.engine]
        return f"{engine} on {'the GPU' if self.kind == 'gpu' else 'the CPU'}"


@dataclasses.dataclass(frozen=True)
class Config:
    key: str
    title: str
    ragged: bool
    grouping: str
    max_queue_delay_us: int | None = None  # None: the recipe's
    parameters: tuple[tuple[str, str], ...] = ()  # extra backend parameters (config.pbtxt)


CONFIGS = (
    Config("a", "(a) ours: ragged + cost-model groups (learning online)", True, "cost_model"),
    Config("b", "(b) Triton dynamic batching, equal shapes only", False, "pad_to_longest"),
    Config("c", "(c) ragged, padded to the longest", True, "pad_to_longest"),
)


MIXED = 0  # the regime key of the mixed load: 1, then 64, then 8 in flight within one run
MIXED_PHASES = (1, 64, 8)


def regime(conc: int) -> str:
    """A regime's name in the tables: requests in flight, or the mixed load's phases."""
    return " → ".join(map(str, MIXED_PHASES)) + " (mixed)" if conc == MIXED else str(conc)


def parse_regimes(text: str) -> list[int]:
    """``1,8,64,mixed`` → [1, 8, 64, MIXED]."""
    out = []
    for part in text.split(","):
        part = part.strip()
        out.append(MIXED if part == "mixed" else int(part))
    return out


# (a) as it was before the cost model learned online: the full load-time sweep, constants fixed from then on.
SNAPSHOT = Config("a2", "(a′) snapshot: (a) with the load-time sweep's constants, fixed", True, "cost_model",
                  parameters=(("cost_model_warmup", "sweep"), ("cost_model_online", "false")))




def gpu_text() -> str:
    """The GPU this process sees through torch, or "no GPU"."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"GPU: {torch.cuda.get_device_name(0)}"
    except Exception:  # noqa: BLE001 - no torch, or a broken driver: report it as no GPU
        pass
    return "no GPU"


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


# --------------------------------------------------------------------------- set-up


def random_weights_folder(source: Path, dest: Path, seed: int = 0) -> Path:
    """A Hugging Face folder with ``source``'s config and tokenizer and fresh random weights (seeded)."""
    import shutil

    import torch
    import transformers

    if (dest / "config.json").is_file() and any(dest.glob("*.safetensors")):
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".h5", ".msgpack", ".onnx")):
            shutil.copy2(f, dest / f.name)
    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(str(source), local_files_only=True)
    transformers.AutoModel.from_config(config).eval().save_pretrained(str(dest))
    return dest


def export(work: Path, setup: Setup = Setup()) -> tuple[Any, Any]:
    from model_factory.build_engines.export import export_model
    from model_factory.recipe import load_recipe

    overrides: dict[str, Any] = {"repository.path": str(work / "unused"), "precisions": ["fp32"],
                                 "export.torchscript": setup.engine == "torch", "tensorrt.enabled": False,
                                 "repository.instance_count": setup.instances}
    if setup.source is not None:  # the whole [source] table: the packaged MiniLM may not be installed there
        folder = random_weights_folder(setup.source, work / "random_weights") if setup.random_weights else setup.source
        overrides["source"] = {"kind": "huggingface", "path": str(Path(folder).resolve())}
    recipe = load_recipe(RECIPE, overrides)
    cached = recipe.work_dir / "export"
    needed = ["model.onnx", "tokenizer/tokenizer.json"] + (["model.torchscript.pt"] if setup.engine == "torch" else [])
    if all((cached / n).is_file() for n in needed):
        say(f"reusing the export in {cached}")
        from types import SimpleNamespace

        ts = cached / "model.torchscript.pt"
        return recipe, SimpleNamespace(onnx_path=cached / "model.onnx", tokenizer_dir=cached / "tokenizer",
                                       torchscript_path=ts if ts.is_file() else None)
    say(f"exporting {recipe.source.path} (FP32{', TorchScript' if setup.engine == 'torch' else ''})")
    return recipe, export_model(recipe)


def package(recipe: Any, exported: Any, work: Path, cfg: Config, setup: Setup = Setup()) -> Path:
    from model_factory.build.repository import package_model

    variant = dataclasses.replace(
        recipe,
        batching=dataclasses.replace(
            recipe.batching, ragged=cfg.ragged, grouping=cfg.grouping,
            max_queue_delay_us=recipe.batching.max_queue_delay_us if cfg.max_queue_delay_us is None
            else cfg.max_queue_delay_us),
        repository=dataclasses.replace(recipe.repository, path=work / f"repo_{cfg.key}", instance_kind=setup.kind),
    )
    artifacts = {"model.onnx": exported.onnx_path}
    if setup.engine == "torch":
        artifacts["model.torchscript.pt"] = exported.torchscript_path
    package_model(variant, artifacts, tokenizer_dir=exported.tokenizer_dir,
                  parameters={"engine": setup.engine, **dict(cfg.parameters)})
    return variant.repository.path


def start_server(repo: Path, log: Path) -> Any:
    from model_factory.serving.server import ServerOptions, TritonServer

    server = TritonServer(repo, [MODEL], ServerOptions(0, 0, 0), log_file=log).start()
    if server.load_errors:
        server.stop()
        raise SystemExit(f"{repo}: the model did not load: {server.load_errors}")
    return server


# --------------------------------------------------------------------------- bare engine, in-process


def bare_engine(exported: Any, setup: Setup, threads: int | None = None) -> Any:
    """The backend's own engine class on the exported model, outside Triton."""
    if setup.engine == "torch":
        from model_factory.backend.engines.torch import TorchEngine

        return TorchEngine(Path(exported.torchscript_path).read_bytes(), setup.device)
    from model_factory.backend.engines.onnxruntime import OnnxRuntimeEngine

    return OnnxRuntimeEngine(exported.onnx_path, threads=threads)


def bare_ort(exported: Any, payloads: Sequence[bench.Payload], window: int, cost: tuple[float, float, float],
             max_batch: int, mode: str, threads: int | None = None, setup: Setup = Setup()) -> dict[str, Any]:
    """Run the stream in-process as the backend would, on windows of ``window`` requests."""
    from model_factory.backend.batching.executor import pad_items
    from model_factory.backend.batching.grouping import CostModel, plan_groups

    engine = bare_engine(exported, setup, threads)
    names = engine.input_names
    seq = frozenset(names)
    items = []
    for p in payloads:
        item = {"input_ids": p.input_ids, "attention_mask": p.attention_mask}
        if "token_type_ids" in names:
            item["token_type_ids"] = np.zeros_like(p.input_ids)
        items.append(item)
    model = CostModel(*cost)
    plans = []
    for start in range(0, len(items), window):
        idx = list(range(start, min(start + window, len(items))))
        lengths = [int(items[i]["input_ids"].shape[0]) for i in idx]
        plans.append([[idx[j] for j in g] for g in plan_groups(lengths, model, max_batch, None, mode)])
    batches = [[int(items[i]["input_ids"].shape[0]) for i in g] for groups in plans for g in groups]
    # Warm-up: one launch of each shape class, not timed.
    for g in plans[0]:
        engine.run(pad_items([items[i] for i in g], names, seq, max(len(items[i]["input_ids"]) for i in g)))
    start = time.perf_counter()
    for groups in plans:
        for g in groups:
            length = max(int(items[i]["input_ids"].shape[0]) for i in g)
            engine.run(pad_items([items[i] for i in g], names, seq, length))
    seconds = time.perf_counter() - start
    engine.close()
    return {"window": window, "mode": mode, "threads": threads or "default", "seconds": seconds,
            "throughput": len(items) / seconds, "launches": len(batches),
            "padding_ratio": bench.batches_padding_ratio(batches)}


# --------------------------------------------------------------------------- regimes, READY


def run_regime(server: Any, payloads: Sequence[bench.Payload], conc: int, args: argparse.Namespace,
               key: str) -> bench.BenchResult:
    """One run at ``conc`` in flight, or the mixed load: a third of the stream at each of MIXED_PHASES in turn."""
    url = server.grpc_url if args.protocol == "grpc" else server.http_url
    if conc != MIXED:
        return bench.run_load(url, MODEL, payloads, protocol=args.protocol, concurrency=conc, warmup=args.warmup,
                              send="ids", metrics_url=server.metrics_url, label=key)
    parts = []
    step = -(-len(payloads) // len(MIXED_PHASES))
    for i, phase in enumerate(MIXED_PHASES):
        chunk = payloads[i * step:(i + 1) * step]
        r = bench.run_load(url, MODEL, chunk, protocol=args.protocol, concurrency=phase,
                           warmup=args.warmup if i == 0 else 0, send="ids", metrics_url=server.metrics_url, label=key)
        parts.append(dataclasses.replace(r, concurrency=MIXED))
    return bench.merge_results(parts)


LEARNING_COUNTERS = ("timings", "outliers", "refits", "plan_changes", "explorations")


def learning_counters(samples: Sequence[Any]) -> dict[str, float]:
    """The cost model's counters (docs/metrics.md) of the model, summed over instances."""
    out = {k: bench.metric_total(samples, f"model_factory_cost_model_{k}_total", model=MODEL) or 0.0
           for k in LEARNING_COUNTERS}
    for plan in ("chosen", "best", "one_group", "singles"):
        out[f"modelled_{plan}"] = bench.metric_total(samples, "model_factory_cost_model_modelled_seconds_total",
                                                     model=MODEL, plan=plan) or 0.0
    return out


READY_KINDS = (
    ("sweep", "before: the load-time sweep (every start)", (("cost_model_warmup", "sweep"),
                                                             ("cost_model_online", "false")), False),
    ("short", "short warm-up, no learned constants yet", (), False),
    ("cached", "restart with learned constants (cost cache)", (), True),
)


def measure_ready(recipe: Any, exported: Any, work: Path, rounds: int, setup: Setup) -> dict[str, Any]:
    """``serve`` → model READY, side by side: the load-time sweep, the short warm-up, a restart with a cache.

    Each start goes through ``start_verified_server`` (what ``model-factory serve`` runs; without a policy
    here, as the benchmark's repositories are not signed) and is timed until it returns with the model
    loaded. The cache is primed once first: a start, 64 requests, a stop (the instance saves at unload).
    Kinds run in a fresh seeded order every round.
    """
    from model_factory.serving.server import ServerOptions, start_verified_server

    repos = {key: package(recipe, exported, work, Config(f"ready_{key}", title, True, "cost_model",
                                                         parameters=params), setup)
             for key, title, params, _ in READY_KINDS if key != "cached"}
    repos["cached"] = repos["short"]
    cache = work / "cost-cache"
    import shutil

    shutil.rmtree(cache, ignore_errors=True)

    def start(key: str, cached: bool, log: Path) -> tuple[Any, float]:
        t0 = time.perf_counter()
        server, report = start_verified_server(repos[key], ServerOptions(0, 0, 0), None, allow_unsigned=True,
                                               log_file=log, cost_cache=cache if cached else None)
        seconds = time.perf_counter() - t0
        if report.refused:
            server.stop()
            raise SystemExit(f"READY measurement: the model did not load: {report.refused}")
        return server, seconds

    texts = bench.draw_texts(bench.load_texts(TEXTS), 64, 1)
    prime_payloads = bench.make_payloads(texts, bench.load_tokenizer(exported.tokenizer_dir,
                                                                     recipe.shapes.max_sequence_length))
    server, seconds = start("cached", True, work / "ready_prime.log")
    try:
        bench.run_load(server.grpc_url, MODEL, prime_payloads, protocol="grpc", concurrency=8, warmup=0, send="ids")
    finally:
        server.stop()
    say(f"READY: cache primed ({seconds:.1f} s to READY without it), {sorted(p.name for p in cache.iterdir())}")
    times: dict[str, list[float]] = {key: [] for key, *_ in READY_KINDS}
    for rnd in range(rounds):
        order = [key for key, *_ in READY_KINDS]
        random.Random(f"ready-{rnd}").shuffle(order)
        for key in order:
            cached = dict((k, c) for k, _, _, c in READY_KINDS)[key]
            server, seconds = start(key, cached, work / f"ready_{key}_{rnd}.log")
            server.stop()
            times[key].append(seconds)
            say(f"READY round {rnd + 1}: {key} {seconds:.2f} s (load {loadavg()})")
    lines = []
    log = work / f"ready_cached_{rounds - 1}.log"
    if log.is_file():
        lines = [line.split('"', 1)[-1].rstrip('"') for line in log.read_text(errors="replace").splitlines()
                 if "cost model learned before" in line]
    return {"times": times, "titles": {k: t for k, t, _, _ in READY_KINDS}, "log": lines[:1]}


def ready_notes(ready: dict[str, Any]) -> list[str]:
    """The READY targets, as lines for the reading."""
    if not ready:
        return []
    med = {k: statistics.median(v) for k, v in ready["times"].items() if v}
    out = ["", "serve → READY (MiniLM, this run, medians): " + "; ".join(
        f"{ready['titles'][k]}: {v:.2f} s" for k, v in med.items()) + "."]
    if "short" in med:
        out.append(f"- Target READY ≤ 3 s with the short warm-up: {verdict(med['short'] <= 3.0)} ({med['short']:.2f} s"
                   + (f", {med['sweep'] / med['short']:.1f}× faster than the sweep" if "sweep" in med else "") + ").")
    if "cached" in med:
        out.append(f"- Target READY ≤ 1.5 s on a restart with learned constants: {verdict(med['cached'] <= 1.5)} "
                   f"({med['cached']:.2f} s).")
    return out


# --------------------------------------------------------------------------- report


def fmt(x: Any, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


@dataclasses.dataclass(frozen=True)
class Ratio:
    """A ratio taken round by round (the runs of one round are close in time): median and range."""

    rounds: tuple[float, ...]

    @property
    def median(self) -> float | None:
        return statistics.median(self.rounds) if self.rounds else None

    def text(self) -> str:
        if not self.rounds:
            return "n/a"
        return f"{self.median:.2f} ({min(self.rounds):.2f}–{max(self.rounds):.2f})"


def regime_summary(runs: dict[tuple[str, int], list[bench.BenchResult]], bare: dict[int, list[dict[str, Any]]],
                   conc: int) -> dict[str, Any]:
    """Per-config median throughput and the round-by-round ratios of one regime."""
    per = {k: [r.throughput for r in runs.get((k, conc), [])] for k in ("a", "b", "c", "a2")}
    bare_t = [x["throughput"] for x in bare.get(conc, [])]
    n = min(len(per[k]) for k in "abc")
    a, b, c = (per[k][:n] for k in "abc")
    out = {
        "median": {k: statistics.median(v) if v else None for k, v in per.items()},
        "per_round": per,
        "bare": bare_t,
        "a/b": Ratio(tuple(x / y for x, y in zip(a, b))),
        "a/c": Ratio(tuple(x / y for x, y in zip(a, c))),
        "a/best": Ratio(tuple(x / max(y, z) for x, y, z in zip(a, b, c))),
        # a >= k * max(b, c) holds exactly when both a/b >= k and a/c >= k: take the smaller of the two
        # medians. (The median of the per-round a/max(b, c) is biased low when the configurations are
        # equal, as at one request in flight: the max of two noisy equals is above their mean.)
        # The bare replay runs in the same round as (a), so the pairs are close in time too.
        "a/bare": Ratio(tuple(x / y for x, y in zip(per["a"], bare_t))),
        "a2/a": Ratio(tuple(x / y for x, y in zip(per["a2"], per["a"]))),
        "a2/b": Ratio(tuple(x / y for x, y in zip(per["a2"], per["b"]))),
        "a2/bare": Ratio(tuple(x / y for x, y in zip(per["a2"], bare_t))),
    }
    meds = [out["a/b"].median, out["a/c"].median]
    out["better"] = None if None in meds else min(meds)
    # With one request in flight nothing can be batched: all three run the same batch-1 path, so only
    # the no-regression target (0.95x) applies there, not the speed-up targets.
    out["batching"] = conc > 1 or conc == MIXED
    return out


def _machine_share(env: dict[str, Any]) -> str:
    """Whether other work shared the cores, judged by the 1-minute load before and after the run."""
    loads = []
    for key in ("load_before", "load_after"):
        try:
            loads.append(float(str(env.get(key, "")).split()[0]))
        except (ValueError, IndexError):  # "n/a" where the platform has no load average
            continue
    cores = os.cpu_count() or 1
    # The benchmark's own client and servers keep the load near the core count; well above it is other work.
    if not loads:
        return "The load average is not available here, so whether other work shared the cores is unknown."
    if max(loads) > 1.5 * cores:
        return ("Other work shared the cores during the measurement (load well above the core count), so single "
                "runs swing by up to 3×.")
    return ("Nothing else of note ran (load within 1.5× the core count: the benchmark's own client and servers); "
            "single runs still swing.")


def render(env: dict[str, Any], configs: Sequence[Config], merged: dict[tuple[str, int], bench.BenchResult],
           summaries: dict[int, dict[str, Any]], costs: dict[str, Any], bare: dict[int, list[dict[str, Any]]],
           bare_extra: dict[str, Any], args: argparse.Namespace, lengths: Sequence[int], setup: Setup = Setup()) -> str:
    concs = list(summaries)
    cpu = setup.kind == "cpu"
    model = "MiniLM" + (" (its architecture, random weights)" if setup.random_weights else "")
    out = [setup.markers[0], f"## Grouped batching (issues 5, 10): {model} on {setup.title} behind Triton", ""]
    out += [f"Run {env['date']} by `benchmarks/bench_batching.py` ({' '.join(env['argv']) or 'defaults'}), "
            f"{env['minutes']:.0f} min.", ""]
    out += ["**Machine**: " + env["machine"] + ". Load average (1/5/15 min) before: " + env["load_before"]
            + ", after: " + env["load_after"] + ". " + _machine_share(env) + " The configurations run "
            "interleaved, in a fresh seeded random order every round (a fixed rotation kept each run's "
            "predecessor and showed a bias of up to 15% between identical configurations), round after round; throughput is the **median over rounds**, "
            "ratios are taken **within each round** and given as median (min–max), latencies are pooled over "
            "all rounds.", ""]
    engine_text = (f"ONNX Runtime {env['onnxruntime']} CPU provider with the backend's defaults (intra-op threads: "
                   "the cores split between the instances)" if setup.engine == "onnxruntime" else
                   f"torch {env.get('torch', 'n/a')} running the export's TorchScript on {setup.device} "
                   f"({env.get('gpu', 'no GPU')})")
    out += [f"**Software**: Triton {env['triton']} (nvidia-pytriton {env['pytriton']}), {engine_text}, "
            f"{'one' if setup.instances == 1 else setup.instances} {setup.kind.upper()} "
            f"instance{'' if setup.instances == 1 else 's'} per model, Python {env['python']}; tritonclient {env['tritonclient']} "
            f"asyncio {args.protocol} client in the benchmark's process, sharing the cores with the servers.", ""]
    out += [f"**Load**: {args.requests} requests per run (+{args.warmup} warm-up, not counted), "
            f"{args.rounds} rounds per regime, a fixed number of requests in flight (the regime). One sequence "
            "per request, sent as **token ids** (`input_ids` + `attention_mask`, [1, L]): ids isolate "
            "batching from tokenization, and as text every request would have shape [1, 1], so (b) would "
            "batch everything. Lengths drawn with a fixed seed from `benchmarks/texts.txt` (English sentences "
            f"and paragraphs): mean {statistics.mean(lengths):.1f}, median {statistics.median(lengths):.0f}, "
            f"max {max(lengths)} MiniLM tokens. Recipe (`model_factory/examples/minilm.toml`): max_batch "
            f"{env['recipe']['max_batch']}, preferred batch sizes {env['recipe']['preferred']}, max queue delay "
            f"{env['recipe']['delay_us']} µs.", ""]
    out += ["(a) ragged + cost-model groups (ours); (b) no `allow_ragged_batch`, so Triton batches only "
            "equal shapes, run as one launch; (c) ragged, each window padded to its longest. *padding* = "
            "computed tokens / real tokens over the run, from the backend's counters on the metrics port "
            "(`model_factory_computed_tokens_total` / `model_factory_real_tokens_total`: our backend runs in "
            "all three, so (b) is measured the same way). *batch* = Triton's requests per model execution "
            "(`nv_inference_count` / `nv_inference_exec_count`).", ""]
    out += ["Cost model each server measured at load (`a + b·n·L + c·n·L²`, seconds): "
            + "; ".join(f"({k}) a={v[0]:.3g} b={v[1]:.3g} c={v[2]:.3g}" if v else f"({k}) n/a"
                        for k, v in costs.items()) + ". Only (a) uses it.", ""]
    out += ["| regime (in flight) | config | seq/s (median) | p50 ms | p99 ms | padding | batch | errors | "
            "seq/s per round |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for conc in concs:
        summ = summaries[conc]
        for cfg in configs:
            r = merged.get((cfg.key, conc))
            if r is None:
                continue
            rounds = ", ".join(f"{x:.1f}" for x in summ["per_round"][cfg.key])
            out.append(f"| {regime(conc)} | {cfg.title} | {fmt(summ['median'][cfg.key], '.1f')} | {r.p50_ms:.0f} | "
                       f"{r.p99_ms:.0f} | {fmt(r.padding_ratio, '.3f')} | {fmt(r.mean_batch)} | {r.errors} | "
                       f"{rounds} |")
    out += ["", f"### Ratios and targets (this {'CPU' if cpu else 'GPU'} machine)", ""]
    out += ["(a)/(b), (a)/(c): median over rounds of the ratio within each round (min–max). *vs better* = the "
            "smaller of those two medians: (a) ≥ k× the better of (b) and (c) exactly when both ratios are ≥ k. "
            "With one request in flight nothing can batch, all three configurations run the same batch-1 "
            "path (batch 1.00, padding 1.000 above), so there only the no-regression target (≥ 0.95×) "
            "applies" + ("; the CPU speed-up targets (≥ 1.1×, ≥ 3× (c)) are checked where requests batch." if cpu
                         else ". The CPU speed-up and padding targets do not apply on a GPU."), ""]
    if cpu:
        out += ["| regime | (a)/(b) | (a)/(c) | vs better | ≥ 0.95× better | CPU ≥ 1.1× better | CPU ≥ 3× (c) at 64 "
                "| CPU padding(a) ≤ 1.15 | (a)/bare | overhead ≥ 0.85 |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    else:
        out += ["| regime | (a)/(b) | (a)/(c) | vs better | ≥ 0.95× better | padding(a) | (a)/bare | overhead ≥ 0.85 |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for conc in concs:
        summ = summaries[conc]
        best, ac, ov = summ["better"], summ["a/c"].median, summ["a/bare"].median
        a = merged.get(("a", conc))
        pad = a.padding_ratio if a else None
        speedup = summ["batching"]
        if not cpu:
            out.append(f"| {regime(conc)} | {summ['a/b'].text()} | {summ['a/c'].text()} | {fmt(best)} | "
                       f"{verdict(None if best is None else best >= 0.95)} | {fmt(pad, '.3f')} | "
                       f"{summ['a/bare'].text()} | {verdict(None if ov is None else ov >= 0.85)} |")
            continue
        out.append(f"| {regime(conc)} | {summ['a/b'].text()} | {summ['a/c'].text()} | {fmt(best)} | "
                   f"{verdict(None if best is None else best >= 0.95)} | "
                   f"{verdict(None if best is None or not speedup else best >= 1.1)} | "
                   f"{verdict(None if ac is None or not speedup or conc != 64 else ac >= 3)} | "
                   f"{verdict(None if pad is None else pad <= 1.15)} ({fmt(pad, '.3f')}) | {summ['a/bare'].text()} | "
                   f"{verdict(None if ov is None else ov >= 0.85)} |")
    if any(summaries[c]["a2/a"].rounds for c in concs):
        title = next(c.title for c in configs if c.key == "a2")
        out += ["", f"What-if, same rounds: {title}, a candidate recipe change. Ratios per round, median (min–max):",
                "", "| regime | (a′)/(a) | (a′)/(b) | (a′)/bare ORT |", "| --- | --- | --- | --- |"]
        out += [f"| {regime(c)} | {summaries[c]['a2/a'].text()} | {summaries[c]['a2/b'].text()} | "
                f"{summaries[c]['a2/bare'].text()} |" for c in concs]
    bare_class = "TorchEngine" if setup.engine == "torch" else "OnnxRuntimeEngine"
    out += ["", f"### Server overhead: the same groups on the bare engine ({bare_class}), in-process", ""]
    out += ["Each round also replays the stream in-process: cut into consecutive windows of (a)'s mean batch "
            "in that regime, each split by the cost model (a)'s server measured, run through the backend's "
            f"own `{bare_class}` (on {setup.device}) and `pad_items` (no Triton, no client, no IPC; one window of "
            "warm-up). (a)/bare above pairs each round's (a) run with that round's replay.", ""]
    out += ["| regime | window | launches | padding | bare seq/s (median) | per round |",
            "| --- | --- | --- | --- | --- | --- |"]
    for conc in concs:
        xs = bare.get(conc)
        if not xs:
            continue
        x = xs[-1]
        rounds = ", ".join(format(v["throughput"], ".1f") for v in xs)
        med = statistics.median(v["throughput"] for v in xs)
        out.append(f"| {regime(conc)} | {x['window']} | {x['launches']} | {x['padding_ratio']:.3f} | {med:.1f} | {rounds} |")
    splits = {conc: bench.time_split(merged[("a", conc)]) for conc in concs if ("a", conc) in merged}
    if any(splits.values()):
        out += ["", "Where (a)'s time goes, mean ms per request from the client inwards (Triton's own duration "
                "counters and the backend's `model_factory_execute_seconds_total`, over all rounds): *client* as "
                "the client saw it; *Triton* from arrival to response sent; *queue* in the scheduler; *infer* the "
                "backend's execution as Triton times it (a batched request counts its whole execution); "
                "*execute()* our own wall time per execution; *bare* the bare engine's time per request at "
                "window 1 (one request in flight only). client − Triton is the client and gRPC; Triton − queue "
                "− infer is Triton's front end and tensor copies; infer − execute() is the Python backend's "
                "IPC around `execute()`.", "",
                "| regime | client | Triton | queue | infer | execute() | bare |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for conc, sp in splits.items():
            if not sp:
                continue
            xs = bare.get(conc) or []
            bare_ms = (1e3 / statistics.median(x["throughput"] for x in xs)) if xs and xs[-1]["window"] == 1 else None
            out.append(f"| {regime(conc)} | {sp['client']:.2f} | {sp['triton']:.2f} | {sp['queue']:.2f} | {sp['infer']:.2f} | "
                       f"{sp['execute']:.2f} | {fmt(bare_ms)} |")
    if bare_extra:
        out += ["", "Context, same stream on bare ORT in-process, one pass each after the rounds (noisy): "
                + "; ".join(f"{k}: {v['throughput']:.1f} seq/s (padding {v['padding_ratio']:.3f}, "
                            f"{v['launches']} launches)" for k, v in bare_extra.items()) + "."]
    out += learning_section(env.get("learning") or {}, costs)
    out += ["", "### Reading", ""] + env.get("notes", ["(no notes)"]) + ["", setup.markers[1]]
    return "\n".join(out)


def learning_section(learning: dict[str, Any], costs: dict[str, Any]) -> list[str]:
    """What the cost model learned over the rounds, and the READY times."""
    out: list[str] = []
    counters = learning.get("counters") or {}
    end = learning.get("costs_end") or {}
    if counters.get("a"):
        c = counters["a"]
        out += ["", "### What (a)'s cost model learned over the rounds", ""]
        out += ["(a) starts from the short warm-up and refits from the timings of its own launches "
                "(`backends/python_backend/batching/cost_estimator.py`); (a′) keeps the constants of the load-time sweep. "
                "From the metrics port at the end of the rounds (docs/metrics.md):", ""]
        out += ["| config | a, b, c at load (s) | a, b, c at the end (s) |", "| --- | --- | --- |"]
        for key in costs:
            start, stop = costs.get(key), end.get(key)
            if start or stop:
                out.append(f"| ({key}) | {' / '.join(format(x, '.3g') for x in start) if start else 'n/a'} | "
                           f"{' / '.join(format(x, '.3g') for x in stop) if stop else 'n/a'} |")
        saved = (c["modelled_one_group"] - c["modelled_chosen"], c["modelled_singles"] - c["modelled_chosen"])
        out += ["", f"(a): {c['timings']:.0f} launches timed, {c['refits']:.0f} refits, {c['outliers']:.0f} timings "
                f"> 3× from their cell's median (kept out by the medians), {c['plan_changes']:.0f} recent windows "
                f"re-split by a refit, {c['explorations']:.0f} windows explored a split not timed before (modelled "
                f"cost {c['modelled_chosen'] - c['modelled_best']:.3f} s over the best, of "
                f"{c['modelled_best']:.1f} s planned). Modelled seconds of the splits run: {c['modelled_chosen']:.1f}; "
                f"of one padded group per window: {c['modelled_one_group']:.1f} ({saved[0]:+.1f}); of one launch per "
                f"sequence: {c['modelled_singles']:.1f} ({saved[1]:+.1f})."]
    ready = learning.get("ready") or {}
    if ready.get("times"):
        out += ["", "### serve → READY (MiniLM)", ""]
        out += ["`start_verified_server` (what `model-factory serve` runs) until the model is loaded, each kind "
                "started in a fresh seeded order every round, in this same run:", ""]
        out += ["| start | median s | min s | per round |", "| --- | --- | --- | --- |"]
        for key, xs in ready["times"].items():
            if xs:
                out.append(f"| {ready['titles'][key]} | {statistics.median(xs):.2f} | {min(xs):.2f} | "
                           f"{', '.join(format(x, '.2f') for x in xs)} |")
        if ready.get("log"):
            out += ["", "The load log of the last restart: `" + ready["log"][0][:400] + "`"]
    return out


def notes(merged: dict[tuple[str, int], bench.BenchResult], summaries: dict[int, dict[str, Any]],
          costs: dict[str, Any], bare: dict[int, list[dict[str, Any]]], setup: Setup = Setup()) -> list[str]:
    """Which targets this run met, and what the numbers say about the misses (all computed)."""
    missed, met = [], []
    cpu = setup.kind == "cpu"
    for conc, summ in summaries.items():
        speedup = summ["batching"] and cpu  # the speed-up and padding targets are the CPU's
        checks = [("(a) ≥ 0.95× the better of (b) and (c)", summ["better"], 0.95, True),
                  ("CPU: (a) ≥ 1.1× the better of (b) and (c)", summ["better"] if speedup else None, 1.1, True),
                  ("CPU: (a) ≥ 3× (c) at 64 in flight", summ["a/c"].median if speedup and conc == 64 else None, 3.0,
                   True),
                  ("CPU: padding ratio of (a) ≤ 1.15",
                   merged[("a", conc)].padding_ratio if cpu and ("a", conc) in merged else None, 1.15, False),
                  ("server overhead: (a) ≥ 0.85× the bare engine on the same groups", summ["a/bare"].median, 0.85,
                   True)]
        for name, value, limit, at_least in checks:
            if value is None:
                continue
            ok = value >= limit if at_least else value <= limit
            (met if ok else missed).append(f"in flight {regime(conc)}: {name}: {value:.2f}")
    lines = ["Targets met in this run: " + ("; ".join(met) if met else "none") + ".", ""]
    lines.append("Targets missed in this run: " + ("; ".join(missed) if missed else "none") + ".")
    lines.append("")
    for conc, summ in summaries.items():
        b, c = merged.get(("b", conc)), merged.get(("c", conc))
        bc = Ratio(tuple(x / y for x, y in zip(summ["per_round"]["b"], summ["per_round"]["c"]))).median
        if cpu and summ["batching"] and summ["a/c"].median is not None and summ["a/c"].median < 3 and b and c and bc:
            lines.append(f"- {regime(conc)} in flight: (c) pads windows of {fmt(c.mean_batch, '.1f')} requests (padding "
                         f"{fmt(c.padding_ratio)}) and is only {bc:.2f}× slower than batch-1 (b), so (a) ≥ 3× (c) "
                         f"would need (a) at {3 / bc:.2f}× (b); it is at {fmt(summ['a/b'].median)}×.")
            bare_med = statistics.median(summ["bare"]) if summ["bare"] else None
            c_med = summ["median"]["c"]
            if bare_med and c_med and bare_med / c_med < 3:
                summ_window = (bare.get(conc) or [{}])[-1].get("window", "?")
                lines.append(f"- {regime(conc)} in flight: even with no server overhead at all, (a) would run at most as fast "
                             f"as the bare engine on the same groups in-process ({bare_med:.1f} seq/s, windows of "
                             f"{summ_window}), which is {bare_med / c_med:.2f}× (c) ({c_med:.1f} seq/s): with windows "
                             "this small, ≥ 3× (c) is out of reach on this machine.")
        if summ["a2/a"].rounds:
            lines.append(f"- {regime(conc)} in flight: the what-if (a′) is {summ['a2/a'].median:.2f}× (a) and "
                         f"{fmt(summ['a2/bare'].median)}× the bare engine on the same groups.")
    measured = [v for v in costs.values() if v]
    if len(measured) > 1:
        lo, hi = min(v[1] for v in measured), max(v[1] for v in measured)
        lines.append(f"- The same engine, measured at load by each server minutes apart, gave b (seconds per "
                     f"token) from {lo:.3g} to {hi:.3g} ({hi / lo:.1f}×)"
                     + (": on this shared machine the load-time sweep is noisy." if hi / lo > 1.5 else "."))
    if cpu:
        lines += ["", "The GPU target (≥ 0.95× on a GPU machine) is measured by the same script on a GPU machine "
                  "(`--kind gpu --engine torch`: the export's TorchScript on CUDA, since the GPU machine lent to "
                  "this project has no TensorRT and TensorRT-RTX refuses compute capability 9.0), which "
                  "`benchmarks/gpu_checks.sh` runs on MiniLM's architecture with random weights (MiniLM's weights "
                  "do not fit the 64 MiB a device call carries beside Triton); its section is "
                  "`batching-gpu-torch`, below when a GPU run has been brought back."]
    return lines


def write_section(path: Path, section: str, setup: Setup = Setup()) -> None:
    """Replace this run's section of RESULTS.md; other sections stay as they are."""
    results_file.write_section(path, *setup.markers, section)


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=240, help="measured requests per run")
    ap.add_argument("--warmup", type=int, default=24, help="warm-up requests per run (not counted)")
    ap.add_argument("--concurrency", default="1,8,64,mixed",
                    help="comma-separated regimes: requests in flight, or 'mixed' (1, then 64, then 8 in flight, "
                         "a third of the requests each, in one run)")
    ap.add_argument("--rounds", type=int, default=8, help="rounds per regime (configs interleaved)")
    ap.add_argument("--protocol", choices=bench.PROTOCOLS, default="grpc")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--results", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    ap.add_argument("--no-write", action="store_true", help="print only, do not update RESULTS.md")
    ap.add_argument("--what-if-delay-us", type=int, default=-1,
                    help="also run (a) with this max_queue_delay_us, as a what-if row (-1: don't); "
                         "takes the place of the snapshot row")
    ap.add_argument("--no-snapshot", action="store_true",
                    help="leave out (a′), (a) with a snapshot cost model (the load-time sweep, no online learning)")
    ap.add_argument("--ready-rounds", type=int, default=3,
                    help="serve → READY, measured this many times per warm-up kind (0: don't)")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (implies --no-write)")
    ap.add_argument("--kind", choices=("cpu", "gpu"), default="cpu", help="Triton instance kind")
    ap.add_argument("--engine", choices=("onnxruntime", "torch"), default="onnxruntime",
                    help="the backend's engine (torch: the export's TorchScript)")
    ap.add_argument("--source", type=Path, default=None,
                    help="a Hugging Face folder to serve instead of the packaged MiniLM")
    ap.add_argument("--random-weights", action="store_true",
                    help="give --source's architecture fresh seeded weights (only its config and tokenizer needed)")
    ap.add_argument("--instances", type=int, default=1,
                    help="model instances per server (1: batching compared alone; the recipe's default is 2)")
    ap.add_argument("--section", default=None,
                    help="RESULTS.md section (markers <!-- NAME:start/end -->) to write instead of the default one")
    args = ap.parse_args(argv)
    if args.random_weights and args.source is None:
        ap.error("--random-weights needs --source (a folder with config.json and the tokenizer files)")
    setup = Setup(args.kind, args.engine, args.source, args.random_weights, args.section, args.instances)
    if setup.engine == "torch" and setup.kind == "gpu":
        # Before anything imports torch here: the bare replay then runs on the same cudaMallocAsync
        # allocator as the served engine (torch fixes its allocator backend at import).
        from model_factory.backend.engines.torch import configure_cuda_allocator

        configure_cuda_allocator()
    if args.quick:
        args.requests, args.warmup, args.rounds, args.concurrency, args.no_write = 40, 8, 1, "8,mixed", True
        args.ready_rounds = min(args.ready_rounds, 1)
    concs = parse_regimes(args.concurrency)
    configs = list(CONFIGS)
    if args.what_if_delay_us >= 0 and not args.quick:
        configs.append(Config("a2", f"(a′) what-if: (a) with max queue delay {args.what_if_delay_us} µs", True,
                              "cost_model", args.what_if_delay_us))
    elif not args.no_snapshot and not args.quick:
        configs.append(SNAPSHOT)

    import importlib.metadata as md

    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "argv": list(argv if argv is not None else sys.argv[1:]),
        "machine": f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
                   f"{platform.system()} {platform.release()}, " + gpu_text(),
        "load_before": loadavg(), "python": platform.python_version(), "triton": "2.51.0",
    }
    env["gpu"] = env["machine"].rsplit(", ", 1)[-1]
    for dist in ("nvidia-pytriton", "onnxruntime", "tritonclient", "torch"):
        try:
            env[dist.replace("nvidia-", "")] = md.version(dist)
        except md.PackageNotFoundError:
            env[dist.replace("nvidia-", "")] = "n/a"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
        env["machine"] = env["machine"].replace(platform.processor() or platform.machine(), cpu, 1)
    except (OSError, StopIteration):
        pass

    t_start = time.perf_counter()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-batching-"))
    work.mkdir(parents=True, exist_ok=True)
    recipe, exported = export(work, setup)
    env["recipe"] = {"max_batch": recipe.shapes.max_batch, "preferred": list(recipe.batching.preferred_batch_sizes),
                     "delay_us": recipe.batching.max_queue_delay_us}
    texts = bench.draw_texts(bench.load_texts(TEXTS), args.requests, args.seed)
    tokenizer = bench.load_tokenizer(exported.tokenizer_dir, recipe.shapes.max_sequence_length)
    payloads = bench.make_payloads(texts, tokenizer)
    lengths = [p.length for p in payloads]

    servers: dict[str, Any] = {}
    costs: dict[str, Any] = {}
    costs_end: dict[str, Any] = {}
    learning: dict[str, dict[str, float]] = {}
    runs: dict[tuple[str, int], list[bench.BenchResult]] = {}
    bare: dict[int, list[dict[str, Any]]] = {}
    bare_extra: dict[str, Any] = {}
    try:
        for cfg in configs:
            repo = package(recipe, exported, work, cfg, setup)
            t0 = time.perf_counter()
            servers[cfg.key] = start_server(repo, work / f"triton_{cfg.key}.log")
            samples = bench.scrape_metrics(servers[cfg.key].metrics_url)
            costs[cfg.key] = bench.cost_model_from_metrics(samples, MODEL)
            say(f"{cfg.title}: server ready in {time.perf_counter() - t0:.1f} s, cost model {costs[cfg.key]}")
        for conc in concs:
            for rnd in range(args.rounds):
                # A fresh seeded order every round, so no run always follows the same other run (a fixed
                # rotation keeps each run's predecessor, and that showed as a bias). (a) opens the first
                # round, so the bare-ORT replay always has (a)'s measured mean batch to cut windows with.
                order = [c.key for c in configs] + ["bare"]
                random.Random(f"{args.seed}-{conc}-{rnd}").shuffle(order)
                if rnd == 0:
                    order.remove("a")
                    order.insert(0, "a")
                for key in order:
                    if key == "bare":
                        a = bench.merge_results(runs[("a", conc)])
                        if not (costs.get("a") and a.mean_batch):
                            continue
                        window = max(1, round(a.mean_batch))
                        # The constants (a)'s server plans with now (it keeps learning), else those it loaded with.
                        now = bench.cost_model_from_metrics(bench.scrape_metrics(servers["a"].metrics_url), MODEL)
                        x = bare_ort(exported, payloads, window, now or costs["a"], recipe.shapes.max_batch,
                                     "cost_model", setup=setup)
                        bare.setdefault(conc, []).append(x)
                        say(f"c={conc} round {rnd + 1}: bare ORT, windows of {window}: {x['throughput']:.1f} seq/s")
                        continue
                    s = servers[key]
                    r = run_regime(s, payloads, conc, args, key)
                    runs.setdefault((key, conc), []).append(r)
                    say(f"c={conc} round {rnd + 1}: {key} {r.throughput:.1f} seq/s p50 {r.p50_ms:.0f} ms "
                        f"p99 {r.p99_ms:.0f} ms padding {fmt(r.padding_ratio, '.3f')} batch {fmt(r.mean_batch)} "
                        f"errors {r.errors} {r.error_messages[:1]} (load {loadavg()})")
        if not args.quick and setup.engine == "onnxruntime":
            cost = costs.get("a") or (0.0, 1.0, 0.0)
            for threads in (None, 1):
                name = "ORT default threads" if threads is None else "intra-op threads = 1"
                bare_extra[f"batch-1, {name}"] = bare_ort(exported, payloads, 1, cost,
                                                          recipe.shapes.max_batch, "none", threads)
                bare_extra[f"cost-model groups in windows of 64, {name}"] = bare_ort(
                    exported, payloads, 64, cost, recipe.shapes.max_batch, "cost_model", threads)
            for k, v in bare_extra.items():
                say(f"bare ORT {k}: {v['throughput']:.1f} seq/s")
        for key, s in servers.items():
            samples = bench.scrape_metrics(s.metrics_url)
            costs_end[key] = bench.cost_model_from_metrics(samples, MODEL)
            learning[key] = learning_counters(samples)
    finally:
        for s in servers.values():
            s.stop()
    ready = measure_ready(recipe, exported, work, args.ready_rounds, setup) if args.ready_rounds > 0 else {}
    env["load_after"] = loadavg()

    env["minutes"] = (time.perf_counter() - t_start) / 60
    merged = {k: bench.merge_results(v) for k, v in runs.items()}
    summaries = {conc: regime_summary(runs, bare, conc) for conc in concs}
    env["notes"] = notes(merged, summaries, costs, bare, setup) + ready_notes(ready)
    env["learning"] = {"costs_end": costs_end, "counters": learning, "ready": ready}
    section = render(env, configs, merged, summaries, costs, bare, bare_extra, args, lengths, setup)
    print(section)
    (work / "bench_batching.json").write_text(json.dumps(
        {"env": env, "runs": {f"{k}@{c}": [r.as_dict() for r in v] for (k, c), v in runs.items()},
         "bare": bare, "bare_extra": bare_extra, "costs": costs, "costs_end": costs_end, "learning": learning,
         "ready": ready}, indent=2, default=str))
    say(f"raw results in {work / 'bench_batching.json'}")
    if not args.no_write:
        write_section(args.results, section, setup)
        say(f"wrote the batching section of {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
