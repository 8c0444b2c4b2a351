"""ONNX Runtime engines: the CPU provider, and the CUDA provider for GPU instances (``onnxruntime-gpu``).

CPU
    ``OnnxRuntimeEngine``: ONNX Runtime's CPU provider, telemetry off; an INT8 Q/DQ model on integer
    kernels or with Q/DQ simulated in float (``cpu_features`` chooses), weights dequantized once at load.

CUDA (``OnnxRuntimeCudaEngine``)
    Needs the ``onnxruntime-gpu`` wheel (extra ``onnxruntime-gpu``), which installs the same
    ``onnxruntime`` package as the CPU wheel: never both in one environment (the second one installed
    overwrites the first's files). The session runs the CUDA execution provider on the instance's own
    stream (``user_compute_stream``); inputs are copied into buffers from the instance's
    ``cudaMallocAsync`` pool (``memory_pool.MemoryPool``) and bound with I/O binding on their device
    pointers, outputs are bound to pool buffers too when their shape follows from the inputs (else ONNX
    Runtime allocates them), and ONNX Runtime's own arena (activations) grows only by what is asked
    (``kSameAsRequested``). A session that silently fell back to the CPU provider (CUDA libraries
    missing) is refused: a GPU instance never computes on the CPU by surprise.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

import numpy as np

from ..memory.pool import CudaError, MemoryPool, check, release_stream, require_device, to_device, to_host
from .base import EngineError

CUDA_PROVIDER = "CUDAExecutionProvider"
_MIB = 1 << 20


def import_onnxruntime() -> ModuleType:
    """``onnxruntime`` with telemetry off (air-gapped: ORT otherwise resolves a telemetry host)."""
    import onnxruntime as ort  # imported here: the backend package must import without it

    if hasattr(ort, "disable_telemetry_events"):
        ort.disable_telemetry_events()
    return ort


# Both wheels install the same ``onnxruntime/`` package: whichever was installed last overwrites the other's files.
EXCLUSIVE_DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu")


def onnxruntime_conflict(distributions) -> str | None:
    """A message when ``distributions`` (project names) hold both the CPU and the GPU ONNX Runtime wheel."""
    names = {str(n).lower().replace("_", "-") for n in distributions}
    if all(d in names for d in EXCLUSIVE_DISTRIBUTIONS):
        return ("both onnxruntime (CPU) and onnxruntime-gpu are present: they install the same onnxruntime "
                "package and overwrite each other's files. Fix: keep one, in an environment of its own "
                "(extras onnx/serve bring the CPU wheel, onnxruntime-gpu/serve-gpu the GPU one)")
    return None


def installed_onnxruntime_conflict() -> str | None:
    """:func:`onnxruntime_conflict` for this environment's installed distributions."""
    import importlib.metadata as md

    present = []
    for name in EXCLUSIVE_DISTRIBUTIONS:
        try:
            md.version(name)
            present.append(name)
        except md.PackageNotFoundError:
            continue
    return onnxruntime_conflict(present)


def cuda_provider_unavailable_reason(ort: ModuleType | None = None) -> str | None:
    """Why ONNX Runtime cannot run the CUDA provider here, or None when it can."""
    if ort is None:
        clash = installed_onnxruntime_conflict()
        if clash:
            return clash
    try:
        ort = ort or import_onnxruntime()
    except ImportError as exc:
        return f"onnxruntime is not installed ({exc}): pip install 'model-factory[onnxruntime-gpu]'"
    if CUDA_PROVIDER not in ort.get_available_providers():
        return (f"this onnxruntime ({getattr(ort, '__version__', '?')}) has no {CUDA_PROVIDER}: it is the CPU "
                "wheel. Install onnxruntime-gpu instead of it (pip uninstall onnxruntime; pip install "
                "'model-factory[onnxruntime-gpu]'): both wheels install the same package")
    return None


def cuda_session(ort: Any, source: Path | str | bytes, device_id: int, stream: int, *, preload: bool = True) -> Any:
    """An InferenceSession on ONNX Runtime's CUDA provider computing on ``stream`` (the instance's: copies it queues
    there are ordered with the session's work), its arena growing only by what is asked. EngineError where this
    onnxruntime has no CUDA provider, or where the session silently fell back to the CPU provider (CUDA libraries
    missing): a GPU instance never computes on the CPU by surprise."""
    why = cuda_provider_unavailable_reason(ort)
    if why:
        raise EngineError(why)
    loader = getattr(ort, "preload_dlls", None)
    if preload and callable(loader):
        try:  # CUDA and cuDNN from the nvidia-* wheels (torch's cu130 ones included), when ORT finds them
            loader()
        except Exception:  # noqa: BLE001 - the session below names what is really missing
            pass
    opts = ort.SessionOptions()
    opts.log_severity_level = 4  # errors arrive as exceptions; ORT's own coloured stderr lines are noise
    provider = {"device_id": str(int(device_id)), "user_compute_stream": str(int(stream)),
                "has_user_compute_stream": "1", "arena_extend_strategy": "kSameAsRequested",
                "do_copy_in_default_stream": "1"}
    session = ort.InferenceSession(source if isinstance(source, bytes) else str(source), sess_options=opts,
                                   providers=[(CUDA_PROVIDER, provider), "CPUExecutionProvider"])
    used = list(session.get_providers())
    if not used or used[0] != CUDA_PROVIDER:
        raise EngineError(f"ONNX Runtime did not enable {CUDA_PROVIDER} (session providers: {used}); the "
                          "CUDA/cuDNN libraries onnxruntime-gpu needs are missing here. Install "
                          "'model-factory[onnxruntime-gpu]' (it pulls them)")
    return session


def _cpu_session(ort: Any, source: str | bytes, options: Any, **kwargs: Any) -> Any:
    """A CPU InferenceSession. One with an intra-op pool (more than one thread, or ORT's default of one per core)
    keeps its pool's threads at the normal priority even inside a quiet start, for they serve later
    (quiet_start.py): there the C++ session, whose constructor starts the pool, is made by the normal-priority
    worker, and its initialization (reading the weights, graph optimization, packing the weights for the kernels:
    0.3-1.1 CPU-seconds for a 110M Llama in FP32, against 0.01 for the constructor) runs here, on the quiet thread."""
    def make() -> Any:
        return ort.InferenceSession(source, sess_options=options, providers=["CPUExecutionProvider"], **kwargs)

    if options.intra_op_num_threads == 1:
        return make()
    from .quiet_start import at_normal_priority, in_quiet_start

    if in_quiet_start():
        session = _pool_then_initialize(ort, source, options, kwargs)
        if session is not None:
            return session
    return at_normal_priority(make)


def _pool_then_initialize(ort: Any, source: str | bytes, options: Any, kwargs: dict) -> Any:
    """The session made in two steps, as ``InferenceSession._create_inference_session`` makes it (onnxruntime 1.32): the C++
    session on the normal-priority worker, ``initialize_session`` on the calling thread. None where this
    onnxruntime lacks the pieces (the caller then makes the whole session on the worker)."""
    from .quiet_start import at_normal_priority

    c_api = getattr(getattr(ort, "capi", None), "_pybind_state", None)
    wrap = getattr(ort.InferenceSession, "_from_initialized_c_session", None)
    if c_api is None or wrap is None or set(kwargs) - {"disabled_optimizers"}:
        return None
    disabled = set(kwargs.get("disabled_optimizers") or ())
    from_model = os.environ.get("ORT_LOAD_CONFIG_FROM_MODEL") == "1"  # as InferenceSession reads it
    sess = at_normal_priority(lambda: c_api.InferenceSession(options, source, isinstance(source, str), from_model))
    sess.initialize_session(["CPUExecutionProvider"], [{}], disabled)
    return wrap(sess)


class OnnxRuntimeEngine:
    """Runs an ONNX model with ONNX Runtime's CPU provider, telemetry off."""

    flavour = "onnxruntime"
    device = "cpu"

    def __init__(self, model: Path | bytes, threads: int | None = None, spinning: bool = True,
                 int8: str | None = None, wide_threads: int | None = None, ledger: Any = None) -> None:
        """``model``: the ONNX bytes, or a path (a model with external data is loaded from its path).

        ``int8`` (an INT8 Q/DQ model): ``integer`` fuses Q/DQ into ONNX Runtime's integer kernels,
        ``simulated`` keeps every activation's Q/DQ as float arithmetic; both fold the weights'
        DequantizeLinear into float constants once, at load, instead of on every call (see
        :func:`_int8_sessions`). ``spinning=False`` lets idle intra-op threads sleep at once (instances
        whose threads outnumber the cores).

        ``wide_threads`` and ``ledger`` (an ``idle_cores.BusyLedger``): a second session with that many
        threads (spinning off) runs inside :meth:`busy` with ``borrow`` while no other CPU instance of the
        server is computing (``idle_cores``); ``wide_runs``/``runs`` count how often.
        """
        ort = import_onnxruntime()

        def options(count: int | None = threads, spin: bool = spinning) -> Any:
            opts = ort.SessionOptions()
            opts.log_severity_level = 4  # errors arrive as exceptions; ORT's own coloured stderr lines are noise
            if count:
                opts.intra_op_num_threads = count
            if not spin:
                opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
            return opts

        kinds = [options]
        if wide_threads and ledger is not None:
            # Spinning off: a borrowed core must go back the moment another instance starts computing.
            kinds.append(lambda: options(wide_threads, False))
        # Bytes come from the integrity check: the session is built from exactly what was hashed.
        source = model if isinstance(model, bytes) else str(model)
        if int8 in ("integer", "simulated"):
            sessions = _int8_sessions(ort, source, kinds, integer=int8 == "integer")
        else:
            sessions = [_cpu_session(ort, source, make()) for make in kinds]
        self._session = sessions[0]
        self._wide = sessions[1] if len(sessions) > 1 else None
        self._ledger = ledger if self._wide is not None else None
        self.runs = self.wide_runs = 0
        # Whether the last run took borrowed cores: its timing says nothing of the loaded case (cost model).
        self.last_run_borrowed = False
        self._may_borrow = False
        self.input_names = tuple(i.name for i in self._session.get_inputs())
        self.output_names = tuple(o.name for o in self._session.get_outputs())

    @property
    def lends_cores(self) -> bool:
        """Whether runs take every core when no other instance computes."""
        return self._wide is not None

    @contextlib.contextmanager
    def busy(self, borrow: bool) -> Iterator[None]:
        """Mark this instance as computing for a whole ``execute()`` (its Python work holds a core too), and
        let its runs borrow idle cores only when ``borrow`` (the window is one request: nothing else was
        queued). Outside it (warm-up, the cost model's timings) runs keep the instance's own threads: the
        cost model must describe the loaded case. A no-op when the engine does not lend."""
        if self._ledger is None:
            yield
            return
        with self._ledger.busy():
            self._may_borrow = borrow
            try:
                yield
            finally:
                self._may_borrow = False

    def run(self, feeds: dict[str, np.ndarray], profile: int = 0) -> dict[str, np.ndarray]:
        """Run one group; ``profile`` is ignored (ONNX Runtime takes any shape)."""
        names, inputs = list(self.output_names), {k: feeds[k] for k in self.input_names}
        self.runs += 1
        if self._ledger is None:
            return dict(zip(self.output_names, self._session.run(names, inputs)))
        if self._may_borrow and not self._ledger.others_busy():
            self.last_run_borrowed = True
            self.wide_runs += 1
            with self._ledger.borrowing():
                outs = self._wide.run(names, inputs)
        else:
            self.last_run_borrowed = False
            self._ledger.wait_for_borrower()  # never beside a run on borrowed cores: three threads on two cores
            outs = self._session.run(names, inputs)
        return dict(zip(self.output_names, outs))

    def close(self) -> None:
        """Drop the sessions."""
        self._session = self._wide = None
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None


def _int8_sessions(ort: ModuleType, source: str | bytes, kinds: list, *, integer: bool) -> list:
    """INT8 Q/DQ sessions, one per session-options maker in ``kinds``, whose weights are dequantized once, at
    load (the fusing pass runs once, with the first maker's options).

    ``session.disable_quant_qdq`` turns ONNX Runtime's Q/DQ fusions off and, with them, lets constant
    folding evaluate ``DequantizeLinear(int8 weight)`` into a float constant (with the QDQ fusions on,
    it skips DequantizeLinear on purpose). Simulated: that, in one session; every activation's Q/DQ still
    runs in float, as the gate scored it. Integer: a first session fuses what it can into integer kernels
    (``MatMulIntegerToFloat``) and writes the optimized graph to a private folder (models under
    :data:`FOLD_LIMIT_BYTES` only: a larger one loads once, as fused); a second one loads that
    graph with the fusions off, which folds the weights of MatMuls left unfused (ONNX Runtime fuses a
    DequantizeLinear only into its one reader: INT8 models quantized before the quantize stage wrote a Q/DQ
    pair per reader left MiniLM's Q/K/V projections, 18 of 44 MatMuls, in float). Profiled on MiniLM at batch 1 x 16 tokens, dequantizing the weights
    on every call was about half of the INT8 run; served, see benchmarks/RESULTS.md, "INT8 on the CPU".
    """
    import shutil
    import tempfile

    def session(src: str | bytes, options: Any, **kwargs: Any) -> Any:
        return _cpu_session(ort, src, options, **kwargs)

    def folding(options: Any) -> Any:
        options.add_session_config_entry("session.disable_quant_qdq", "1")
        return options

    if not integer:
        return [session(source, folding(make())) for make in kinds]
    if not _small(source):  # a second pass would write the whole model (GBs) to disk at every load
        return [session(source, make()) for make in kinds]
    folder = tempfile.mkdtemp(prefix="mf-int8-")
    try:
        first = kinds[0]()
        first.optimized_model_filepath = str(Path(folder) / "optimized.onnx")
        # Weights past protobuf's 2 GB limit go to a file beside the graph.
        first.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.data")
        first.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1048576")
        # Common-subexpression elimination would merge the per-reader Q/DQ pairs the quantize stage writes
        # back into one shared pair, which ONNX Runtime does not fuse: off for the fusing pass only.
        session(source, first, disabled_optimizers=["CommonSubexpressionElimination"])
        return [session(first.optimized_model_filepath, folding(make())) for make in kinds]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# Past this size (graph + external data) the integer path loads once, without folding leftover weights.
FOLD_LIMIT_BYTES = 1 << 30


def _small(source: str | bytes) -> bool:
    """Whether the model (its bytes, or its file and the external data beside it) is under FOLD_LIMIT_BYTES."""
    if isinstance(source, bytes):
        return len(source) < FOLD_LIMIT_BYTES
    path = Path(source)
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.is_file() else 0) < FOLD_LIMIT_BYTES


_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
              "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8,
              "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_}


class OnnxRuntimeCudaEngine:
    """Runs an ONNX model (FP32, FP16 or INT8 Q/DQ) with ONNX Runtime's CUDA provider on one GPU instance.

    ``ort_module``, ``runtime`` (``cuda.bindings.runtime``) and ``pool`` can be given (tests pass
    fakes); by default they are imported and the pool is made here from ``settings``' pool sizes.
    """

    flavour = "onnxruntime"

    def __init__(self, model: Path | bytes, *, device_id: int = 0, settings: Any = None,
                 ort_module: ModuleType | None = None, runtime: ModuleType | None = None, pool: Any = None) -> None:
        self.device_id = int(device_id)
        self.device = f"cuda:{self.device_id}"
        self._closed = False
        self._lock = threading.Lock()
        self._session = self._stream = None
        self._owns_pool = pool is None
        self._pool = pool
        try:
            ort = ort_module or import_onnxruntime()
        except ImportError as exc:
            raise EngineError(f"ONNX Runtime CUDA: {exc}; pip install 'model-factory[onnxruntime-gpu]'") from exc
        why = cuda_provider_unavailable_reason(ort)  # named before the device: the fix for this machine's wheel
        if why:
            raise EngineError(why)
        try:
            self._rt = rt = runtime or require_device(self.device_id)
        except CudaError as exc:
            raise EngineError(f"ONNX Runtime CUDA needs a GPU: {exc}") from exc
        try:
            check(rt, rt.cudaSetDevice(self.device_id), f"cudaSetDevice({self.device_id})")
            self._stream = check(rt, rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreate")
            if self._pool is None:
                threshold = int(getattr(settings, "pool_release_threshold_mib", 256)) * _MIB
                initial = int(getattr(settings, "pool_initial_mib", 0)) * _MIB
                self._pool = MemoryPool(self.device_id, threshold, initial)
            self._session = cuda_session(ort, model, self.device_id, self._stream, preload=ort_module is None)
        except BaseException:
            self.close()
            raise
        self.input_names = tuple(i.name for i in self._session.get_inputs())
        self.output_names = tuple(o.name for o in self._session.get_outputs())
        self._out_meta = {o.name: (tuple(o.shape), _ORT_TYPES.get(o.type)) for o in self._session.get_outputs()}
        self._in_meta = {i.name: tuple(i.shape) for i in self._session.get_inputs()}

    @property
    def pool(self) -> Any:
        """The instance's cudaMallocAsync pool (its statistics are the backend's pool gauges)."""
        return self._pool

    def _output_shape(self, name: str, arrays: dict[str, np.ndarray]) -> tuple[int, ...] | None:
        """The output's shape when every symbolic axis is named by an input axis too, else None."""
        shape, dtype = self._out_meta[name]
        if dtype is None:
            return None
        axes: dict[str, int] = {}
        for iname, ishape in self._in_meta.items():
            for sym, size in zip(ishape, arrays[iname].shape):
                if isinstance(sym, str):
                    axes.setdefault(sym, int(size))
        out = []
        for d in shape:
            if isinstance(d, int) and d >= 0:
                out.append(d)
            elif isinstance(d, str) and d in axes:
                out.append(axes[d])
            else:
                return None
        return tuple(out)

    def run(self, feeds: dict[str, np.ndarray], profile: int = 0) -> dict[str, np.ndarray]:
        """Run one group on the instance stream; outputs are on the host when this returns."""
        if self._closed:
            raise EngineError("the ONNX Runtime CUDA engine is closed")
        rt, pool, stream = self._rt, self._pool, self._stream
        arrays = {k: np.ascontiguousarray(feeds[k]) for k in self.input_names}
        with self._lock:
            binding = self._session.io_binding()
            buffers: list[int] = []
            pending: list[tuple[str, np.ndarray, int]] = []
            results: dict[str, np.ndarray] = {}
            try:
                for name, arr in arrays.items():
                    ptr = to_device(rt, pool, arr, stream, buffers)
                    binding.bind_input(name, "cuda", self.device_id, arr.dtype, list(arr.shape), ptr)
                ort_outputs = []
                for name in self.output_names:
                    shape = self._output_shape(name, arrays)
                    if shape is None:
                        binding.bind_output(name, "cuda", self.device_id)  # ONNX Runtime allocates it
                        ort_outputs.append(name)
                        continue
                    host = np.empty(shape, dtype=self._out_meta[name][1])
                    ptr = pool.allocate(max(host.nbytes, 1), stream)
                    buffers.append(ptr)
                    binding.bind_output(name, "cuda", self.device_id, host.dtype, list(shape), ptr)
                    pending.append((name, host, ptr))
                # The inputs' copies were queued on the stream the session computes on: ordered.
                self._session.run_with_iobinding(binding)
                for name, host, ptr in pending:
                    to_host(rt, host, ptr, stream)
                    results[name] = host
                if ort_outputs:
                    copied = binding.copy_outputs_to_cpu()
                    for name, value in zip(self.output_names, copied):
                        if name in ort_outputs:
                            results[name] = np.asarray(value)
            finally:
                for ptr in buffers:  # stream-ordered: after the copies queued above
                    pool.free(ptr, stream)
                check(rt, rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
        return {n: results[n] for n in self.output_names}

    def close(self) -> None:
        """Drop the session, then the pool (if made here) and the stream (idempotent)."""
        if self._closed:
            return
        self._closed = True
        rt = getattr(self, "_rt", None)
        if rt is not None and self._stream is not None:
            rt.cudaStreamSynchronize(self._stream)
        self._session = None
        release_stream(rt, self._stream, self._pool, self._owns_pool)
        self._pool = self._stream = None
