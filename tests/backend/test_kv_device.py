"""The KV cache on a GPU (``kv_device``): the budget from the device's free memory, the slots it holds, and the
buffers in the pool with device-side compaction.

The sizing runs anywhere; tests marked ``gpu`` need a CUDA device and skip without one (they run in
``benchmarks/gpu_checks.sh``, with ``gpu_checks.py``'s check of the same module).
"""

from __future__ import annotations

import pytest

from model_factory.backend.contract import GenerationSpec
from model_factory.backend.generation.kv_device import (DeviceKVBuffers, device_memory, device_slots, kv_budget_from_device,
                                             slot_bytes)
from model_factory.backend.generation.kv_slots import AdmissionError
from model_factory.backend.memory.pool import CudaError, MemoryPool, cuda_device_count

SPEC = GenerationSpec(family="llama", num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64,
                      vocab_size=100, max_context=64, eos_token_ids=(2,))


def test_the_budget_is_free_memory_less_the_reserve():
    assert kv_budget_from_device(10 << 30, 2 << 30) == 8 << 30
    with pytest.raises(AdmissionError, match="no room for a KV cache"):
        kv_budget_from_device(1 << 30, 1 << 30)


def test_slots_are_what_the_budget_holds_at_full_context():
    one = slot_bytes(SPEC)
    assert one == 2 * 2 * 2 * 64 * 16 * 4 == SPEC.kv_bytes_per_token * SPEC.max_context
    assert slot_bytes(SPEC, max_context=32) == one // 2
    assert device_slots(SPEC, 100 * one, wanted=32) == 32  # the configured slots when they fit
    assert device_slots(SPEC, 5 * one + one // 2, wanted=32) == 5  # fewer when the budget holds fewer
    assert device_slots(SPEC, 5 * one, wanted=32, max_context=32) == 10
    with pytest.raises(AdmissionError, match="cannot hold one sequence"):
        device_slots(SPEC, one - 1, wanted=4)


@pytest.mark.skipif(cuda_device_count() > 0, reason="checks the error seen without a GPU")
def test_without_a_gpu_reading_the_device_is_a_clear_error():
    with pytest.raises(CudaError):
        device_memory(0)


@pytest.mark.gpu
def test_buffers_from_the_pool_compaction_on_the_device(cuda_device):
    import numpy as np
    from cuda.bindings import runtime as rt

    from model_factory.backend.memory.pool import check

    free_before, total = device_memory(cuda_device)
    assert 0 < free_before <= total
    stream = check(rt, rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "stream")
    with MemoryPool(cuda_device) as pool:
        slots = device_slots(SPEC, kv_budget_from_device(free_before, 1 << 30), wanted=4)
        kv = DeviceKVBuffers(SPEC, slots, pool, stream)
        assert slots == 4 and kv.nbytes == 4 * slot_bytes(SPEC) and pool.stats().used >= kv.nbytes
        name = kv.names[-1]
        shape = (SPEC.num_kv_heads, SPEC.max_context, SPEC.head_dim)
        pattern = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1
        view = kv.views(3, 1)[name]
        assert view.shape == (1, 2, 64, 16) and view.ptr == kv.buffers[name] + 3 * kv.slot_bytes
        h2d, d2h = rt.cudaMemcpyKind.cudaMemcpyHostToDevice, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        check(rt, rt.cudaMemcpyAsync(view.ptr, pattern.ctypes.data, pattern.nbytes, h2d, stream), "H2D")
        kv.move(1, 3, length=10)  # slot 3's first 10 tokens of each head into slot 1
        back = np.full(shape, -1.0, dtype=np.float32)
        check(rt, rt.cudaMemcpyAsync(back.ctypes.data, kv.views(1, 1)[name].ptr, back.nbytes, d2h, stream), "D2H")
        check(rt, rt.cudaStreamSynchronize(stream), "sync")
        np.testing.assert_array_equal(back[:, :10], pattern[:, :10])
        assert not back[:, 10:].any()  # the rest of the slot untouched: zeros from allocation
        kv.close()
        check(rt, rt.cudaStreamSynchronize(stream), "sync")
        assert pool.live_allocations == 0
    check(rt, rt.cudaStreamDestroy(stream), "stream destroy")
