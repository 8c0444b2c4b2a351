"""The KV cache of a generative model on a GPU: slot buffers from the instance's pool, sized from cudaMemGetInfo.

The layout is the CPU's (``kv_slots``): one buffer ``[slots, kv_heads, max_context, head_dim]`` per layer and
kind, the active sequences on a contiguous prefix of the slots, a batched step binding one slice of every
buffer by pointer. What differs on a device:

* device memory is committed when it is allocated (there are no zero pages to fault in as tokens are
  written), so the buffers are allocated once, at load, from the instance's
  :class:`memory_pool.MemoryPool` (``cudaMallocFromPoolAsync``), and hold as many slots as the budget holds
  at full context;
* the budget is read from the device, the seed's formula: ``free - base``, where ``free`` is what
  ``cudaMemGetInfo`` reports at load and ``base`` what the instance keeps for everything else (the
  activations of its largest prefill launch, the growth of other instances on the device:
  ``reserve_bytes``). Sequences are then admitted while ``kv_bytes_per_token x (prompt + max_tokens)``,
  summed over the running sequences and the new one, fits what was allocated (the account
  ``kv_slots.KVSlots`` keeps, as on the CPU): nothing is launched that the cache cannot hold;
* compaction (a finished sequence's slot takes the last active slot's rows) is one ``cudaMemcpy2DAsync``
  per buffer, device to device, on the instance's stream: ``kv_heads`` rows of ``length x head_dim``
  elements, each row ``max_context x head_dim`` apart.

:class:`DeviceKVBuffers` is a storage of ``kv_slots.KVSlots`` (which keeps the account, as on the CPU): a
GPU instance of a text-generation model (``generate_model``, ONNX Runtime's CUDA provider) binds its views.
Tests marked ``gpu`` and ``benchmarks/gpu_checks.py`` check it on the first GPU lent. ``cuda.bindings`` is
imported when used (``memory_pool.cuda_runtime``), never at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..contract import KV_DTYPES, past_name
from .kv_slots import AdmissionError, SlotStorage
from ..memory.pool import check, require_device


@dataclass(frozen=True)
class DeviceView:
    """A contiguous slice of one device buffer, to bind by pointer (ONNX Runtime's I/O binding, DLPack)."""

    ptr: int
    shape: tuple[int, int, int, int]
    dtype: str  # contract.KV_DTYPES key


def device_memory(device: int = 0) -> tuple[int, int]:
    """``(free, total)`` bytes of ``device`` (``cudaMemGetInfo``); CudaError without CUDA or that device."""
    rt = require_device(device)
    check(rt, rt.cudaSetDevice(device), f"cudaSetDevice({device})")
    free, total = check(rt, rt.cudaMemGetInfo(), "cudaMemGetInfo")
    return int(free), int(total)


def kv_budget_from_device(free_bytes: int, reserve_bytes: int) -> int:
    """The KV cache's share of a device: ``free - base`` (the seed's formula), or AdmissionError when the
    reserve leaves nothing."""
    budget = int(free_bytes) - int(reserve_bytes)
    if budget <= 0:
        raise AdmissionError(f"the device has {int(free_bytes)} bytes free and {int(reserve_bytes)} are kept for "
                             "activations and other instances: no room for a KV cache (lower the reserve, or "
                             "serve the model on a device with more free memory)")
    return budget


def slot_bytes(spec: Any, max_context: int | None = None) -> int:
    """Device bytes one slot holds at full context, every layer, keys and values."""
    context = int(max_context or spec.max_context)
    return 2 * spec.num_layers * spec.num_kv_heads * context * spec.head_dim * KV_DTYPES[spec.kv_dtype]


def device_slots(spec: Any, budget_bytes: int, wanted: int, max_context: int | None = None) -> int:
    """How many slots to allocate: ``wanted`` (max_active_sequences), or fewer when the budget holds fewer at
    full context; AdmissionError when it does not hold one."""
    fit = int(budget_bytes) // slot_bytes(spec, max_context)
    if fit < 1:
        raise AdmissionError(f"a KV budget of {int(budget_bytes)} bytes cannot hold one sequence at full context "
                             f"({slot_bytes(spec, max_context)} bytes): lower max_context or free device memory")
    return max(1, min(int(wanted), fit))


class DeviceKVBuffers(SlotStorage):
    """Per-layer KV buffers in device memory from ``pool``, with views by slot and device-side compaction (a
    storage of ``kv_slots.KVSlots``)."""

    granule_bytes = 1  # committed when allocated: a token's bytes are its bytes

    def __init__(self, spec: Any, slots: int, pool: Any, stream: Any = 0, max_context: int | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots={slots} must be at least 1")
        from ..memory.pool import cuda_runtime

        self._rt = cuda_runtime()
        self.spec, self.slots, self.pool, self.stream = spec, int(slots), pool, stream
        self.max_context = int(max_context or spec.max_context)
        self.itemsize = KV_DTYPES[spec.kv_dtype]
        self.row_bytes = self.max_context * spec.head_dim * self.itemsize  # one head of one slot
        self.slot_bytes = spec.num_kv_heads * self.row_bytes  # one slot of one buffer
        self.names = tuple(past_name(layer, kind) for layer in range(spec.num_layers) for kind in ("key", "value"))
        self.buffers: dict[str, int] = {}
        self._views: dict[tuple[int, int], dict[str, DeviceView]] = {}
        try:
            for name in self.names:
                self.buffers[name] = pool.allocate(self.slots * self.slot_bytes, stream)
                # Zeroed as the CPU's buffers are: a slot never shows an earlier sequence's keys.
                check(self._rt, self._rt.cudaMemsetAsync(self.buffers[name], 0, self.slots * self.slot_bytes,
                                                         stream), "cudaMemsetAsync")
        except BaseException:
            self.close()
            raise

    @property
    def nbytes(self) -> int:
        """Device bytes the buffers hold."""
        return len(self.names) * self.slots * self.slot_bytes

    def views(self, start: int, count: int) -> dict[str, DeviceView]:
        """Every buffer's slots ``[start, start + count)``, contiguous."""
        if start < 0 or count < 1 or start + count > self.slots:
            raise IndexError(f"slots [{start}, {start + count}) are outside [0, {self.slots})")
        got = self._views.get((start, count))
        if got is None:  # the same object for the same slice: the engine keeps its binding of it (causal_lm)
            shape = (count, self.spec.num_kv_heads, self.max_context, self.spec.head_dim)
            got = self._views[(start, count)] = {
                name: DeviceView(ptr + start * self.slot_bytes, shape, self.spec.kv_dtype)
                for name, ptr in self.buffers.items()}
        return got

    def move(self, dst: int, src: int, length: int) -> None:
        """Queue the copy of slot ``src``'s first ``length`` tokens into slot ``dst`` (every buffer, every head)
        on the stream: what ``KVSlots.release`` does on the CPU."""
        if not (0 <= dst < self.slots and 0 <= src < self.slots):
            raise IndexError(f"slots {dst} and {src} must be in [0, {self.slots})")
        if length <= 0 or dst == src:
            return
        width = min(int(length), self.max_context) * self.spec.head_dim * self.itemsize
        kind = self._rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        for ptr in self.buffers.values():
            check(self._rt, self._rt.cudaMemcpy2DAsync(ptr + dst * self.slot_bytes, self.row_bytes,
                                                       ptr + src * self.slot_bytes, self.row_bytes, width,
                                                       self.spec.num_kv_heads, kind, self.stream),
                  "cudaMemcpy2DAsync (KV compaction)")

    def give_back(self, slot: int) -> None:
        """Nothing to return: device memory stays allocated for the next sequence of the slot."""

    def close(self) -> None:
        """Give the buffers back to the pool (in stream order)."""
        self._views.clear()
        buffers, self.buffers = self.buffers, {}
        for ptr in buffers.values():
            self.pool.free(ptr, self.stream)
