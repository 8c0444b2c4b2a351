"""The CUDA memory pool and TensorRT's allocator adapter.

Tests marked ``gpu`` need a CUDA device and skip without one. The rest run
anywhere: lazy imports, clear errors without CUDA, and the adapter's logic (with a
fake pool, and through TensorRT's own C++ trampoline when tensorrt or
tensorrt_rtx is installed).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from model_factory.backend.memory import pool as memory_pool
from model_factory.backend.memory.pool import (
    CudaError,
    MemoryPool,
    PoolStats,
    TensorRTPoolAllocator,
    cuda_device_count,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


class FakePool:
    """Records calls; hands out aligned fake addresses."""

    def __init__(self, fail: bool = False, address: int = 0x7F0000000000):
        self.calls: list[tuple] = []
        self.fail = fail
        self.address = address

    def allocate(self, nbytes, stream):
        self.calls.append(("allocate", nbytes, stream))
        if self.fail:
            raise CudaError("cudaMallocFromPoolAsync failed: cudaErrorMemoryAllocation: out of memory")
        return self.address

    def free(self, ptr, stream):
        self.calls.append(("free", ptr, stream))


class FakeTrt:
    """A stand-in for the tensorrt module: only the base class the adapter derives from."""

    class IGpuAsyncAllocator:
        def __init__(self):
            self.base_initialised = getattr(self, "base_initialised", 0) + 1


# --------------------------------------------------------------------------- imports


def test_backend_imports_without_heavy_dependencies():
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(HERE)!r})
        import conftest  # loads model_factory.backend when not installed
        import model_factory.backend.batching.grouping, model_factory.backend.memory.pool
        import model_factory.backend.operations.metrics, model_factory.backend.engines.base
        import model_factory.backend.engines.tensorrt
        heavy = sorted(m for m in sys.modules
                       if m.split('.')[0] in ('cuda', 'tensorrt', 'tensorrt_rtx', 'torch', 'cupy'))
        print(heavy)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- without a GPU


@pytest.mark.skipif(cuda_device_count() > 0, reason="checks the error seen without a GPU")
def test_pool_without_gpu_raises_a_clear_error():
    with pytest.raises(CudaError, match="no usable CUDA device|cuda-bindings is not installed"):
        MemoryPool(0)


def test_pool_without_cuda_bindings_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # makes the import fail
    with pytest.raises(CudaError, match="pip install 'cuda-bindings"):
        MemoryPool(0)


def test_pool_rejects_a_reservation_above_the_threshold():
    with pytest.raises(ValueError, match="exceeds the release threshold"):
        MemoryPool(0, release_threshold=1 << 20, initial_bytes=2 << 20)
    with pytest.raises(ValueError, match=">= 0"):
        MemoryPool(0, release_threshold=-1)


# --------------------------------------------------------------------------- the adapter, faked


def test_adapter_is_both_the_trt_interface_and_ours():
    alloc = TensorRTPoolAllocator(FakePool(), trt_module=FakeTrt)
    assert isinstance(alloc, FakeTrt.IGpuAsyncAllocator)
    assert isinstance(alloc, TensorRTPoolAllocator)
    assert alloc.base_initialised == 1  # the base initialised once, not twice
    assert type(TensorRTPoolAllocator(FakePool(), trt_module=FakeTrt)) is type(alloc)  # class cached


@pytest.mark.parametrize(
    "flags, stream",
    [(0, 0x5555AAAA0000), (1, 0x5555AAAA0000)],
)
def test_adapter_finds_the_stream_in_either_argument_order(flags, stream):
    pool = FakePool()
    alloc = TensorRTPoolAllocator(pool, trt_module=FakeTrt)
    assert alloc.allocate_async(1000, 256, flags, stream) == pool.address
    assert alloc.allocate_async(1000, 256, stream, flags) == pool.address  # swapped by some bindings
    assert pool.calls == [("allocate", 1000, stream), ("allocate", 1000, stream)]


def test_adapter_zero_size_failure_and_free():
    pool = FakePool()
    alloc = TensorRTPoolAllocator(pool, trt_module=FakeTrt)
    assert alloc.allocate_async(0, 256, 0, 7) == 0
    assert pool.calls == []
    assert alloc.deallocate_async(pool.address, 7) is True
    assert alloc.deallocate_async(0, 7) is True  # TensorRT may free a null pointer
    assert pool.calls == [("free", pool.address, 7)]

    failing = TensorRTPoolAllocator(FakePool(fail=True), trt_module=FakeTrt)
    assert failing.allocate_async(64, 0, 0, 7) == 0  # 0 = out of memory, never an exception
    assert isinstance(failing.last_error, CudaError)
    assert failing.reallocate(pool.address, 256, 4096) == 0  # resizing is not supported


def test_adapter_rejects_a_misaligned_address():
    pool = FakePool(address=0x7F0000000010)
    alloc = TensorRTPoolAllocator(pool, trt_module=FakeTrt)
    assert alloc.allocate_async(64, 256, 0, 3) == 0
    assert pool.calls == [("allocate", 64, 3), ("free", 0x7F0000000010, 3)]
    assert "not aligned" in str(alloc.last_error)


def _real_trt():
    try:
        return memory_pool.import_tensorrt()
    except ImportError as exc:
        pytest.skip(f"needs tensorrt or tensorrt_rtx: {exc}")


def test_adapter_through_tensorrts_own_trampoline():
    """Calling the binding's base method goes C++ -> our Python override, as TensorRT does."""
    trt = _real_trt()
    pool = FakePool()
    alloc = TensorRTPoolAllocator(pool)
    assert isinstance(alloc, trt.IGpuAsyncAllocator)
    capsule = trt.IGpuAsyncAllocator.allocate_async(alloc, 4096, 256, 0, 0x1234500)
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    assert get_pointer(capsule, None) == pool.address
    assert trt.IGpuAsyncAllocator.deallocate_async(alloc, capsule, 0x1234500) is True
    assert pool.calls == [("allocate", 4096, 0x1234500), ("free", pool.address, 0x1234500)]


# --------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_pool_allocate_free_and_stats(cuda_device):
    from cuda.bindings import runtime as rt

    with MemoryPool(cuda_device, release_threshold=64 << 20) as pool:
        stream = memory_pool.check(rt, rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "stream")
        sizes = [512, 4096, 1 << 20, 16 << 20]
        ptrs = [pool.allocate(n, stream) for n in sizes]
        assert len(set(ptrs)) == len(sizes) and all(p % 256 == 0 for p in ptrs)
        memory_pool.check(rt, rt.cudaMemsetAsync(ptrs[-1], 0, sizes[-1], stream), "memset")
        memory_pool.check(rt, rt.cudaStreamSynchronize(stream), "sync")
        stats = pool.stats()
        assert isinstance(stats, PoolStats)
        assert stats.used >= sum(sizes)
        assert stats.reserved >= stats.used
        assert stats.high_water >= stats.reserved and stats.used_high_water >= stats.used
        for p in ptrs:
            pool.free(p, stream)
        memory_pool.check(rt, rt.cudaStreamSynchronize(stream), "sync")
        after = pool.stats()
        assert after.used == 0
        assert after.reserved > 0  # kept below the release threshold for reuse
        pool.trim(0)
        assert pool.stats().reserved == 0
        pool.reset_high_water()
        assert pool.stats().high_water == 0
        with pytest.raises(ValueError, match="freed already"):
            pool.free(ptrs[0], stream)
        memory_pool.check(rt, rt.cudaStreamDestroy(stream), "stream destroy")
    assert pool.closed
    with pytest.raises(CudaError, match="closed"):
        pool.allocate(16)


@pytest.mark.gpu
def test_pool_initial_reservation_is_kept(cuda_device):
    with MemoryPool(cuda_device, release_threshold=32 << 20, initial_bytes=32 << 20) as pool:
        stats = pool.stats()
        assert stats.reserved >= 32 << 20
        assert stats.used == 0


@pytest.mark.gpu
def test_adapter_on_a_real_pool(cuda_device):
    _real_trt()
    with MemoryPool(cuda_device, release_threshold=16 << 20) as pool:
        alloc = TensorRTPoolAllocator(pool)
        ptr = alloc.allocate_async(1 << 20, 256, 0, 0)
        assert ptr and ptr % 256 == 0, alloc.last_error
        assert pool.live_allocations == 1
        assert alloc.deallocate_async(ptr, 0) is True
        assert pool.live_allocations == 0


def test_idle_trimmer_trims_once_after_idle_and_not_while_busy():
    """The trimmer's timing logic, on a stand-in pool (no GPU needed)."""
    import time

    from model_factory.backend.memory.pool import IdleTrimmer

    class FakePool:
        closed = False

        def __init__(self):
            self.trims = []

        def trim(self, keep):
            self.trims.append(keep)

    pool = FakePool()
    seen = []
    trimmer = IdleTrimmer(pool, keep_bytes=123, idle_seconds=0.2, on_trim=seen.append)
    try:
        time.sleep(0.4)
        assert pool.trims == []  # nothing ran yet: nothing to give back
        trimmer.touch()
        deadline = time.monotonic() + 10
        while not pool.trims and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.trims == [123] and seen == [pool]  # trimmed once, to the reservation
        time.sleep(0.3)
        assert pool.trims == [123]  # and not again while still idle
    finally:
        trimmer.close()
