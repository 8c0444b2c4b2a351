"""The TensorRT engine without a GPU.

- The data path of ``run()`` against a fake TensorRT and a fake CUDA runtime whose
  "device memory" is host memory: shapes, profiles, copies in and out, frees.
- The fakes' API surface checked against the real ``tensorrt_rtx`` and
  ``cuda.bindings`` (so the fakes cannot drift from the names the engine calls).
- Real ``tensorrt_rtx`` up to deserialization: our logger and pool allocator are
  accepted by its Runtime and its error reaches the EngineError.
A real run needs a GPU with TensorRT (see benchmarks/gpu_checks.sh).
"""

from __future__ import annotations

import ctypes
import enum
import sys

import numpy as np
import pytest

from model_factory.backend.engines import tensorrt as trt_engine
from model_factory.backend.engines.base import Engine, EngineError
from model_factory.backend.engines.tensorrt import TensorRTEngine
from model_factory.backend.memory.pool import PoolStats, cuda_device_count

PROFILES = [((1, 1), (8, 32)), ((1, 33), (8, 128))]  # (min, max) of input_ids per profile


# --------------------------------------------------------------------------- fake CUDA


class FakeCuda:
    """The cuda.bindings.runtime calls the engine makes; device pointers are host pointers."""

    class cudaError_t(enum.IntEnum):  # noqa: N801 - CUDA's names
        cudaSuccess = 0

    class cudaMemcpyKind(enum.IntEnum):  # noqa: N801
        cudaMemcpyHostToDevice = 1
        cudaMemcpyDeviceToHost = 2

    cudaStreamNonBlocking = 1

    def __init__(self):
        self.log: list = []

    def cudaGetErrorString(self, err):  # noqa: N802
        return (self.cudaError_t.cudaSuccess, b"fake error")

    def cudaSetDevice(self, device):  # noqa: N802
        self.log.append(("set_device", device))
        return (self.cudaError_t.cudaSuccess,)

    def cudaStreamCreateWithFlags(self, flags):  # noqa: N802
        self.log.append(("stream_create", flags))
        return (self.cudaError_t.cudaSuccess, 0xABC)

    def cudaMemcpyAsync(self, dst, src, count, kind, stream):  # noqa: N802
        assert stream == 0xABC, "copies must go on the instance stream"
        ctypes.memmove(dst, src, count)
        self.log.append(("copy", kind.name, count))
        return (self.cudaError_t.cudaSuccess,)

    def cudaStreamSynchronize(self, stream):  # noqa: N802
        self.log.append(("sync", stream))
        return (self.cudaError_t.cudaSuccess,)

    def cudaStreamDestroy(self, stream):  # noqa: N802
        self.log.append(("stream_destroy", stream))
        return (self.cudaError_t.cudaSuccess,)

    free_bytes = 1 << 30

    def cudaMemGetInfo(self):  # noqa: N802
        return (self.cudaError_t.cudaSuccess, self.free_bytes, 2 << 30)


class HostPool:
    """A MemoryPool stand-in handing out host buffers by address."""

    def __init__(self):
        self.live: dict[int, np.ndarray] = {}
        self.freed: list[int] = []
        self.closed = False

    def allocate(self, nbytes, stream):
        assert stream == 0xABC
        buf = np.zeros(nbytes, dtype=np.uint8)
        self.live[buf.ctypes.data] = buf
        return buf.ctypes.data

    def free(self, ptr, stream):
        assert stream == 0xABC
        self.freed.append(ptr)
        del self.live[ptr]

    def close(self):
        self.closed = True

    def stats(self):
        used = sum(b.nbytes for b in self.live.values())
        return PoolStats(reserved=used + 4096, used=used, high_water=used + 4096, used_high_water=used)


# --------------------------------------------------------------------------- fake TensorRT


class FakeTrt:
    """The tensorrt names the engine uses, with an engine computing out = 2 * input_ids."""

    class TensorLocation(enum.Enum):
        DEVICE = 0
        HOST = 1

    class TensorIOMode(enum.Enum):
        INPUT = 1
        OUTPUT = 2

    class DataType(enum.Enum):
        INT64 = "int64"
        FLOAT = "float32"

    class ExecutionContextAllocationStrategy(enum.Enum):
        STATIC = 0
        ON_PROFILE_CHANGE = 1

    @staticmethod
    def nptype(dtype):
        return np.dtype(dtype.value).type

    class ILogger:
        def __init__(self):
            pass

    class IGpuAsyncAllocator:
        def __init__(self):
            pass

    class Runtime:
        plan_ok = True

        def __init__(self, logger):
            self.logger = logger
            self.gpu_allocator = None

        def deserialize_cuda_engine(self, data):
            assert self.gpu_allocator is not None, "the allocator must be set before deserializing"
            if not FakeTrt.Runtime.plan_ok:
                self.logger.log(1, "engine plan file is incompatible")
                return None
            return FakeCudaEngine()


class FakeContext:
    def __init__(self, strategy=None):
        self.strategy = strategy
        self.profile = 0
        self.shapes: dict[str, tuple] = {}
        self.addresses: dict[str, int] = {}
        self.runs = 0

    def set_optimization_profile_async(self, profile, stream):
        self.profile = profile
        return True

    def set_input_shape(self, name, shape):
        (lo, hi) = PROFILES[self.profile]
        if not all(a <= d <= b for d, a, b in zip(shape, lo, hi)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def get_tensor_shape(self, name):
        n, length = self.shapes["input_ids"]
        return {"last_hidden_state": (n, length, 2), "token_count": (n,)}[name]

    def set_tensor_address(self, name, ptr):
        self.addresses[name] = ptr
        return True

    def execute_async_v3(self, stream):
        assert stream == 0xABC
        n, length = self.shapes["input_ids"]
        ids = np.ctypeslib.as_array(
            ctypes.cast(self.addresses["input_ids"], ctypes.POINTER(ctypes.c_int64)), shape=(n, length)
        )
        hidden = np.ctypeslib.as_array(
            ctypes.cast(self.addresses["last_hidden_state"], ctypes.POINTER(ctypes.c_float)), shape=(n, length, 2)
        )
        count = np.ctypeslib.as_array(
            ctypes.cast(self.addresses["token_count"], ctypes.POINTER(ctypes.c_float)), shape=(n,)
        )
        hidden[...] = (2 * ids)[..., None]
        count[...] = (ids != 0).sum(axis=1)
        self.runs += 1
        return True


class FakeCudaEngine:
    names = [
        ("input_ids", FakeTrt.TensorIOMode.INPUT, FakeTrt.DataType.INT64),
        ("last_hidden_state", FakeTrt.TensorIOMode.OUTPUT, FakeTrt.DataType.FLOAT),
        ("token_count", FakeTrt.TensorIOMode.OUTPUT, FakeTrt.DataType.FLOAT),
    ]
    num_io_tensors = 3
    num_optimization_profiles = 2

    def __init__(self):
        self.contexts: list[FakeContext] = []

    def get_tensor_name(self, i):
        return self.names[i][0]

    def _row(self, name):
        return next(r for r in self.names if r[0] == name)

    def get_tensor_mode(self, name):
        return self._row(name)[1]

    def get_tensor_dtype(self, name):
        return self._row(name)[2]

    def get_tensor_location(self, name):
        return FakeTrt.TensorLocation.DEVICE

    def get_tensor_shape(self, name):
        return {"input_ids": (-1, -1), "last_hidden_state": (-1, -1, 2), "token_count": (-1,)}[name]

    def get_tensor_profile_shape(self, name, profile):
        lo, hi = PROFILES[profile]
        return [lo, hi, hi]

    def create_execution_context(self, strategy=None):
        ctx = FakeContext(strategy)
        self.contexts.append(ctx)
        return ctx


@pytest.fixture
def fakes(monkeypatch):
    cuda = FakeCuda()
    monkeypatch.setattr(trt_engine, "require_device", lambda device: cuda)
    FakeTrt.Runtime.plan_ok = True
    return cuda, HostPool()


def _engine(fakes, **kw):
    cuda, pool = fakes
    return TensorRTEngine(b"plan-bytes", device_id=0, pool=pool, trt_module=FakeTrt, **kw)


# --------------------------------------------------------------------------- the data path


def test_engine_loads_one_context_per_profile(fakes):
    engine = _engine(fakes)
    assert isinstance(engine, Engine)
    assert engine.input_names == ("input_ids",)
    assert engine.output_names == ("last_hidden_state", "token_count")
    assert engine.num_profiles == 2
    assert [c.profile for c in engine._engine.contexts] == [0, 1]
    strategy = FakeTrt.ExecutionContextAllocationStrategy.ON_PROFILE_CHANGE
    assert {c.strategy for c in engine._engine.contexts} == {strategy}
    assert engine.profile_shapes("input_ids", 1) == ((1, 33), (8, 128), (8, 128))


@pytest.mark.parametrize("profile, shape", [(0, (3, 17)), (1, (8, 128)), (1, (1, 33))])
def test_run_copies_in_computes_and_copies_out(fakes, profile, shape):
    cuda, pool = fakes
    engine = _engine(fakes)
    ids = np.arange(np.prod(shape), dtype=np.int32).reshape(shape)  # int32 in: cast to the engine's int64
    out = engine.run({"input_ids": ids}, profile=profile)
    np.testing.assert_array_equal(out["last_hidden_state"][..., 0], 2 * ids)
    np.testing.assert_array_equal(out["token_count"], (ids != 0).sum(axis=1))
    assert out["last_hidden_state"].dtype == np.float32
    assert pool.live == {}, "every buffer freed"
    assert len(pool.freed) == 3
    kinds = [e[1] for e in cuda.log if e[0] == "copy"]
    assert kinds == ["cudaMemcpyHostToDevice", "cudaMemcpyDeviceToHost", "cudaMemcpyDeviceToHost"]
    assert cuda.log[-1] == ("sync", 0xABC), "run returns after the stream is synchronized"
    assert engine._engine.contexts[profile].runs == 1


def test_run_rejects_bad_feeds_and_frees_nothing_twice(fakes):
    _, pool = fakes
    engine = _engine(fakes)
    with pytest.raises(EngineError, match="outside profile 0"):
        engine.run({"input_ids": np.ones((2, 40), np.int64)}, profile=0)
    with pytest.raises(EngineError, match="missing \\['input_ids'\\]"):
        engine.run({"ids": np.ones((2, 4), np.int64)})
    with pytest.raises(EngineError, match="profile 5 does not exist"):
        engine.run({"input_ids": np.ones((2, 4), np.int64)}, profile=5)
    with pytest.raises(EngineError, match="outside profile 1"):
        engine.run({"input_ids": np.ones((9, 64), np.int64)}, profile=1)  # batch over the max
    assert pool.live == {}


def test_execution_failure_frees_buffers(fakes, monkeypatch):
    _, pool = fakes
    engine = _engine(fakes)
    monkeypatch.setattr(FakeContext, "execute_async_v3", lambda self, stream: False)
    with pytest.raises(EngineError, match="execution failed"):
        engine.run({"input_ids": np.ones((2, 4), np.int64)})
    assert pool.live == {} and len(pool.freed) == 3


def test_close_is_idempotent_and_keeps_a_borrowed_pool(fakes):
    cuda, pool = fakes
    engine = _engine(fakes)
    engine.close()
    engine.close()
    assert not pool.closed, "a pool passed in belongs to the caller"
    assert ("stream_destroy", 0xABC) in cuda.log
    with pytest.raises(EngineError, match="closed"):
        engine.run({"input_ids": np.ones((1, 4), np.int64)})


def test_incompatible_plan_error_carries_tensorrts_message(fakes):
    FakeTrt.Runtime.plan_ok = False
    with pytest.raises(EngineError, match="could not deserialize.*incompatible.*rebuild"):
        _engine(fakes)


def test_settings_size_the_pool(fakes, monkeypatch):
    made = {}

    class RecordingPool(HostPool):
        def __init__(self, device, threshold, initial):
            super().__init__()
            made.update(device=device, threshold=threshold, initial=initial)

    monkeypatch.setattr(trt_engine, "MemoryPool", RecordingPool)

    class Settings:
        pool_release_threshold_mib = 64
        pool_initial_mib = 16

    engine = TensorRTEngine(b"plan", device_id=0, settings=Settings(), trt_module=FakeTrt)
    assert made == {"device": 0, "threshold": 64 << 20, "initial": 16 << 20}
    pool = engine.pool
    engine.close()
    assert pool.closed, "a pool made by the engine is closed with it"


# --------------------------------------------------------------------------- clear errors


def test_missing_plan_file(fakes, tmp_path):
    with pytest.raises(EngineError, match="does not exist"):
        TensorRTEngine(tmp_path / "model.plan", trt_module=FakeTrt)


def test_no_tensorrt_installed(monkeypatch):
    for name in ("tensorrt", "tensorrt_bindings", "tensorrt_rtx"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(EngineError, match=r"none of tensorrt, tensorrt_bindings, tensorrt_rtx.*model-factory\[tensorrt\]"):
        TensorRTEngine(b"plan")


def test_the_bindings_wheel_is_found_under_its_own_module_name(monkeypatch):
    """tensorrt-cu13-bindings (the serving image's engine) installs ``tensorrt_bindings``, not ``tensorrt``."""
    import types

    from model_factory.backend.memory.pool import import_tensorrt

    bindings = types.ModuleType("tensorrt_bindings")
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setitem(sys.modules, "tensorrt_bindings", bindings)
    assert import_tensorrt() is bindings


@pytest.mark.skipif(cuda_device_count() > 0, reason="checks the error seen without a GPU")
def test_no_gpu(tmp_path):
    with pytest.raises(EngineError, match="needs a GPU"):
        TensorRTEngine(b"plan", trt_module=FakeTrt)


# --------------------------------------------------------------------------- the fakes match the real APIs


def _real_trt():
    try:
        import tensorrt as trt  # noqa: F401
    except ImportError:
        trt = pytest.importorskip("tensorrt_rtx", reason="needs tensorrt or tensorrt_rtx")
    return trt


def test_fake_tensorrt_names_exist_in_the_real_module():
    trt = _real_trt()
    for name in ("ILogger", "IGpuAsyncAllocator", "Runtime", "nptype"):
        assert hasattr(trt, name), name
    assert trt.TensorLocation.DEVICE is not None and trt.TensorIOMode.INPUT is not None
    assert trt.ExecutionContextAllocationStrategy.ON_PROFILE_CHANGE is not None
    assert int(trt.ILogger.Severity.ERROR) == 1 and int(trt.ILogger.Severity.WARNING) == 2
    for name in (
        "num_io_tensors",
        "num_optimization_profiles",
        "get_tensor_name",
        "get_tensor_mode",
        "get_tensor_dtype",
        "get_tensor_location",
        "get_tensor_shape",
        "get_tensor_profile_shape",
        "create_execution_context",
    ):
        assert hasattr(trt.ICudaEngine, name), f"ICudaEngine.{name}"
    for name in (
        "set_optimization_profile_async",
        "set_input_shape",
        "get_tensor_shape",
        "set_tensor_address",
        "execute_async_v3",
    ):
        assert hasattr(trt.IExecutionContext, name), f"IExecutionContext.{name}"
    for name in ("gpu_allocator", "deserialize_cuda_engine"):
        assert hasattr(trt.Runtime, name), f"Runtime.{name}"


def test_fake_cuda_names_exist_in_cuda_bindings():
    rt = pytest.importorskip("cuda.bindings.runtime", reason="needs cuda-bindings")
    for name in (
        "cudaSetDevice",
        "cudaStreamCreateWithFlags",
        "cudaStreamNonBlocking",
        "cudaMemcpyAsync",
        "cudaStreamSynchronize",
        "cudaStreamDestroy",
        "cudaGetErrorString",
        "cudaMemGetInfo",
    ):
        assert hasattr(rt, name), name
    assert rt.cudaMemcpyKind.cudaMemcpyHostToDevice and rt.cudaMemcpyKind.cudaMemcpyDeviceToHost


def test_a_group_whose_buffers_would_not_fit_is_split_before_launch(fakes):
    """Memory-aware groups on the TensorRT engine: a group's input and output buffers against the memory free
    now (the driver's free plus the pool's cached bytes); one that does not fit is split, none is retried."""
    from model_factory.backend.batching.executor import GroupedExecutor
    from model_factory.backend.batching.grouping import CostModel
    from model_factory.backend.memory.guard import guard_for

    cuda, _ = fakes
    engine = _engine(fakes)
    # input_ids int64 + last_hidden_state float32 x 2 + token_count float32, for 4 x 20 tokens.
    assert engine.activation_bytes(4, 20, 0) == 4 * 20 * 8 + 4 * 20 * 2 * 4 + 4 * 4
    assert engine.free_device_bytes() == cuda.free_bytes + 4096
    guard = guard_for(engine)
    assert guard is not None and guard.fits(8, 32, 0)
    cuda.free_bytes = 0  # 4 KiB cached in the pool, times the headroom
    assert guard.fits(4, 20, 0) and not guard.fits(8, 32, 0)
    executor = GroupedExecutor(engine, CostModel(1.0, 0.0, 0.0), max_batch=8, buckets=(32, 128),
                               seq_inputs=frozenset({"input_ids"}), seq_outputs=frozenset({"last_hidden_state"}),
                               mode="pad_to_longest", memory_guard=guard)
    items = [{"input_ids": np.full(30, k + 1, np.int64)} for k in range(8)]
    results, stats = executor.run([[item] for item in items], [("token_count",)] * 8)
    assert stats.memory_splits >= 1 and stats.retries == 0
    assert [np.asarray(r["token_count"]).item() for r in results] == [30.0] * 8


def _tiny_plan(trt) -> bytes:
    """out = 2 * float(input_ids), two profiles like PROFILES; builds on a CPU with tensorrt_rtx."""
    from benchmarks.harness.tiny_plan import doubling_plan

    plan = doubling_plan(trt, [(lo, hi, hi) for lo, hi in PROFILES])
    if plan is None:
        pytest.skip("this TensorRT cannot build engines on this machine")
    return plan


@pytest.mark.skipif(cuda_device_count() > 0, reason="checks the error seen without a GPU")
def test_real_tensorrt_runtime_accepts_our_logger_and_allocator(fakes):
    """Runtime(our logger), gpu_allocator = our adapter, then TensorRT's own CUDA error."""
    trt = _real_trt()
    plan = _tiny_plan(trt)
    _, pool = fakes
    with pytest.raises(EngineError, match="could not deserialize.*(CUDA|cuda|driver)"):
        TensorRTEngine(plan, pool=pool, trt_module=trt, log_severity=-1)
