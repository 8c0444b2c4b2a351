"""TensorRT engine: a serialized plan run on the instance's own stream and memory pool.

Follows the TensorRT 10 Python API (``tensorrt``, or ``tensorrt_rtx`` whose API
mirrors it):

- the plan is deserialized by a ``Runtime`` whose ``gpu_allocator`` is a
  :class:`~.memory_pool.TensorRTPoolAllocator`, so the engine's and contexts'
  device memory comes from this instance's pool;
- one execution context per optimization profile, each bound to its profile once
  (no profile switching per group) and holding only that profile's activation
  memory (``ON_PROFILE_CHANGE``);
- per group: input shapes set on the profile's context, input and output buffers
  allocated from the pool in stream order, ``execute_async_v3`` on the instance
  stream, outputs copied back to numpy, the buffers freed in stream order, and
  the stream synchronized before ``run`` returns.

Outputs must have shapes TensorRT can compute from the input shapes (true for
encoders); an output whose shape depends on the data raises :class:`EngineError`.
``tensorrt``/``tensorrt_rtx`` and ``cuda.bindings`` are imported when an engine is
made, not when this module is imported.
"""

from __future__ import annotations

import collections
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from ..memory.pool import (
    CudaError,
    MemoryPool,
    TensorRTPoolAllocator,
    check,
    import_tensorrt,
    release_stream,
    require_device,
    to_device,
    to_host,
)
from .base import EngineError

_MIB = 1 << 20


def _make_logger(trt: ModuleType, echo_severity: int) -> Any:
    """A TensorRT logger that keeps the recent errors (for messages) and echoes to stderr."""

    class _Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: collections.deque[str] = collections.deque(maxlen=8)

        def log(self, severity: Any, msg: str) -> None:
            level = int(severity)  # INTERNAL_ERROR=0, ERROR=1, WARNING=2, INFO=3, VERBOSE=4
            if level <= 1:
                self.errors.append(msg)
            if level <= echo_severity:
                print(f"[TensorRT] {msg}", file=sys.stderr)

    return _Logger()


class TensorRTEngine:
    """Runs a TensorRT plan on one GPU; see the module docstring for the data path.

    ``plan``: the serialized engine (bytes) or a path to it. ``device_id``: the
    instance's GPU. The pool is made here (``release_threshold_bytes``,
    ``initial_bytes``) unless ``pool`` is given; ``settings`` may instead carry
    ``pool_release_threshold_mib`` / ``pool_initial_mib`` (the backend's settings).
    ``trt_module`` picks the TensorRT module; by default ``tensorrt``, else
    ``tensorrt_rtx``.
    """

    flavour = "tensorrt"

    def __init__(
        self,
        plan: bytes | str | Path,
        *,
        device_id: int = 0,
        pool: MemoryPool | None = None,
        release_threshold_bytes: int = 256 * _MIB,
        initial_bytes: int = 0,
        settings: Any = None,
        trt_module: ModuleType | None = None,
        log_severity: int = 2,
    ) -> None:
        if settings is not None:
            release_threshold_bytes = int(getattr(settings, "pool_release_threshold_mib", 256)) * _MIB
            initial_bytes = int(getattr(settings, "pool_initial_mib", 0)) * _MIB
        self._closed = False
        self._lock = threading.Lock()
        self._contexts: list[Any] = []
        self._engine = self._runtime = self._allocator = self._stream = None
        self._pool = pool
        self._owns_pool = pool is None
        self._shape_cache: dict[tuple[str, int], tuple] = {}
        self.device_id = device_id

        try:
            trt = trt_module if trt_module is not None else import_tensorrt()
        except ImportError as exc:
            raise EngineError(f"cannot load a TensorRT plan: {exc}") from exc
        self._trt = trt
        data = self._read_plan(plan)
        try:
            self._rt = rt = require_device(device_id)
        except CudaError as exc:
            raise EngineError(f"a TensorRT engine needs a GPU: {exc}") from exc

        try:
            check(rt, rt.cudaSetDevice(device_id), f"cudaSetDevice({device_id})")
            self._stream = check(rt, rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreate")
            if self._pool is None:
                self._pool = MemoryPool(device_id, release_threshold_bytes, initial_bytes)
            self._allocator = TensorRTPoolAllocator(self._pool, trt_module=trt)
            self._logger = _make_logger(trt, log_severity)
            self._runtime = trt.Runtime(self._logger)
            self._runtime.gpu_allocator = self._allocator
            self._engine = self._runtime.deserialize_cuda_engine(data)
            if self._engine is None:
                raise EngineError(
                    "TensorRT could not deserialize the plan "
                    f"({self._trt_errors() or 'no message'}); a plan runs only with the TensorRT "
                    "version and GPU family it was built for: rebuild it for this machine"
                )
            self._describe_io()
            self._num_profiles = int(self._engine.num_optimization_profiles)
            # ON_PROFILE_CHANGE: each context takes (from the pool) the activation memory of
            # its own profile, not the engine's maximum over all profiles as STATIC would.
            strategies = getattr(trt, "ExecutionContextAllocationStrategy", None)
            strategy = getattr(strategies, "ON_PROFILE_CHANGE", None)
            for profile in range(max(1, self._num_profiles)):
                if strategy is not None:
                    context = self._engine.create_execution_context(strategy)
                else:
                    context = self._engine.create_execution_context()
                if context is None:
                    raise EngineError(
                        f"TensorRT could not create an execution context for profile {profile} "
                        f"({self._trt_errors() or 'out of GPU memory?'})"
                    )
                if self._num_profiles and not context.set_optimization_profile_async(profile, self._stream_handle):
                    raise EngineError(f"could not select optimization profile {profile}")
                self._contexts.append(context)
            check(rt, rt.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ loading

    @staticmethod
    def _read_plan(plan: bytes | str | Path) -> bytes:
        if isinstance(plan, (bytes, bytearray, memoryview)):
            return bytes(plan)
        path = Path(plan)
        if not path.is_file():
            raise EngineError(f"TensorRT plan {path} does not exist: build the engine first")
        return path.read_bytes()

    @property
    def _stream_handle(self) -> int:
        return int(self._stream) if self._stream is not None else 0

    def _trt_errors(self) -> str:
        logger = getattr(self, "_logger", None)
        return "; ".join(logger.errors) if logger is not None else ""

    def _describe_io(self) -> None:
        trt, engine = self._trt, self._engine
        inputs, outputs, dtypes = [], [], {}
        for index in range(engine.num_io_tensors):
            name = engine.get_tensor_name(index)
            if engine.get_tensor_location(name) != trt.TensorLocation.DEVICE:
                raise EngineError(f"tensor {name!r} lives on the host (a shape tensor): not supported")
            try:
                dtypes[name] = np.dtype(trt.nptype(engine.get_tensor_dtype(name)))
            except TypeError as exc:
                raise EngineError(f"tensor {name!r} has a type numpy cannot hold: {exc}") from exc
            if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                inputs.append(name)
            else:
                outputs.append(name)
        self._inputs = tuple(inputs)
        self._outputs = tuple(outputs)
        self._dtypes = dtypes

    # ------------------------------------------------------------------ the Engine interface

    @property
    def input_names(self) -> tuple[str, ...]:
        return self._inputs

    @property
    def output_names(self) -> tuple[str, ...]:
        return self._outputs

    @property
    def num_profiles(self) -> int:
        return len(self._contexts)

    @property
    def pool(self) -> MemoryPool | None:
        """The instance's memory pool (for its statistics)."""
        return self._pool

    def profile_shapes(self, name: str, profile: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """``(min, opt, max)`` shapes of input ``name`` in ``profile`` (all three equal without profiles)."""
        key = (name, profile)
        if key not in self._shape_cache:
            if self._num_profiles:
                low, opt, high = self._engine.get_tensor_profile_shape(name, profile)
            else:
                low = opt = high = self._engine.get_tensor_shape(name)
            self._shape_cache[key] = (tuple(low), tuple(opt), tuple(high))
        return self._shape_cache[key]

    def activation_bytes(self, n: int, length: int, profile: int = 0) -> int | None:
        """Device memory a group of ``n`` sequences padded to ``length`` takes from the pool when launched:
        its input and output buffers. The context's own activation memory for ``profile`` was taken from the
        pool when the profile was selected, at load (``ON_PROFILE_CHANGE``), and stays held, so it is not
        needed again. In a tensor's engine shape the first dynamic axis is the batch, the others the sequence.
        """
        total = 0
        for name in (*self._inputs, *self._outputs):
            count = 1
            for axis, dim in enumerate(self._engine.get_tensor_shape(name)):
                count *= (n if axis == 0 else max(1, length)) if dim < 0 else int(dim)
            total += count * self._dtypes[name].itemsize
        return total

    def free_device_bytes(self) -> int | None:
        """Memory the driver has free on the device plus what the instance's pool holds unused (its cached
        blocks serve the next allocation first)."""
        rt = self._rt
        free, _total = check(rt, rt.cudaMemGetInfo(), "cudaMemGetInfo")
        stats = self._pool.stats() if self._pool is not None and hasattr(self._pool, "stats") else None
        cached = max(0, int(stats.reserved) - int(stats.used)) if stats is not None else 0
        return int(free) + cached

    def _check_feeds(self, feeds: dict[str, np.ndarray], profile: int) -> dict[str, np.ndarray]:
        if not 0 <= profile < len(self._contexts):
            raise EngineError(f"profile {profile} does not exist: the engine has {len(self._contexts)}")
        missing = [n for n in self._inputs if n not in feeds]
        extra = [n for n in feeds if n not in self._inputs]
        if missing or extra:
            raise EngineError(
                f"inputs do not match the engine: missing {missing or 'none'}, unknown {extra or 'none'}; "
                f"it takes {list(self._inputs)}"
            )
        arrays = {}
        for name in self._inputs:
            arr = np.ascontiguousarray(feeds[name], dtype=self._dtypes[name])
            low, _, high = self.profile_shapes(name, profile)
            if len(arr.shape) != len(high) or any(
                not lo <= d <= hi for d, lo, hi in zip(arr.shape, low, high)
            ):
                raise EngineError(
                    f"input {name!r} has shape {arr.shape}, outside profile {profile} "
                    f"(min {low}, max {high}): pick the profile that covers the group's length"
                )
            arrays[name] = arr
        return arrays

    def run(self, feeds: dict[str, np.ndarray], profile: int = 0) -> dict[str, np.ndarray]:
        """Run one group on ``profile``'s context; outputs are on the host when this returns."""
        if self._closed:
            raise EngineError("the TensorRT engine is closed")
        arrays = self._check_feeds(feeds, profile)
        rt, pool, stream = self._rt, self._pool, self._stream
        context = self._contexts[profile]
        with self._lock:
            buffers: list[int] = []
            results: dict[str, np.ndarray] = {}
            try:
                for name, arr in arrays.items():
                    if not context.set_input_shape(name, arr.shape):
                        raise EngineError(f"TensorRT refused shape {arr.shape} for input {name!r}")
                    context.set_tensor_address(name, to_device(rt, pool, arr, stream, buffers))
                pending = []
                for name in self._outputs:
                    shape = tuple(context.get_tensor_shape(name))
                    if any(d < 0 for d in shape):
                        raise EngineError(
                            f"output {name!r} has a data-dependent shape {shape}: not supported by this engine"
                        )
                    host = np.empty(shape, dtype=self._dtypes[name])
                    ptr = pool.allocate(max(host.nbytes, 1), stream)
                    buffers.append(ptr)
                    context.set_tensor_address(name, ptr)
                    pending.append((host, ptr))
                    results[name] = host
                if not context.execute_async_v3(self._stream_handle):
                    raise EngineError(f"TensorRT execution failed ({self._trt_errors() or 'no message'})")
                for host, ptr in pending:
                    to_host(rt, host, ptr, stream)
            finally:
                # Frees are stream-ordered: they happen after the copies queued above.
                for ptr in buffers:
                    pool.free(ptr, stream)
                check(rt, rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
        return results

    def close(self) -> None:
        """Release contexts, engine, runtime, pool (if made here) and stream (idempotent)."""
        rt = getattr(self, "_rt", None)
        if rt is not None and self._stream is not None:
            rt.cudaStreamSynchronize(self._stream)
        # Destruction order matters: contexts, then the engine, then the runtime and allocator.
        self._contexts.clear()
        self._engine = None
        self._runtime = None
        self._allocator = None
        release_stream(rt, self._stream, self._pool, self._owns_pool)
        if self._owns_pool:
            self._pool = None
        self._stream = None
        self._closed = True
