"""Torch engine: the export's ExportedProgram (``model.pt2``, ``torch.export``) on the instance's GPU or CPU.

Repositories built before ``torch.export`` hold a TorchScript trace (``model.torchscript.pt``): it still
loads (with a note in the log that TorchScript is deprecated and a rebuild writes ``model.pt2``).

For GPU machines without a TensorRT that can run there (the H200 test machine has
no TensorRT, and TensorRT-RTX refuses compute capability 9.0): torch with CUDA is
the GPU executor.

- The program is loaded with ``torch.export.load`` (a trace with ``torch.jit.load``) from the bytes the
  integrity check read (never re-read from disk), moved to the instance's device
  (``torch.export.passes.move_to_device_pass``; a trace is mapped there).
- Input and output names come from the file itself: the export stores them in an
  extra file (:data:`IO_EXTRA_FILE`) in the order of the traced ``forward``'s
  positional arguments and returned tuple; the count is checked against the
  traced signature, and names given by the caller must agree.
- On CUDA: one ``torch.cuda.Stream`` per engine; each group runs under
  ``torch.inference_mode()`` on that stream, inputs copied in with
  ``non_blocking=True``, outputs copied to the host with ``.to("cpu")`` and the
  stream synchronized before ``run`` returns: the numpy arrays handed back are
  complete host copies (deliberately: docs/environment.md records silent wrong values
  on the Triton<->Python-backend data path on an H200, so nothing device-side or
  still in flight is handed to Triton). Inputs are pageable numpy memory, not
  pinned: pinning each group costs a host allocation for a few kB of token ids.
- Device constants the trace recorded (the export's CPU) are pointed at the engine's device
  (:func:`retarget_device_constants`).
- A ``torch.cuda.OutOfMemoryError`` (or any other failure) propagates from
  ``run``: the executor splits the group and retries. The cache is not emptied per
  call (too slow); :attr:`TorchEngine.pool` offers ``trim`` for idle trimming.

``torch`` is imported when an engine is made (or CUDA is probed), not when this
module is imported: the backend package imports without torch.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import threading
import warnings
from typing import Any, Sequence

import numpy as np

from ..contract import Files
from .base import EngineError

TORCHSCRIPT_FILE = Files.TORCHSCRIPT  # repositories built before torch.export
EXPORTED_PROGRAM_FILE = Files.EXPORTED_PROGRAM
# Extra file inside the TorchScript archive: {"inputs": [...], "outputs": [...]} in positional order.
IO_EXTRA_FILE = Files.TORCHSCRIPT_IO
ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
ASYNC_ALLOC_CONF = "backend:cudaMallocAsync"
_SET_HERE = False  # whether configure_cuda_allocator set the variable (not the user)


def configure_cuda_allocator() -> str:
    """Ask torch for its ``cudaMallocAsync`` allocator backend, if it is still possible; say what happened.

    torch picks its CUDA allocator backend once, while its CUDA library is being
    loaded (c10's ``BackendStaticInitializer`` reads ``PYTORCH_CUDA_ALLOC_CONF`` during
    static initialization, i.e. at ``import torch``): setting the variable later,
    even before the first CUDA allocation, is not honoured for the backend. So it is
    set here only when torch is not imported yet in this process (inside Triton's
    stub the engine is normally the first to import it) and only when the user has
    not set ``PYTORCH_CUDA_ALLOC_CONF`` themselves (their choice wins, whatever it is).
    Stream-ordered ``cudaMallocAsync`` frees and reuses memory in microseconds and
    lets the driver share freed memory between instances (see memory_pool.py).
    """
    global _SET_HERE
    if _SET_HERE and os.environ.get(ALLOC_CONF_ENV) == ASYNC_ALLOC_CONF:
        return f"set {ALLOC_CONF_ENV}={ASYNC_ALLOC_CONF} before importing torch"
    if ALLOC_CONF_ENV in os.environ:
        return f"{ALLOC_CONF_ENV}={os.environ[ALLOC_CONF_ENV]!r} set by the user: left as is"
    if "torch" in sys.modules:
        return "torch was imported before the engine: its allocator backend is already fixed"
    os.environ[ALLOC_CONF_ENV] = ASYNC_ALLOC_CONF
    _SET_HERE = True
    return f"set {ALLOC_CONF_ENV}={ASYNC_ALLOC_CONF} before importing torch"


def cuda_unavailable_reason(device_id: int = 0) -> str | None:
    """None when torch with CUDA can run on ``device_id``; else why not (never raises).

    Configures the allocator first (see :func:`configure_cuda_allocator`), since this
    may be the first ``import torch`` in the process.
    """
    configure_cuda_allocator()
    try:
        import torch
    except ImportError as exc:
        return f"torch is not installed ({exc})"
    try:
        if not torch.cuda.is_available():
            return f"torch {torch.__version__} has no usable CUDA (a CPU build, or no driver or GPU)"
        count = torch.cuda.device_count()
    except Exception as exc:  # a broken driver raises RuntimeError and friends
        return f"torch cannot use CUDA: {type(exc).__name__}: {exc}"
    if not 0 <= device_id < count:
        return f"CUDA device {device_id} does not exist (torch sees {count})"
    return None


def read_io_names(module: Any, extra: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """The ``(inputs, outputs)`` names stored by the export in the archive, or None if there are none."""
    raw = extra.get(IO_EXTRA_FILE) or b""
    if not raw:
        return None
    try:
        info = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        inputs = tuple(str(n) for n in info["inputs"])
        outputs = tuple(str(n) for n in info["outputs"])
    except (ValueError, KeyError, TypeError) as exc:
        raise EngineError(f"the TorchScript file's {IO_EXTRA_FILE} is unreadable ({exc}): re-export the model") from exc
    return inputs, outputs


def is_exported_program(data: bytes) -> bool:
    """Whether ``data`` is a ``torch.export`` archive (it names its ``archive_format``), not TorchScript."""
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(bytes(data))) as archive:
            return any(n == "archive_format" or n.endswith("/archive_format") for n in archive.namelist())
    except zipfile.BadZipFile:
        return False


def retarget_device_constants(module: Any, device: str) -> int:
    """Point every device constant in the module's graphs at ``device``; return how many were changed.

    ``torch.jit.trace`` records ``x.device`` as a constant: transformers' mask code (``torch.arange(...,
    device=input_ids.device)``, ``attention_mask.to(device, torch.bool)``) traced on the export's CPU
    would build the attention mask on the CPU while everything else runs on ``map_location``'s GPU.
    A model served by this engine computes on one device, so every device constant is that device.
    Done on the loaded graphs, before the first run (the graph executor compiles on first call).
    """

    def nodes(block: Any):
        for node in block.nodes():
            yield node
            for inner in node.blocks():
                yield from nodes(inner)

    changed = 0
    for sub in module.modules():
        for name in sub._c._method_names():
            for node in nodes(sub._c._get_method(name).graph):
                if (node.kind() == "prim::Constant" and node.hasAttribute("value")
                        and str(node.output().type()) == "Device" and node.s("value") != device):
                    node.s_("value", device)
                    changed += 1
    return changed


class TorchCudaPool:
    """The engine's view of torch's CUDA allocator, shaped like :class:`~..memory_pool.MemoryPool` for the
    backend's pool hooks (``stats()``, ``trim(keep_bytes)``, ``closed``).

    torch's statistics are per process and device: inside Triton's stub the engine
    is the only torch user, so they describe this instance.
    """

    def __init__(self, torch: Any, device: Any) -> None:
        self._torch = torch
        self._device = device
        self._closed = False
        # The engine resets torch's peaks around each group (to measure its activations): the marks since
        # load are kept here.
        self._peaks = (0, 0)

    @property
    def closed(self) -> bool:
        return self._closed

    def reset_peaks(self) -> None:
        """Fold torch's peaks into the marks kept here, then reset torch's (a group's own peak follows)."""
        self.raw_stats()
        self._torch.cuda.reset_peak_memory_stats(self._device)

    def raw_stats(self) -> dict[str, int]:
        stats = self._torch.cuda.memory_stats(self._device)  # one call: memory_reserved() etc. each make one
        self._peaks = (max(self._peaks[0], int(stats.get("reserved_bytes.all.peak", 0))),
                       max(self._peaks[1], int(stats.get("allocated_bytes.all.peak", 0))))
        return {
            "reserved_bytes": int(stats.get("reserved_bytes.all.current", 0)),
            "used_bytes": int(stats.get("allocated_bytes.all.current", 0)),
            "high_water_bytes": self._peaks[0],
            "used_high_water_bytes": self._peaks[1],
        }

    def stats(self) -> Any:
        from ..memory.pool import PoolStats

        s = self.raw_stats()
        return PoolStats(reserved=s["reserved_bytes"], used=s["used_bytes"], high_water=s["high_water_bytes"],
                         used_high_water=s["used_high_water_bytes"])

    def trim(self, keep_bytes: int = 0) -> None:
        """Give cached memory back to the driver (torch cannot keep a part: ``keep_bytes`` is not honoured).

        Meant for idle trimming, never per call.
        """
        if not self._closed:
            with self._torch.cuda.device(self._device):
                self._torch.cuda.empty_cache()

    def close(self) -> None:
        self._closed = True


class TorchEngine:
    """Runs a TorchScript module on ``device`` ("cpu" or "cuda:N"); see the module docstring.

    ``data``: the TorchScript archive (bytes, as verified). ``input_names`` /
    ``output_names``: the names the caller expects (checked against the names stored
    in the file; required when the file has none). ``vocab_size``: when given,
    ``input_ids`` outside ``[0, vocab_size)`` are refused on the host before they reach
    the device (an out-of-range embedding index is a device-side assert on CUDA,
    which would poison the process's CUDA context for every later request).
    ``threads``: torch's intra-op threads on the CPU (process-wide; default: torch's).
    ``exported_program``: ``data`` is a ``torch.export`` archive (``model.pt2``), else a TorchScript file;
    None: read from the archive (:func:`is_exported_program`).
    """

    flavour = "torch"

    def __init__(self, data: bytes, device: str = "cpu", *, input_names: Sequence[str] | None = None,
                 output_names: Sequence[str] | None = None, vocab_size: int | None = None,
                 threads: int | None = None, exported_program: bool | None = None) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise EngineError("TorchEngine takes the TorchScript file's bytes (as read by the integrity check)")
        self.device = str(device)
        self._cuda = self.device.startswith("cuda")
        self.allocator_note = configure_cuda_allocator() if self._cuda else None
        try:
            import torch
        except ImportError as exc:
            raise EngineError(f"engine=torch needs torch in the Python that runs the backend ({exc})") from exc
        self._torch = torch
        self._lock = threading.Lock()
        self._stream = None
        self.pool: TorchCudaPool | None = None
        self._vocab_size = vocab_size
        self._bytes_per_token: float | None = None  # peak activation memory per token seen (CUDA)
        if self._cuda:
            index = int(self.device.partition(":")[2] or 0)
            why = cuda_unavailable_reason(index)
            if why is not None:
                raise EngineError(f"a torch engine on {self.device} needs CUDA: {why}")
            self._device = torch.device("cuda", index)
        else:
            self._device = torch.device("cpu")
            if threads:
                torch.set_num_threads(int(threads))
        if exported_program is None:
            exported_program = is_exported_program(data)
        self.format = "ExportedProgram" if exported_program else "TorchScript"
        self.retargeted = 0
        if exported_program:
            module, extra = self._load_program(torch, data)
        else:
            module, extra = self._load_torchscript(torch, data)
        self._module = module
        self._inputs, self._outputs = self._resolve_names(module, extra, input_names, output_names)
        if self._cuda:
            self._stream = torch.cuda.Stream(device=self._device)
            self.pool = TorchCudaPool(torch, self._device)
            self.allocator_backend = torch.cuda.get_allocator_backend()
        else:
            self.allocator_backend = None
        print(f"[model-factory torch engine] {self.format} on {self.device} (torch {torch.__version__}"
              + (f", {self.retargeted} device constants retargeted; TorchScript is deprecated in torch: rebuild "
                 f"the repository to serve {EXPORTED_PROGRAM_FILE} (torch.export)" if not exported_program else "")
              + (f", allocator {self.allocator_backend}; {self.allocator_note}" if self._cuda else "") + ")",
              file=sys.stderr, flush=True)

    def _load_program(self, torch: Any, data: bytes) -> tuple[Any, dict[str, Any]]:
        """The ExportedProgram's module on the engine's device, and the archive's extra files."""
        extra: dict[str, Any] = {IO_EXTRA_FILE: ""}
        try:
            program = torch.export.load(io.BytesIO(bytes(data)), extra_files=extra)
            if self._cuda:
                from torch.export.passes import move_to_device_pass

                program = move_to_device_pass(program, self._device)
            # An exported module has no train/eval switch (export captured it in eval mode).
            return program.module(), extra
        except Exception as exc:  # torch raises many types for a bad or too-new archive
            raise EngineError(f"torch {torch.__version__} cannot load the exported program ({EXPORTED_PROGRAM_FILE}): "
                              f"{type(exc).__name__}: {str(exc)[:300]}") from exc

    def _load_torchscript(self, torch: Any, data: bytes) -> tuple[Any, dict[str, Any]]:
        """A TorchScript trace (repositories built before torch.export) on the engine's device."""
        extra: dict[str, Any] = {IO_EXTRA_FILE: b""}
        try:
            with warnings.catch_warnings():  # torch >= 2.10 calls TorchScript deprecated; it still loads
                warnings.simplefilter("ignore", DeprecationWarning)
                module = torch.jit.load(io.BytesIO(bytes(data)), map_location=self._device, _extra_files=extra)
        except Exception as exc:  # torch raises RuntimeError and others for a bad or too-new archive
            raise EngineError(f"torch {torch.__version__} cannot load the TorchScript file: {type(exc).__name__}: "
                              f"{str(exc)[:300]}") from exc
        module = module.eval()
        try:
            self.retargeted = retarget_device_constants(module, str(self._device))
        except (AttributeError, RuntimeError) as exc:  # a torch whose graph API differs
            raise EngineError(f"cannot point the traced module at {self.device}: {type(exc).__name__}: {exc}") from exc
        return module, extra

    def _resolve_names(self, module: Any, extra: dict[str, Any], input_names: Sequence[str] | None,
                       output_names: Sequence[str] | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
        stored = read_io_names(module, extra)
        given = None if input_names is None or output_names is None else (tuple(input_names), tuple(output_names))
        if stored is None and given is None:
            raise EngineError(f"the {self.format} file names no inputs/outputs ({IO_EXTRA_FILE} is missing) and none "
                              "were given: re-export the model with model-factory (export.torchscript = true)")
        if stored is not None and given is not None and stored != given:
            raise EngineError(f"the {self.format} file takes inputs {list(stored[0])} and returns {list(stored[1])}, "
                              f"but {list(given[0])} -> {list(given[1])} were expected: repackage the model")
        inputs, outputs = stored if stored is not None else given
        try:
            params = [a.name for a in module.forward.schema.arguments][1:]  # drop self
        except AttributeError:  # an exported program (or an older torch): trust the names
            params = list(inputs)
        if len(params) != len(inputs):
            raise EngineError(f"the traced forward() takes {len(params)} inputs {params}, but the file names "
                              f"{len(inputs)} {list(inputs)}: re-export the model")
        return inputs, outputs

    # ------------------------------------------------------------------ the Engine interface

    @property
    def input_names(self) -> tuple[str, ...]:
        return self._inputs

    @property
    def output_names(self) -> tuple[str, ...]:
        return self._outputs

    def _arrays(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        missing = [n for n in self._inputs if n not in feeds]
        extra = [n for n in feeds if n not in self._inputs]
        if missing or extra:
            raise EngineError(f"inputs do not match the engine: missing {missing or 'none'}, unknown "
                              f"{extra or 'none'}; it takes {list(self._inputs)}")
        # torch.from_numpy wants writable memory; the executor's padded groups are, Triton's views may not be.
        arrays = [a if a.flags.writeable else a.copy() for a in (np.ascontiguousarray(feeds[n]) for n in self._inputs)]
        if self._vocab_size is not None and "input_ids" in self._inputs:
            ids = arrays[self._inputs.index("input_ids")]
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self._vocab_size):
                raise EngineError(f"input_ids hold values outside [0, {self._vocab_size})")
        return arrays

    def _outputs_of(self, result: Any) -> list[Any]:
        outs = [result] if isinstance(result, self._torch.Tensor) else list(result)
        if len(outs) != len(self._outputs):
            raise EngineError(f"the module returned {len(outs)} tensors, expected {len(self._outputs)} "
                              f"{list(self._outputs)}")
        return outs

    def run(self, feeds: dict[str, np.ndarray], profile: int = 0) -> dict[str, np.ndarray]:
        """Run one group (``profile`` is ignored: the trace takes any shape); host arrays, complete, on return."""
        if self._module is None:
            raise EngineError("the torch engine is closed")
        torch = self._torch
        arrays = self._arrays(feeds)
        # Optimized execution off, as Triton's own PyTorch backend offers (DISABLE_OPTIMIZED_EXECUTION): the
        # profiling executor specializes the graph on the shapes it sees and re-optimizes when they change,
        # and every group here has a new (batch, length): that would be recompiling, not serving.
        optimized = torch.jit.optimized_execution(False) if self.format == "TorchScript" else contextlib.nullcontext()
        with self._lock, torch.inference_mode(), optimized:
            if not self._cuda:
                outs = self._outputs_of(self._module(*(torch.from_numpy(a) for a in arrays)))
                # .numpy() shares the tensors' memory, which is ours alone (kept alive by the arrays).
                return {n: o.detach().contiguous().numpy() for n, o in zip(self._outputs, outs)}
            stream = self._stream
            self.pool.reset_peaks()
            base = torch.cuda.memory_allocated(self._device)
            with torch.cuda.stream(stream):
                # Pageable source memory: the copies are ordered on this stream before the module runs.
                args = [torch.from_numpy(a).to(self._device, non_blocking=True) for a in arrays]
                outs = self._outputs_of(self._module(*args))
                host = [o.to("cpu") for o in outs]
            stream.synchronize()  # every copy done before the host arrays leave this function
            self._observe_peak(arrays, torch.cuda.max_memory_allocated(self._device) - base)
            return {n: h.numpy() for n, h in zip(self._outputs, host)}

    def _observe_peak(self, arrays: list[np.ndarray], peak: int) -> None:
        """Keep the most activation memory per token seen (the warm-up sweep runs the longest shapes)."""
        first = arrays[0] if arrays else None
        tokens = int(first.shape[0] * (first.shape[1] if first.ndim > 1 else 1)) if first is not None else 0
        if tokens > 0 and peak > 0:
            self._bytes_per_token = max(self._bytes_per_token or 0.0, peak / tokens)

    def activation_bytes(self, n: int, length: int, profile: int = 0) -> int | None:
        """Device memory a group of ``n`` sequences of ``length`` tokens needs (CUDA, once a group has run)."""
        if not self._cuda or not self._bytes_per_token:
            return None
        return int(self._bytes_per_token * n * max(1, length))

    def free_device_bytes(self) -> int | None:
        """Memory the driver has free on the device plus what torch's cache holds unused; None on the CPU."""
        if not self._cuda:
            return None
        torch = self._torch
        free, _total = torch.cuda.mem_get_info(self._device)
        return int(free + torch.cuda.memory_reserved(self._device) - torch.cuda.memory_allocated(self._device))

    def memory_stats(self) -> dict[str, int]:
        """``reserved_bytes``, ``used_bytes``, ``high_water_bytes``, ``used_high_water_bytes`` on CUDA; {} on CPU."""
        return self.pool.raw_stats() if self.pool is not None else {}

    def close(self) -> None:
        """Drop the module and stream (idempotent); on CUDA, give cached memory back once."""
        if self._stream is not None:
            self._stream.synchronize()
        self._module = None
        self._stream = None
        if self.pool is not None:
            self.pool.trim()
            self.pool.close()
