"""A CUDA stream-ordered memory pool per model instance, and TensorRT's allocator on top.

``cudaMalloc``/``cudaFree`` synchronize the device and cost milliseconds per call; a
pool made with ``cudaMemPoolCreate`` hands out memory with ``cudaMallocFromPoolAsync``
and takes it back with ``cudaFreeAsync``, in stream order, in microseconds, keeping
up to a *release threshold* of freed memory reserved for reuse. Each model
instance owns one pool on its own device, so instances do not contend and the
pool's statistics describe one instance.

``cuda.bindings`` (package ``cuda-bindings``) is imported when a pool is made, not
when this module is imported: the backend imports on machines without CUDA, and
making a pool there raises :class:`CudaError` saying why.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any


class CudaError(RuntimeError):
    """CUDA is missing or a CUDA call failed; the message names the call and the error."""


def cuda_runtime() -> ModuleType:
    """Import ``cuda.bindings.runtime``, or raise :class:`CudaError` naming the package."""
    try:
        from cuda.bindings import runtime
    except ImportError as exc:
        raise CudaError(
            f"cuda-bindings is not installed ({exc}); GPU instances need it: "
            "pip install 'cuda-bindings>=12.6' (or model-factory[gpu])"
        ) from exc
    return runtime


def cuda_device_count() -> int:
    """CUDA devices visible here; 0 without cuda-bindings, a driver or a GPU (never raises)."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return 0
    err, count = runtime.cudaGetDeviceCount()
    if err != runtime.cudaError_t.cudaSuccess:
        return 0
    return int(count)


def _uint64(value: int) -> Any:
    # The 64-bit pool attributes take a cuuint64_t, which lives in the driver module.
    from cuda.bindings import driver

    return driver.cuuint64_t(int(value))


def check(rt: ModuleType, result: Any, what: str) -> Any:
    """Unpack a cuda.bindings result tuple ``(err, *values)``; raise CudaError on failure.

    Returns None, the single value, or a tuple of values.
    """
    if not isinstance(result, tuple):
        result = (result,)
    err, values = result[0], result[1:]
    if err != rt.cudaError_t.cudaSuccess:
        name = getattr(err, "name", str(err))
        _, text = rt.cudaGetErrorString(err)
        detail = text.decode() if isinstance(text, bytes) else str(text)
        raise CudaError(f"{what} failed: {name}: {detail}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def require_device(device: int) -> ModuleType:
    """Check that CUDA works and ``device`` exists; return the runtime module."""
    rt = cuda_runtime()
    err, count = rt.cudaGetDeviceCount()
    if err != rt.cudaError_t.cudaSuccess:
        _, text = rt.cudaGetErrorString(err)
        detail = text.decode() if isinstance(text, bytes) else str(text)
        raise CudaError(
            f"no usable CUDA device ({getattr(err, 'name', err)}: {detail}); "
            "run this model on a GPU instance or use the CPU engine (instance kind cpu)"
        )
    if not 0 <= device < count:
        raise CudaError(f"CUDA device {device} does not exist: this machine has {count} device(s)")
    return rt


def to_device(rt: ModuleType, pool: "MemoryPool", arr: Any, stream: Any, buffers: list[int]) -> int:
    """A pool buffer (recorded in ``buffers``, for the caller to free) with ``arr``'s copy queued on ``stream``."""
    ptr = pool.allocate(max(arr.nbytes, 1), stream)
    buffers.append(ptr)
    if arr.nbytes:
        kind = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        check(rt, rt.cudaMemcpyAsync(ptr, arr.ctypes.data, arr.nbytes, kind, stream), "copy to GPU")
    return ptr


def to_host(rt: ModuleType, host: Any, ptr: int, stream: Any) -> None:
    """Queue the copy of device ``ptr`` into the numpy array ``host`` on ``stream``."""
    if host.nbytes:
        kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        check(rt, rt.cudaMemcpyAsync(host.ctypes.data, ptr, host.nbytes, kind, stream), "copy to host")


def release_stream(rt: ModuleType | None, stream: Any, pool: "MemoryPool | None", owns_pool: bool) -> None:
    """An engine's last step of ``close``: its pool (when it made it), then its stream."""
    if owns_pool and pool is not None:
        pool.close()
    if rt is not None and stream is not None:
        rt.cudaStreamDestroy(stream)


@dataclass(frozen=True)
class PoolStats:
    """Bytes held by one pool, from ``cudaMemPoolGetAttribute``.

    ``reserved``: backing memory the pool holds now (in use + cached for reuse).
    ``used``: memory handed out and not yet freed.
    ``high_water``: the most ``reserved`` has been since creation or the last reset.
    ``used_high_water``: the most ``used`` has been since then.
    """

    reserved: int
    used: int
    high_water: int
    used_high_water: int


class MemoryPool:
    """A ``cudaMemPool_t`` on one device, with stream-ordered allocate/free.

    ``release_threshold``: freed bytes the pool keeps reserved across synchronizations
    instead of returning them to the driver (0 returns everything at each sync).
    ``initial_bytes``: reserve this much at once, so the first requests do not pay
    for growing the pool; it must not exceed ``release_threshold`` or the driver
    would release it again at the next synchronization.
    """

    def __init__(self, device: int = 0, release_threshold: int = 0, initial_bytes: int = 0):
        if release_threshold < 0 or initial_bytes < 0:
            raise ValueError("release_threshold and initial_bytes must be >= 0")
        if initial_bytes > release_threshold:
            raise ValueError(
                f"initial reservation ({initial_bytes} bytes) exceeds the release threshold "
                f"({release_threshold} bytes): it would be released at the next synchronization; "
                "raise the threshold to at least the reservation"
            )
        rt = require_device(device)
        self._rt = rt
        self._device = device
        self._lock = threading.Lock()
        self._live: dict[int, int] = {}

        props = rt.cudaMemPoolProps()
        props.allocType = rt.cudaMemAllocationType.cudaMemAllocationTypePinned
        props.handleTypes = rt.cudaMemAllocationHandleType.cudaMemHandleTypeNone
        props.location.type = rt.cudaMemLocationType.cudaMemLocationTypeDevice
        props.location.id = device
        self._pool = check(rt, rt.cudaMemPoolCreate(props), f"cudaMemPoolCreate(device={device})")
        try:
            check(
                rt,
                rt.cudaMemPoolSetAttribute(
                    self._pool, rt.cudaMemPoolAttr.cudaMemPoolAttrReleaseThreshold, _uint64(release_threshold)
                ),
                "cudaMemPoolSetAttribute(ReleaseThreshold)",
            )
            if initial_bytes:
                # Grow the pool once and hand the block back: it stays reserved (below the
                # threshold) and later allocations are carved out of it.
                ptr = check(rt, rt.cudaMallocFromPoolAsync(initial_bytes, self._pool, 0), "cudaMallocFromPoolAsync")
                check(rt, rt.cudaFreeAsync(ptr, 0), "cudaFreeAsync")
                check(rt, rt.cudaStreamSynchronize(0), "cudaStreamSynchronize")
        except BaseException:
            rt.cudaMemPoolDestroy(self._pool)
            self._pool = None
            raise

    # ------------------------------------------------------------------ properties

    @property
    def device(self) -> int:
        return self._device

    @property
    def handle(self) -> Any:
        """The ``cudaMemPool_t`` (for calls this class does not wrap)."""
        self._require_open()
        return self._pool

    @property
    def closed(self) -> bool:
        return self._pool is None

    @property
    def live_allocations(self) -> int:
        """Allocations handed out and not yet freed through this object."""
        with self._lock:
            return len(self._live)

    def _require_open(self) -> None:
        if self._pool is None:
            raise CudaError("the memory pool is closed")

    # ------------------------------------------------------------------ allocation

    def allocate(self, nbytes: int, stream: Any = 0) -> int:
        """Allocate ``nbytes`` in stream order on ``stream``; returns the device address.

        The memory may be used by work on ``stream`` (or work ordered after it).
        """
        if nbytes <= 0:
            raise ValueError(f"allocation size must be > 0, got {nbytes}")
        self._require_open()
        ptr = check(
            self._rt,
            self._rt.cudaMallocFromPoolAsync(int(nbytes), self._pool, stream),
            f"cudaMallocFromPoolAsync({nbytes} bytes)",
        )
        address = int(ptr)
        with self._lock:
            self._live[address] = int(nbytes)
        return address

    def free(self, ptr: int, stream: Any = 0) -> None:
        """Return ``ptr`` to the pool once the work queued on ``stream`` so far is done."""
        address = int(ptr)
        with self._lock:
            if address not in self._live:
                raise ValueError(f"address {address:#x} was not allocated by this pool, or was freed already")
            del self._live[address]
        self._require_open()
        check(self._rt, self._rt.cudaFreeAsync(address, stream), "cudaFreeAsync")

    def trim(self, keep_bytes: int = 0) -> None:
        """Release cached memory back to the driver, keeping at least ``keep_bytes`` reserved.

        Only memory whose frees have completed can go: synchronize the streams first.
        """
        if keep_bytes < 0:
            raise ValueError("keep_bytes must be >= 0")
        self._require_open()
        check(self._rt, self._rt.cudaMemPoolTrimTo(self._pool, int(keep_bytes)), "cudaMemPoolTrimTo")

    # ------------------------------------------------------------------ statistics

    def _attribute(self, attr: Any, what: str) -> int:
        return int(check(self._rt, self._rt.cudaMemPoolGetAttribute(self._pool, attr), what))

    def stats(self) -> PoolStats:
        """Reserved, used and high-water bytes, read from the driver now."""
        self._require_open()
        attrs = self._rt.cudaMemPoolAttr
        return PoolStats(
            reserved=self._attribute(attrs.cudaMemPoolAttrReservedMemCurrent, "ReservedMemCurrent"),
            used=self._attribute(attrs.cudaMemPoolAttrUsedMemCurrent, "UsedMemCurrent"),
            high_water=self._attribute(attrs.cudaMemPoolAttrReservedMemHigh, "ReservedMemHigh"),
            used_high_water=self._attribute(attrs.cudaMemPoolAttrUsedMemHigh, "UsedMemHigh"),
        )

    def reset_high_water(self) -> None:
        """Reset both high-water marks to the current values."""
        self._require_open()
        attrs = self._rt.cudaMemPoolAttr
        for attr, what in (
            (attrs.cudaMemPoolAttrReservedMemHigh, "ReservedMemHigh"),
            (attrs.cudaMemPoolAttrUsedMemHigh, "UsedMemHigh"),
        ):
            check(self._rt, self._rt.cudaMemPoolSetAttribute(self._pool, attr, _uint64(0)), f"reset {what}")

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Destroy the pool (idempotent).

        Allocations still live are released by the driver once their frees complete;
        synchronize the streams that use them before closing.
        """
        if self._pool is None:
            return
        pool, self._pool = self._pool, None
        with self._lock:
            self._live.clear()
        check(self._rt, self._rt.cudaMemPoolDestroy(pool), "cudaMemPoolDestroy")

    def __enter__(self) -> "MemoryPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- TensorRT


def import_tensorrt() -> ModuleType:
    """``tensorrt``, else ``tensorrt_bindings``, else ``tensorrt_rtx``; an ImportError naming them otherwise.

    ``tensorrt_bindings`` is the module of the ``tensorrt-cu13-bindings`` wheel (extra ``tensorrt``): the
    Python bindings alone, on the TensorRT libraries of NVIDIA's Triton image.
    """
    errors = []
    for name in ("tensorrt", "tensorrt_bindings", "tensorrt_rtx"):
        try:
            return __import__(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError(
        "none of tensorrt, tensorrt_bindings, tensorrt_rtx is importable (" + "; ".join(errors) + "); "
        "install TensorRT for this GPU (model-factory[tensorrt]: the bindings for the TensorRT libraries of the "
        "Triton image, or tensorrt-cu13, or tensorrt-rtx-cu13 / model-factory[tensorrt-rtx])"
    )


_ADAPTER_CLASSES: dict[int, type] = {}


class TensorRTPoolAllocator:
    """TensorRT's ``IGpuAsyncAllocator`` over a :class:`MemoryPool`.

    ``TensorRTPoolAllocator(pool)`` returns an object that *is* a
    ``trt.IGpuAsyncAllocator`` (a subclass made on first use for whichever of
    ``tensorrt``/``tensorrt_rtx`` is installed, or for ``trt_module``) and also an
    instance of this class. Set it as ``runtime.gpu_allocator`` before
    deserializing; keep it (and the pool) alive as long as the engine.

    Callbacks never raise into TensorRT: a failed allocation returns 0 (TensorRT
    reports an out-of-memory error) and the CUDA error is kept in ``last_error``.
    """

    def __new__(cls, pool: MemoryPool, trt_module: ModuleType | None = None):
        if cls is not TensorRTPoolAllocator:  # the concrete subclass being built
            return super().__new__(cls)
        trt = trt_module if trt_module is not None else import_tensorrt()
        impl = _ADAPTER_CLASSES.get(id(trt))
        if impl is None:
            impl = type("TensorRTPoolAllocatorImpl", (TensorRTPoolAllocator, trt.IGpuAsyncAllocator), {})
            impl._trt_base = trt.IGpuAsyncAllocator
            _ADAPTER_CLASSES[id(trt)] = impl
        return impl(pool, trt_module=trt)

    def __init__(self, pool: MemoryPool, trt_module: ModuleType | None = None):
        # Python calls __init__ twice (once for the subclass built in __new__, once for
        # this class's own call): initialise the pybind11 base only once.
        if getattr(self, "_initialised", False):
            return
        type(self)._trt_base.__init__(self)  # pybind11 needs the base initialised explicitly
        self._initialised = True
        self.pool = pool
        self.last_error: BaseException | None = None

    @staticmethod
    def _stream(flags: int, stream: int) -> int:
        # TensorRT documents allocate_async(size, alignment, flags, stream), but some of
        # its Python bindings call the override with (size, alignment, stream, flags).
        # AllocatorFlag holds only small bits (RESIZABLE = 1), and stream handles 0, 1
        # (legacy default) and 2 (per-thread default) cannot be told from flags anyway but
        # 0 and 1 mean the same stream: so the larger of the two is the stream, either way.
        return max(int(flags), int(stream))

    def allocate_async(self, size: int, alignment: int, flags: int, stream: int) -> int:
        if size <= 0:
            return 0
        try:
            ptr = self.pool.allocate(int(size), self._stream(flags, stream))
            if alignment and ptr % int(alignment):
                self.pool.free(ptr, self._stream(flags, stream))
                raise CudaError(f"pool returned {ptr:#x}, not aligned to {alignment}")
            return ptr
        except Exception as exc:  # never raise into TensorRT's C++ caller
            self.last_error = exc
            return 0

    def deallocate_async(self, memory: int, stream: int) -> bool:
        if not memory:
            return True
        try:
            self.pool.free(int(memory), int(stream))
            return True
        except Exception as exc:
            self.last_error = exc
            return False

    # Older bindings may still call the synchronous entry points.
    def allocate(self, size: int, alignment: int, flags: int) -> int:
        return self.allocate_async(size, alignment, flags, 0)

    def deallocate(self, memory: int) -> bool:
        return self.deallocate_async(memory, 0)

    def reallocate(self, address: int, alignment: int, new_size: int) -> int:
        # Resizing in place is not supported by a stream-ordered pool: 0 tells TensorRT so.
        return 0


class IdleTrimmer:
    """Trim a pool back to its initial reservation once the instance has been idle for a while.

    Bursts keep their memory (up to the release threshold) for reuse; a quiet
    instance gives it back to the driver for other instances and models. A
    daemon thread checks every ``idle_seconds / 4``; ``touch()`` marks activity.
    """

    def __init__(self, pool: "MemoryPool", keep_bytes: int = 0, idle_seconds: float = 10.0,
                 on_trim: Any = None) -> None:
        import time

        self._time = time.monotonic
        self._pool = pool
        self._keep = int(keep_bytes)
        self._idle = float(idle_seconds)
        self._on_trim = on_trim
        self._last = self._time()
        self._trimmed = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mf-pool-trimmer", daemon=True)
        self._thread.start()

    def touch(self) -> None:
        """Record activity (call after each execute)."""
        self._last = self._time()
        self._trimmed = False

    def _loop(self) -> None:
        while not self._stop.wait(self._idle / 4):
            if not self._trimmed and self._time() - self._last >= self._idle and not self._pool.closed:
                try:
                    self._pool.trim(self._keep)
                except CudaError:
                    continue  # a pool closing under us; the next tick sees closed
                self._trimmed = True
                if self._on_trim is not None:
                    self._on_trim(self._pool)

    def close(self) -> None:
        """Stop the thread."""
        self._stop.set()
        self._thread.join(timeout=2)
