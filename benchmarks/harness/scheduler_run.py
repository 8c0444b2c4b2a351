"""What the in-process text-generation benchmarks share (bench_kv_int8, bench_preemption,
bench_max_tokens_grouping, bench_paged_kv): the 110M Llama they run, its factory build at INT8 dynamic with the INT8
cache on the backend's engine, requests arriving from another thread while the backend's scheduler steps, and when
each request's first and last token came."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

# bench_generate's Llama in SmolLM-135M's shape (random weights), with a vocabulary of 6294.
SHAPE = dict(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab_size=6294, max_positions=2048,
             tie=True)


def llama_folder(work: Path | None, prefix: str) -> Path:
    """The HF folder of the 110M Llama under ``work`` (a new temporary folder when None), made when absent."""
    from benchmarks.results_file import say
    from tests.generative_models import make_causal_lm

    work = work or Path(tempfile.mkdtemp(prefix=prefix))
    hf = work / "hf"
    if not (hf / "config.json").is_file():
        say("making the 110M Llama (random weights)")
        make_causal_lm("llama", hf, **SHAPE)
    return hf


def int8_kv8_version(work: Path | None, prefix: str) -> Path:
    """The version folder of the factory's build of the 110M Llama at INT8 dynamic with the INT8 cache (the precision
    bench_generate serves best): ``work``/int8kv8-repo's when an earlier run built it there (the build takes 15 minutes
    or more on a loaded 2-core machine), else built now (into ``work`` when given, so the next run reuses it)."""
    from model_factory.backend.contract import Files
    from tests.generative_repository import layout_generative_model

    hf = llama_folder(work, prefix)
    repo = work / "int8kv8-repo" if work is not None else Path(tempfile.mkdtemp(prefix=f"{prefix}repo-"))
    built = sorted(repo.glob(f"llm/*/{Files.GENERATION}")) if work is not None else []
    if built:
        return built[-1].parent
    return layout_generative_model(hf, None, repo, "llm", precision="int8",
                                   quantization='int8_method = "dynamic"\nkv_cache = "int8"')


def int8_kv8_engine(work: Path | None, prefix: str, **engine: Any) -> tuple[Any, Any]:
    """``(spec, CausalLM)``: :func:`int8_kv8_version`'s graph on the backend's engine with 2 threads (``engine``: more
    ``CausalLM`` arguments, e.g. ``int8_attention="kernel", kv_block_tokens=16`` for the layout in blocks)."""
    from model_factory.backend.generation.causal_lm import CausalLM
    from model_factory.backend.contract import Files, GenerationSpec, onnx_file

    vdir = int8_kv8_version(work, prefix)
    spec = GenerationSpec.from_json((vdir / Files.GENERATION).read_text()).for_precision("int8")
    return spec, CausalLM(vdir / onnx_file("int8"), threads=2, pad_token_id=spec.pad_token_id or 0, **engine)


def step_while_arriving(sched: Any, arrivals: Callable[[], None]) -> float:
    """Run ``arrivals`` (which submits requests, sleeping between them) on another thread while ``sched`` steps,
    until it has submitted everything and the scheduler has no work left; returns the wall time."""
    start = time.perf_counter()
    feeder = threading.Thread(target=arrivals)
    feeder.start()
    while feeder.is_alive() or sched.has_work():
        if sched.has_work():
            sched.step()
        else:
            sched.wake.wait(0.01)
            sched.wake.clear()
    feeder.join()
    return time.perf_counter() - start


class TokenTimes:
    """When each generation's first and last token came: ``emit`` is the generations' token callback."""

    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}

    def emit(self, gen: Any, event: Any) -> None:
        now = time.perf_counter()
        self.first.setdefault(gen.id, now)
        if event.finish_reason is not None:
            self.last[gen.id] = now

    def ttft(self, gens: list) -> list[float]:
        """Each generation's time from its arrival (the scheduler's clock at submit) to its first token."""
        return [self.first[g.id] - g.arrival for g in gens]

    def done(self, gens: list) -> list[float]:
        """Each generation's time from its arrival to its last token."""
        return [self.last[g.id] - g.arrival for g in gens]


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (the nearest rank)."""
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]
