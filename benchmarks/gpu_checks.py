"""GPU checks for the backend's CUDA parts, run on a machine with an NVIDIA GPU.

    python3 benchmarks/gpu_checks.py            # from the repository root

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
from mf_backend import grouping  # noqa: E402
from mf_backend.memory_pool import (  # noqa: E402
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


CHECKS = [
    ("device", check_device),
    ("memory pool: reservation, round trip, stats, trim, close", check_pool_basics),
    ("TensorRT allocator adapter over a real pool", check_allocator),
    ("allocation microbenchmark: pool vs cudaMalloc", check_alloc_benchmark),
    ("cost model measured on this GPU picks a good plan", check_cost_model_on_gpu),
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


if __name__ == "__main__":
    sys.exit(main())
