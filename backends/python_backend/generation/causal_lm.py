"""One step of a text-generation graph on ONNX Runtime: prefill of new prompts, or a batched decode.

The graph (``contract``: "shared-slots") takes ``input_ids [n, s]``, ``attention_mask [n, total]`` (row r:
ones for its cached and new tokens, then zeros) and the past keys and values, and writes the new tokens'
keys and values in place into the same buffers (``present.*`` bound to the ``past_key_values.*`` pointers).
A step runs on a contiguous slice of the KV slots (``kv_slots.KVSlots.views``), so every active sequence
decodes in one launch, each at its own length, and a group of new prompts is prefilled in one launch,
right-padded to its longest. The buffers have the graph's KV element type (float32, or float16 for an FP16
graph: ``GenerationSpec.for_precision``); logits come out as float32 either way.

Only the last position's logits of each row are computed (``logits_positions``: a prefill's other positions are
never sampled, and the LM head over them was a large share of a prefill's work); teacher-forced scoring asks for
every position. A graph packaged before that input existed computes every position and the rows are picked here.

A step's I/O binding is kept per KV view (the same ``views`` object: ``KVSlots.views`` returns one per slice): a step
then binds its ids, mask, positions and a new logits array instead of two tensors per layer and kind as well
(0.4-0.6 ms a step on the 30-layer SmolLM shape; decode at batch 1 was 1.07x faster in FP32 and 1.14x in INT4
with it). Each step's logits are an array of their own, as before: a caller may keep them.

On a GPU (``CausalLM(..., cuda=CudaPlacement(device, stream))``) the session runs ONNX Runtime's CUDA provider on
the instance's stream and the KV views are ``kv_device.DeviceView`` pointers into the device buffers (the
compaction's copies are queued on the same stream, so a step sees them); ids, mask and positions are copied in by
ONNX Runtime and the logits come back to the host. Only a graph whose cache is float16 is run there: ONNX
Runtime's CUDA ``GroupQueryAttention`` has half-precision kernels only (float16, bfloat16), and a float32 or
INT8-cache graph's attention would run on the CPU, copying the whole cache across every step
(:func:`device_kv_problem`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..contract import ATTENTION_MASK, INPUT_IDS, LOGITS, LOGITS_POSITIONS
from .int8_attention import BLOCK_TABLE

BINDINGS_KEPT = 64  # I/O bindings kept (least recently used dropped): decode uses one per batch size
_LOGITS_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
_KV_NUMPY = {"float32": np.float32, "float16": np.float16, "int8": np.int8}
# KV element types run on ONNX Runtime's CUDA GroupQueryAttention (its kernels: MLFloat16 and BFloat16; the factory
# builds no bfloat16 graph, and generation.json names no bfloat16 cache).
DEVICE_KV_TYPES = ("tensor(float16)",)


@dataclass(frozen=True)
class CudaPlacement:
    """Where a GPU instance's graph runs: its device and the instance's CUDA stream (an integer handle)."""

    device_id: int
    stream: int


def device_kv_problem(kv_input_types: dict[str, str], precision: str) -> str | None:
    """Why a graph with these KV inputs (name -> ONNX type) cannot run on ONNX Runtime's CUDA provider, else None."""
    bad = sorted({t for t in kv_input_types.values() if t not in DEVICE_KV_TYPES})
    if not bad:
        return None
    return (f"{precision}'s graph keeps its KV cache as {', '.join(bad)}: ONNX Runtime's CUDA attention "
            "(GroupQueryAttention) computes in float16 only, so its attention would run on the CPU and copy the "
            "cache every step. Serve the fp16 build on a GPU instance (repository.serve = \"fp16\", with fp16 "
            "among repository.precisions), or serve this precision on a CPU instance (repository.instance_kind = "
            "\"cpu\")")


def attention_kernel(setting: str, kv_dtype: str) -> str:
    """The ``int8_attention`` a CausalLM gets for a graph whose KV cache is ``kv_dtype``: the setting
    (contract.INT8_ATTENTION) for an INT8 cache, ONNX Runtime's own attention for any other."""
    return setting if kv_dtype == "int8" else "onnxruntime"


class CausalLM:
    """An ONNX Runtime session of a text-generation graph, run with I/O binding on the KV slots."""

    flavour = "onnxruntime"

    def __init__(self, source: Path | bytes, *, threads: int | None = None, spinning: bool = True,
                 pad_token_id: int = 0, cuda: CudaPlacement | None = None, precision: str = "this",
                 int8_attention: str = "onnxruntime", lora: Any = None, kv_block_tokens: int = 0,
                 int8_matmul: str = "auto") -> None:
        """``int8_attention`` (contract.INT8_ATTENTION), for a graph whose KV cache is INT8 on the CPU: ``auto`` runs
        its attention on the factory's kernel where it builds (``int8_attention.py``; else as packaged, the reason
        in :attr:`attention`), ``kernel`` requires it, ``onnxruntime`` runs the graph as packaged. ``lora``: a
        ``lora.LoraGraph`` (this graph with its adapters' inputs) run instead; the loader sets :attr:`lora_table` and
        each launch adds its rows' adapters (``adapters``: a slot per row, 0 the base). ``kv_block_tokens`` > 0
        (``kv_layout = "blocks"``): the kernel's paged layout, its pools and block table bound from ``kv_pool``'s
        views; :attr:`kv_block_tokens` says whether it is in use (0 where the kernel is not: the slots then).
        ``int8_matmul`` (contract.INT8_MATMUL): the graph's INT8 MatMuls (``int8_matmul``) on the factory's
        operators, on the CPU: ``auto`` where they build (else as packaged, the reason in :attr:`matmul`), ``kernel``
        required, ``onnxruntime`` as packaged."""
        from ..engines.onnxruntime import _cpu_session, cuda_session, import_onnxruntime

        ort = import_onnxruntime()
        self.lora_table: Any = None  # lora.AdapterTable, set by the loader when ``lora`` rewrote the graph
        self.lora_shapes = dict(lora.shapes) if lora is not None else {}
        self.lora_ranks = dict(getattr(lora, "ranks", {}) or {}) if lora is not None else {}
        if lora is not None:
            source = lora.model
        # Which kernel computes attention, and why (logged at load).
        self.attention = "onnxruntime GroupQueryAttention"
        self.matmul = ""  # the INT8 MatMuls' kernels, where the graph has MatMulInteger (logged at load)
        self.kv_block_tokens = 0  # the paged layout's block when the graph reads one (kv_pool), else 0
        if cuda is not None:
            self.device, self._device_type, self._device_id = f"cuda:{cuda.device_id}", "cuda", int(cuda.device_id)
            self.session = cuda_session(ort, source, cuda.device_id, cuda.stream)
            kv_types = {i.name: i.type for i in self.session.get_inputs() if i.name.startswith("past_key_values")}
            problem = device_kv_problem(kv_types, precision)
            if problem:
                self.session = None
                from ..engines.base import EngineError

                raise EngineError(problem)
        else:
            self.device, self._device_type, self._device_id = "cpu", "cpu", 0

            def options() -> Any:
                opts = ort.SessionOptions()
                opts.log_severity_level = 4  # errors arrive as exceptions
                if threads:
                    opts.intra_op_num_threads = int(threads)
                if not spinning:
                    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
                if lora is not None and lora.weights_folder is not None:
                    opts.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                                  str(lora.weights_folder))
                return opts

            def session(graph: Path | bytes, opts: Any) -> Any:
                # Inside a quiet start a session's pool keeps the normal priority, its initialization the quiet
                # thread's.
                return _cpu_session(ort, graph if isinstance(graph, bytes) else str(graph), opts)

            opts = options()
            kernel_graph = source
            if int8_attention != "onnxruntime":
                kernel_graph = self._with_int8_attention(source, opts, required=int8_attention == "kernel",
                                                         block_tokens=kv_block_tokens)
            if int8_matmul != "onnxruntime":
                folder = lora.weights_folder if lora is not None else (
                    None if isinstance(source, (bytes, bytearray)) else Path(source).resolve().parent)
                kernel_graph = self._with_int8_matmul(kernel_graph, opts, folder, required=int8_matmul == "kernel")
            try:
                self.session = session(kernel_graph, opts)
            except Exception as e:  # noqa: BLE001 - the kernel's session failed: "auto" keeps the packaged graph
                if kernel_graph is source or "kernel" in (int8_attention, int8_matmul):
                    raise
                self.attention = ("onnxruntime GroupQueryAttention (the INT8-cache kernel is not used: a session on "
                                  f"it failed: {str(e).splitlines()[0][:300]})")
                if self.matmul:
                    self.matmul = "onnxruntime (the factory's kernels are not used: the session on them failed)"
                self.kv_block_tokens = 0
                self.session = session(source, options())
        self.input_names = tuple(i.name for i in self.session.get_inputs())
        self.output_names = tuple(o.name for o in self.session.get_outputs())
        self.pad = int(pad_token_id)
        self.selects_positions = LOGITS_POSITIONS in self.input_names
        logits = next(o for o in self.session.get_outputs() if o.name == LOGITS) if LOGITS in self.output_names else None
        vocab = logits.shape[-1] if logits is not None and logits.shape else None
        # Bindings are kept only where the logits' shape is known from the rows alone: [rows, 1, vocab].
        self._logits_dtype = _LOGITS_DTYPES.get(logits.type) if logits is not None else None
        self._vocab = vocab if isinstance(vocab, int) and self.selects_positions and self._logits_dtype else None
        self._bindings: OrderedDict[int, tuple[dict, Any]] = OrderedDict()
        for needed in (INPUT_IDS, ATTENTION_MASK):
            if needed not in self.input_names:
                raise ValueError(f"the graph has no input {needed!r}: it is not a text-generation graph of the "
                                 "shared-slots layout (rebuild the model with this model-factory)")

    def _with_int8_attention(self, source: Path | bytes, opts: Any, required: bool,
                             block_tokens: int = 0) -> Path | bytes:
        """``source`` with its INT8-cache attention on the factory's kernel (library registered in ``opts``), or
        unchanged with the reason in :attr:`attention`; ``required``: the reason raised instead (EngineError);
        ``block_tokens``: the paged layout (sets :attr:`kv_block_tokens`)."""
        from .int8_attention import KernelUnavailable, prepare, register

        try:
            prepared = prepare(source, block_size=block_tokens)
            register(prepared, opts)
        except KernelUnavailable as e:
            if required:
                from ..engines.base import EngineError

                raise EngineError(f"int8_attention = \"kernel\" but the kernel cannot be used: {e}. Where it cannot "
                                  "be, set int8_attention = \"auto\" (ONNX Runtime's attention then)") from e
            self.attention = f"onnxruntime GroupQueryAttention (the INT8-cache kernel is not used: {e})"
            return source
        self.attention = f"model-factory Int8KVAttention ({prepared.nodes} nodes, {prepared.library.name})"
        if block_tokens:
            self.kv_block_tokens = int(block_tokens)
            self.attention += f", the KV cache in blocks of {block_tokens} tokens"
        return prepared.model

    def _with_int8_matmul(self, graph: Path | bytes, opts: Any, folder: Path | None, required: bool) -> Path | bytes:
        """``graph`` with its INT8 MatMuls on the factory's operators (library registered in ``opts``), or unchanged
        (none there, or the reason in :attr:`matmul`); ``required``: the reason raised (EngineError)."""
        from .int8_matmul import prepare

        try:
            prepared = prepare(graph, folder)
            if prepared is None:
                return graph
            opts.register_custom_ops_library(str(prepared.library))
        except Exception as e:  # noqa: BLE001 - KernelUnavailable, ONNX Runtime refusing the library: "auto" goes on
            if required:
                from ..engines.base import EngineError

                raise EngineError(f"int8_matmul = \"kernel\" but the kernel cannot be used: {e}. Where it cannot be, "
                                  "set int8_matmul = \"auto\" (the graph's standard ops then)") from e
            self.matmul = f"onnxruntime (the INT8 MatMul kernels are not used: {e})"
            return graph
        if folder is not None:
            opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
        self.matmul = (f"model-factory Int8MatMulToFloat ({prepared.chains} nodes) and RowInt8MatMul "
                       f"({prepared.nodes} nodes), {prepared.library.name}"
                       + (f", AMX tiles from {prepared.tile_rows} rows" if prepared.tile_rows else ""))
        return prepared.model

    def _run(self, ids: np.ndarray, mask: np.ndarray, views: dict[str, Any],
             positions: np.ndarray, adapters: Sequence[int] | None = None) -> np.ndarray:
        """Logits ``[n, k, vocab]`` (float32) at ``positions [n, k]`` (indices into each row's new tokens);
        ``adapters``: each row's adapter slot (0 or None: the base)."""
        logits = self._logits(ids, mask, views, positions, adapters)
        # An FP16 graph's logits are sampled in float32 (softmax, penalties and top-p over a 16-bit vocabulary lose
        # what the sampler compares).
        return logits if logits.dtype == np.float32 else logits.astype(np.float32)

    def _logits(self, ids: np.ndarray, mask: np.ndarray, views: dict[str, Any],
                positions: np.ndarray, adapters: Sequence[int] | None = None) -> np.ndarray:
        kept = self._kept_binding(views) if positions.shape[1] == 1 and self._vocab is not None else None
        io = kept if kept is not None else self._new_binding(views)
        io.bind_cpu_input(INPUT_IDS, ids)
        io.bind_cpu_input(ATTENTION_MASK, mask)
        if self.selects_positions:
            io.bind_cpu_input(LOGITS_POSITIONS, np.ascontiguousarray(positions, dtype=np.int64))
        if self.lora_table is not None:
            self.lora_table.bind(io, np.zeros(ids.shape[0], np.int64) if adapters is None else np.asarray(adapters))
        elif adapters is not None and any(adapters):
            raise ValueError("a row names an adapter but this graph was loaded without adapters")
        if kept is not None:  # a new array each step (rebinding a name replaces it): callers may keep logits
            logits = np.empty((ids.shape[0], 1, self._vocab), dtype=self._logits_dtype)
            io.bind_output(LOGITS, "cpu", 0, logits.dtype.type, list(logits.shape), logits.ctypes.data)
            self.session.run_with_iobinding(io)
            return logits
        self.session.run_with_iobinding(io)
        # Only the logits are read: copy_outputs_to_cpu() would also copy every KV buffer (the presents).
        logits = io.get_outputs()[0].numpy()
        if self.selects_positions:
            return logits
        return np.take_along_axis(logits, np.asarray(positions, dtype=np.int64)[:, :, None], axis=1)

    def _new_binding(self, views: dict[str, Any]) -> Any:
        """A binding of the KV buffers (each past and its present on the same pointer) and of the logits where
        ONNX Runtime allocates them (bound first: get_outputs() returns outputs in binding order)."""
        io = self.session.io_binding()
        io.bind_output(LOGITS, "cpu")
        where, device_id = self._device_type, self._device_id
        for name, view in views.items():
            if name == BLOCK_TABLE:  # the paged layout's table rows (kv_pool): an input only, bound by pointer
                if not (isinstance(view, np.ndarray) and view.dtype == np.int32 and view.flags.c_contiguous):
                    raise ValueError(f"{name}: the block table must be contiguous int32 rows")
                io.bind_input(name, "cpu", 0, np.int32, list(view.shape), view.ctypes.data)
                continue
            if isinstance(view, np.ndarray):
                if where != "cpu":
                    raise ValueError(f"{name}: a host KV view given to a graph on {self.device}")
                if not view.flags.c_contiguous:  # a slice of the slot axis always is; anything else is a bug
                    raise ValueError(f"{name}: KV view is not contiguous")
                shape, ptr, dtype = list(view.shape), view.ctypes.data, view.dtype.type
            else:  # kv_device.DeviceView: contiguous by construction
                if where == "cpu":
                    raise ValueError(f"{name}: a device KV view given to a graph on the CPU")
                shape, ptr, dtype = list(view.shape), int(view.ptr), _KV_NUMPY[view.dtype]
            io.bind_input(name, where, device_id, dtype, shape, ptr)
            io.bind_output(name.replace("past_key_values", "present"), where, device_id, dtype, shape, ptr)
        return io

    def _kept_binding(self, views: dict[str, Any]) -> Any:
        """The kept binding of ``views``, made on first use (the least recently used dropped past
        ``BINDINGS_KEPT``). The entry holds ``views`` itself, so its id is not reused while kept."""
        entry = self._bindings.get(id(views))
        if entry is not None and entry[0] is views:
            self._bindings.move_to_end(id(views))
            return entry[1]
        io = self._new_binding(views)
        self._bindings[id(views)] = (views, io)
        self._bindings.move_to_end(id(views))
        while len(self._bindings) > BINDINGS_KEPT:
            self._bindings.popitem(last=False)
        return io

    def prefill(self, prompts: Sequence[Sequence[int]], views: dict[str, Any],
                past: Sequence[int] | None = None, adapters: Sequence[int] | None = None) -> np.ndarray:
        """Run new prompts (one per slot of ``views``, from an empty cache), right-padded to the longest;
        returns each row's last real position's logits ``[n, vocab]``. ``past``: the tokens already in each row's
        slot (a cached prefix): the prompt continues from there, its positions after them. ONNX Runtime's attention
        takes a continued prompt one row at a time."""
        if past is not None and any(past):
            if len(prompts) != 1:
                raise ValueError(f"a continued prompt runs alone, not in a launch of {len(prompts)}")
            row = np.asarray([list(prompts[0])], dtype=np.int64)
            mask = np.ones((1, int(past[0]) + row.shape[1]), dtype=np.int64)
            return self._run(row, mask, views, np.asarray([[row.shape[1] - 1]], dtype=np.int64), adapters)[:, 0]
        n = len(prompts)
        longest = max(len(p) for p in prompts)
        ids = np.full((n, longest), self.pad, dtype=np.int64)
        mask = np.zeros((n, longest), dtype=np.int64)
        for r, prompt in enumerate(prompts):
            ids[r, :len(prompt)] = prompt
            mask[r, :len(prompt)] = 1
        last = np.asarray([[len(p) - 1] for p in prompts], dtype=np.int64)
        return self._run(ids, mask, views, last, adapters)[:, 0]

    def continued_logits(self, tokens: Sequence[int], past: int, views: dict[str, Any],
                         adapters: Sequence[int] | None = None) -> np.ndarray:
        """One sequence's ``tokens`` continued after the ``past`` tokens its slot (one slot of ``views``) holds, as a
        continued prompt: the logits of every one of those positions ``[len(tokens), vocab]`` (speculative decoding
        verifies its drafted tokens with them). One row a launch, as ONNX Runtime's attention takes a continued prompt."""
        row = np.asarray([list(tokens)], dtype=np.int64)
        mask = np.ones((1, int(past) + row.shape[1]), dtype=np.int64)
        return self._run(row, mask, views, np.arange(row.shape[1], dtype=np.int64)[None, :], adapters)[0]

    def position_logits(self, ids: Sequence[int], views: dict[str, Any], adapter: int = 0) -> np.ndarray:
        """One sequence from an empty cache (one slot of ``views``): the logits of every position ``[len, vocab]``."""
        row = np.asarray([list(ids)], dtype=np.int64)
        return self._run(row, np.ones_like(row), views, np.arange(row.shape[1], dtype=np.int64)[None, :],
                         [adapter])[0]

    def decode(self, tokens: Sequence[int], lengths: Sequence[int], views: dict[str, Any],
               adapters: Sequence[int] | None = None) -> np.ndarray:
        """One new token per row, each row holding ``lengths[r]`` cached tokens; returns ``[n, vocab]``."""
        n = len(tokens)
        lengths = np.asarray(lengths, dtype=np.int64)
        ids = np.asarray(tokens, dtype=np.int64).reshape(n, 1)
        mask = (np.arange(int(lengths.max()) + 1)[None, :] <= lengths[:, None]).astype(np.int64)
        return self._run(ids, mask, views, np.zeros((n, 1), dtype=np.int64), adapters)[:, 0]

    def close(self) -> None:
        self._bindings.clear()
        self.session = None
