"""The KV cache as a block pool with a table per sequence (generation/kv_pool.py, ``kv_layout = "blocks"``): blocks
taken in order, shared prefixes held once and reference counted, a shared block never written, compaction handing
blocks over; and the scheduler on an INT8-cache graph gives the slot layout's tokens through admission, compaction,
prefix-cache hits and a request's sibling choices."""

from __future__ import annotations

import dataclasses
import os
import random
import shutil

import numpy as np
import pytest

from model_factory.backend.contract import GenerationSpec
from model_factory.backend.generation import int8_attention as ia
from model_factory.backend.generation.kv_pool import BlockKVBuffers, kv_storage, layout_block_tokens, layout_note
from model_factory.backend.generation.kv_slots import KeptKV, KVSlots
from model_factory.backend.generation.prefix_cache import BLOCK_TOKENS, PrefixCache, identity
from model_factory.backend.generation.sampling import SamplingParams, choice_seed
from model_factory.backend.generation.scheduler import Generation, Scheduler



def _spec() -> GenerationSpec:
    return GenerationSpec(family="llama", num_layers=1, num_attention_heads=2, num_kv_heads=1, head_dim=4,
                          hidden_size=8, vocab_size=100, max_context=64, eos_token_ids=(1,), kv_dtype="int8")


def _fill(pool: BlockKVBuffers, slot: int, value: int) -> None:
    for buf in pool.buffers.values():
        buf[list(pool.blocks(slot))] = value


def test_blocks_are_taken_lowest_first_and_a_table_row_names_them() -> None:
    pool = BlockKVBuffers(_spec(), 3, 64, 16)
    assert (pool.num_blocks, pool.max_blocks) == (12, 4)
    pool.claim(0, 20)
    pool.claim(1, 1)
    assert pool.blocks(0) == (0, 1) and pool.blocks(1) == (2,)
    pool.claim(0, 33, keep=True)  # growing: the blocks it holds stay
    assert pool.blocks(0) == (0, 1, 3)
    assert pool.table[0].tolist() == [0, 1, 3, 0] and pool.blocks_in_use == 4
    views = pool.views(0, 2)
    assert views is pool.views(0, 2)  # the same object: the engine keeps its binding
    assert views[ia.BLOCK_TABLE].tolist() == [[0, 1, 3, 0], [2, 0, 0, 0]]
    assert all(views[name] is pool.buffers[name] for name in pool.names)
    pool.give_back(0)
    assert pool.blocks_in_use == 1 and pool.table[0].tolist() == [0, 0, 0, 0]
    pool.claim(2, 40)
    assert pool.blocks(2) == (0, 1, 3)  # the freed ones again, lowest first
    with pytest.raises(ValueError, match="more than a slot's 64"):
        pool.claim(1, 65)


def test_a_copy_shares_the_full_blocks_and_copies_the_last_partly_filled_one() -> None:
    pool = BlockKVBuffers(_spec(), 3, 64, 16)
    pool.claim(0, 40)  # blocks 0, 1, 2: 40 tokens written, block 2 partly
    _fill(pool, 0, 7)
    pool.claim(1, 48)  # the destination's own reservation: 3 blocks
    own = pool.blocks(1)
    pool.move(1, 0, 40)
    shared = pool.blocks(1)
    assert shared[:2] == (0, 1) and shared[2] not in (0, 1, 2) and pool.references(0) == pool.references(1) == 2
    assert pool.references(2) == 1  # the partly filled block: copied, not shared
    for buf in pool.buffers.values():
        assert np.array_equal(buf[shared[2]], buf[2])
    assert pool.blocks_in_use == 4  # 3 of slot 0 and the copy: one copy of the shared prefix in memory
    assert own[0] not in shared and own[1] not in shared  # the destination's replaced blocks went back
    pool.give_back(0)  # the source ends: the shared blocks stay for the copy
    assert pool.references(0) == 1 and pool.blocks_in_use == 3
    pool.give_back(1)
    assert pool.blocks_in_use == 0


def test_a_kept_prefix_taken_over_in_place_writes_only_blocks_of_its_own() -> None:
    pool = BlockKVBuffers(_spec(), 3, 64, 16)
    pool.claim(0, 32)
    _fill(pool, 0, 3)
    pool.move(1, 0, 32)  # another sequence shares both blocks
    pool.claim(0, 48, keep=True, private=True)  # a new sequence takes the kept slot 0 over, writing from the hit on
    assert set(pool.blocks(0)).isdisjoint(pool.blocks(1)[:2])
    assert pool.references(pool.blocks(1)[0]) == 1
    for buf in pool.buffers.values():
        assert np.array_equal(buf[list(pool.blocks(0)[:2])], buf[list(pool.blocks(1)[:2])])


def test_the_account_over_a_pool_compacts_by_handing_blocks_over() -> None:
    spec = _spec()
    pool = BlockKVBuffers(spec, 3, 64, 16)
    slots = KVSlots(spec, 3, 1 << 20, storage=pool, block_tokens=16)
    a, b, c = (slots.admit(n) for n in (20, 40, 10))
    held_c = pool.blocks(c)
    assert [len(pool.blocks(s)) for s in (a, b, c)] == [2, 3, 1]
    assert slots.release(a) == c  # the last sequence moves into slot 0: its blocks, not a copy
    assert pool.blocks(0) == held_c and pool.blocks(2) == () and pool.blocks_in_use == 4
    assert slots.grow(0, 17) and len(pool.blocks(0)) == 2  # growing takes a block
    keep = KeptKV(tokens=16)
    slots.release(0, keep=keep)  # kept in a free slot: the full block shared, then the sequence's let go
    assert keep.slot == 2 and pool.blocks(2) == held_c and pool.references(held_c[0]) == 1
    slots.drop(keep)
    assert pool.blocks_in_use == 3  # slot 0 now holds b's blocks
    slots.clear()
    assert pool.blocks_in_use == 0


def test_the_layout_setting_and_its_load_note() -> None:
    assert layout_block_tokens("blocks") == BLOCK_TOKENS and layout_block_tokens("slots") == 0

    class Model:
        kv_block_tokens = 0

    assert kv_storage(Model(), _spec(), 2) is None
    note = layout_note("blocks", Model())
    assert "kv_layout = \"blocks\" needs an INT8 cache whose attention runs on the factory's kernel" in note
    assert layout_note("slots", Model()) == ""
    Model.kv_block_tokens = 16
    assert isinstance(kv_storage(Model(), _spec(), 2), BlockKVBuffers)
    assert "pool of 16-token blocks" in layout_note("blocks", Model())


# --------------------------------------------------------------------------- the scheduler on a real graph

needs_kernel = pytest.mark.skipif(
    not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")) or "avx2" not in ia._cpu_flags().split(),
    reason="no C++ compiler or no AVX2: the kernel (and so the block layout) is not used here")
GREEDY = SamplingParams(max_tokens=10, min_tokens=10)


@pytest.fixture(scope="module")
def layouts(tiny_llm, tiny_llm_int8_cache):
    """(spec, the INT8-cache graph on the kernel over slots, the same over a block pool): tiny_llm's FP32 graph with
    its KV cache in INT8 (FP32 weights: batch-independent, so every layout's greedy tokens can be compared)."""
    from model_factory.backend.generation.causal_lm import CausalLM
    from tests.generative_repository import generation_spec

    hf, _ = tiny_llm
    spec = dataclasses.replace(generation_spec(hf, {}), kv_dtype="int8", max_context=256)
    slots = CausalLM(tiny_llm_int8_cache, threads=1, int8_attention="kernel")
    blocks = CausalLM(tiny_llm_int8_cache, threads=1, int8_attention="kernel", kv_block_tokens=BLOCK_TOKENS)
    assert slots.kv_block_tokens == 0 and blocks.kv_block_tokens == BLOCK_TOKENS
    assert "the KV cache in blocks of 16 tokens" in blocks.attention
    return spec, slots, blocks


def _scheduler(spec, model, slots: int, budget: int, **kw) -> Scheduler:
    return Scheduler(model, KVSlots(spec, slots, budget, storage=kv_storage(model, spec, slots), block_tokens=16),
                     None, spec.eos_token_ids, max_waiting=64, **kw)


def _workload(spec, model) -> tuple[list[list[int]], BlockKVBuffers | None, int]:
    """Mixed prompts over 6 slots (admission waits, slots compact), a document asked three questions one at a
    time and then together while a holder runs (prefix-cache hits: kept and running holders), and a request of 3
    choices sharing one prefill; returns every sequence's tokens, the storage and the most blocks shared at once."""
    rng = random.Random(5)
    one = KVSlots(spec, 1, 1 << 30).bytes_for(80)
    sched = _scheduler(spec, model, 6, 5 * one, prefix_cache=PrefixCache(identity(graph="kv-pool")))
    pool = sched.slots.storage if isinstance(sched.slots.storage, BlockKVBuffers) else None
    out, shared = [], 0

    def run(gens):
        nonlocal shared
        while sched.has_work():
            sched.step()
            if pool is not None:
                shared = max(shared, int((pool._refs > 1).sum()))
        out.extend(g.generated for g in gens)

    mixed = [Generation([rng.randrange(3, spec.vocab_size) for _ in range(rng.randrange(1, 40))],
                        SamplingParams(max_tokens=n, min_tokens=n), lambda g, e: None)
             for n in (rng.randrange(1, 20) for _ in range(12))]
    run([sched.submit(g) for g in mixed])
    document = [rng.randrange(3, spec.vocab_size) for _ in range(70)]
    questions = [[rng.randrange(3, spec.vocab_size) for _ in range(rng.randrange(1, 9))] for _ in range(3)]
    for q in questions:
        run([sched.submit(Generation(document + q, GREEDY, lambda g, e: None))])
    holder = sched.submit(Generation(document + [9], SamplingParams(max_tokens=30, min_tokens=30), lambda g, e: None))
    sched.step()
    together = [sched.submit(Generation(document + q, GREEDY, lambda g, e: None)) for q in questions]
    run([holder, *together])
    assert all(g.prefix_hit == 64 for g in together)
    seeded = SamplingParams(max_tokens=10, min_tokens=10, temperature=0.9, top_k=40, seed=7)
    choices = []
    for i in range(3):
        choices.append(Generation([11, 12, 13] * 7, dataclasses.replace(seeded, seed=choice_seed(7, i)),
                                  lambda g, e: None, index=i, leader=choices[0] if choices else None))
    run(sched.submit_all(choices))
    return out, pool, shared


@needs_kernel
def test_the_scheduler_gives_the_slot_layouts_tokens_over_a_block_pool(layouts) -> None:
    spec, on_slots, on_blocks = layouts
    want, none, _ = _workload(spec, on_slots)
    got, pool, shared = _workload(spec, on_blocks)
    assert none is None and pool is not None
    assert got == want
    assert shared >= 4  # the document's 4 blocks held once by the hits beside their holder
    held = {b for s in range(pool.slots) for b in pool.blocks(s)}
    assert pool.blocks_in_use == len(held)  # every block in use is held by a slot: none leaked


@needs_kernel
def test_the_prefill_cost_is_measured_in_blocks_of_each_rows_own_and_leaves_the_pool_empty(layouts) -> None:
    from model_factory.backend.generation.prefill_cost import measure_cost

    spec, _, on_blocks = layouts
    slots = KVSlots(spec, 4, 1 << 30, storage=kv_storage(on_blocks, spec, 4), block_tokens=16)
    taken = []
    claim = slots.storage.claim
    slots.storage.claim = lambda slot, tokens, **kw: (taken.append((slot, tokens)), claim(slot, tokens, **kw))[1]
    cost = measure_cost(on_blocks, slots, 64)
    assert hasattr(cost, "a") and taken and {slot for slot, _ in taken} == set(range(4))
    assert slots.storage.blocks_in_use == 0 and slots.active == 0
