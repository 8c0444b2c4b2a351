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
from model_factory.backend.generation.kv_slots import HostKVBuffers, KeptKV, KVSlots
from model_factory.backend.generation.prefix_cache import BLOCK_TOKENS, CachedPrefix, PrefixCache, chain, identity
from model_factory.backend.generation.sampling import SamplingParams, choice_seed
from model_factory.backend.generation.scheduler import Generation, Scheduler
from model_factory.backend.generation.sequence import NullMetrics
from tests.generative_repository import run_to_end


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
    # The destination's replaced blocks went back before the copy was taken (the pool never holds more than before
    # and after): the copy is the lowest of them.
    assert shared[2] == own[0] and own[1] not in shared
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


def _exact(storage):
    """``storage`` counted exactly (a granule of one byte: the tiny spec's page would hold 1,024 tokens a head row and
    hide the blocks), so slots and a pool count a sequence of whole blocks alike."""
    storage.granule_bytes = 1
    return storage


def _account(blocks: bool, slots: int, budget_blocks: int) -> KVSlots:
    """Paged admission over a pool (``blocks``) or the slots' buffers, with a budget of ``budget_blocks`` blocks."""
    spec = _spec()
    storage = _exact(BlockKVBuffers(spec, slots, 64, 16) if blocks else HostKVBuffers(spec, slots, 64))
    kv = KVSlots(spec, slots, budget_blocks * 2 * 16 * 4, storage=storage, block_tokens=16)
    assert kv.bytes_for(16) == 128 and kv.budget_bytes == budget_blocks * 128  # a pool of exact pages: nothing off
    return kv


def test_a_shared_prefix_is_counted_once_in_a_pool_and_once_per_holder_in_slots() -> None:
    """A budget of 3 sequences of 48 tokens (9 blocks): in slots a holder and 2 sequences copying its 32-token prefix
    fill it; in a pool the holder and 6 sharing it (each adding its one block of its own) fit, the budget still bounds
    the blocks in use and the memory under the highest block taken."""
    admitted = {}
    for blocks in (False, True):
        kv = _account(blocks, 8, 9)
        assert kv.shared_tokens(40) == (32 if blocks else 0)  # a pool shares full blocks; a slot's copy is a copy
        assert kv.admission_bytes(48, shared=40) == kv.admission_bytes(48, shared=32)
        holder = kv.admit(48)
        while kv.can_admit(48, shared=32):
            kv.admit(48, source=(holder, 32))
            assert kv.held_bytes() <= kv.budget_bytes
        admitted[blocks] = kv.active
        if blocks:
            pool = kv.storage
            assert all(pool.blocks(s)[:2] == pool.blocks(holder)[:2] for s in range(kv.active))
            assert pool.references(pool.blocks(holder)[0]) == kv.active
            assert kv.held_bytes() == pool.blocks_in_use * 128 == 9 * 128
            highest = max(b for s in range(kv.active) for b in pool.blocks(s))
            assert (highest + 1) * 128 <= kv.budget_bytes  # lowest first: the pool's memory stays under the budget
            usage = kv.usage()
            assert usage.reserved_bytes == 9 * 128 and usage.blocks_used == 9 and usage.blocks_free == 0
            assert usage.reserved_tokens == 7 * 48  # the tokens each holder reserves: shared ones once per holder
            assert kv.free == 1 and not kv.can_admit(48, shared=32)  # a slot is free, the memory is not
            assert kv.can_admit(32, shared=32)  # one holding only the shared blocks adds none
    assert admitted == {False: 3, True: 7}


def test_a_holder_ending_or_preempted_frees_only_the_blocks_no_one_else_holds() -> None:
    kv = _account(True, 4, 100)
    pool = kv.storage
    holder = kv.admit(48)
    _fill(pool, holder, 5)
    shared = pool.blocks(holder)[:2]
    a = kv.admit(48, source=(holder, 32))
    b = kv.admit(40, source=(holder, 32))
    assert kv.held_bytes() == (3 + 1 + 1) * 128
    assert kv.release(holder) == b  # the holder ends (or is preempted: released, nothing kept); b moves into slot 0
    assert kv.held_bytes() == (1 + 1 + 2) * 128  # its third block went back, the two it shared stay
    assert pool.blocks(0)[:2] == shared == pool.blocks(a)[:2] and [pool.references(x) for x in shared] == [2, 2]
    for buf in pool.buffers.values():
        assert (buf[list(shared)] == 5).all()  # unwritten: still the holder's keys and values
    kv.release(a)
    assert kv.held_bytes() == 3 * 128 and [pool.references(x) for x in shared] == [1, 1]
    kv.release(0)
    assert kv.held_bytes() == 0 and pool.blocks_in_use == 0


def test_what_releasing_a_slot_frees_is_what_the_account_loses_when_it_goes() -> None:
    """``KVSlots.freed_by_release``: in a pool the blocks no other slot or kept prefix holds (a holder whose prefix
    others share, its own block; a sequence holding only shared blocks, nothing; one sharing a kept prefix, its own
    block), in slots the whole reservation; each time what ``held_bytes`` loses when the slot is released."""
    for blocks in (False, True):
        kv = _account(blocks, 6, 100)
        holder = kv.admit(48)
        a = kv.admit(48, source=(holder, 32))
        b = kv.admit(32, source=(holder, 32))  # in a pool both its blocks the holder's
        kept = KeptKV(tokens=32)
        kv.release(kv.admit(40), keep=kept)  # a finished sequence's 32 tokens kept (2 blocks)
        d = kv.admit(40, source=(kept.slot, 32))
        freed = [kv.freed_by_release(s) // 128 for s in (holder, a, b, d)]
        assert freed == ([1, 1, 0, 1] if blocks else [3, 3, 2, 3])
        for slot in reversed(range(kv.active)):  # the last first: none moves, each freed as it stands then
            before, frees = kv.held_bytes(), kv.freed_by_release(slot)
            kv.release(slot)
            assert kv.held_bytes() == before - frees
        assert kv.held_bytes() == kv.freed_by_drop(kept) == 2 * 128
        with pytest.raises(IndexError):
            kv.freed_by_release(0)


def test_dropping_a_kept_prefix_frees_only_its_unshared_blocks_and_one_that_frees_nothing_stays() -> None:
    """A finished sequence's 40 tokens kept (3 blocks, its reservation's 4th let go), a running sequence sharing its
    first two, and a kept 32-token prefix whose two blocks a running sequence shares: under pressure the least recently
    used prefix that frees memory is the first; dropping it frees its third block only."""
    kv = _account(True, 6, 100)
    pool = kv.storage
    first = kv.admit(64)
    _fill(pool, first, 9)
    ids = list(range(3, 43))
    kept = CachedPrefix(tokens=40, ids=ids, hashes=chain(ids, identity(graph="t")))
    kv.release(first, keep=kept)
    assert kept.slot == 0 and len(pool.blocks(0)) == 3 and kv.held_bytes() == 3 * 128
    runner = kv.admit(48, source=(kept.slot, 32))  # the kept prefix was in the way: moved aside, its blocks shared
    assert runner == 0 and kept.slot != 0 and pool.blocks(runner)[:2] == pool.blocks(kept.slot)[:2]
    other = kv.admit(32, source=(kept.slot, 32))
    short = CachedPrefix(tokens=32, ids=ids[:32], hashes=chain(ids[:32], identity(graph="t")))
    kv.release(other, keep=short)  # kept in place: its two blocks, both shared
    sharer = kv.admit(48, source=(short.slot, 32))
    cache = PrefixCache(identity(graph="t"))
    for entry in (short, kept):  # the fully shared one used longest ago
        cache.entries[id(entry)] = entry
    assert kv.freed_by_drop(short) == 0 and kv.freed_by_drop(kept) == 128
    assert cache.least_recent() is short
    frees = cache.least_recent(where=lambda e: kv.freed_by_drop(e) > 0)
    assert frees is kept
    before = kv.held_bytes()
    doc = pool.blocks(runner)[:2]
    kv.drop(kept)
    assert kv.held_bytes() == before - 128
    assert pool.blocks(runner)[:2] == pool.blocks(sharer)[:2] == doc and all(pool.references(x) == 3 for x in doc)
    for buf in pool.buffers.values():
        assert (buf[list(doc)] == 9).all()
    usage = kv.usage()
    assert usage.cached_slots == 1 and usage.cached_bytes == 0  # the kept one left holds only shared blocks


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


def _document_run(spec, model, budget_blocks: int, *, blocks: bool):
    """A document's first question run to its end (its prefix kept), then 8 more questions on it at once, half greedy
    and half seeded, on paged admission with a budget of ``budget_blocks`` blocks counted exactly; returns the
    sequences admitted by the step after they arrived, the most running at once and every sequence's tokens. Each
    step checks the account within the budget, and in a pool the blocks in use and the highest one taken too."""
    storage = _exact(kv_storage(model, spec, 12) if blocks else HostKVBuffers(spec, 12, spec.max_context))
    per_block = 2 * spec.num_layers * spec.num_kv_heads * BLOCK_TOKENS * spec.head_dim
    kv = KVSlots(spec, 12, budget_blocks * per_block, storage=storage, block_tokens=16)
    sched = Scheduler(model, kv, None, spec.eos_token_ids, max_waiting=64,
                      prefix_cache=PrefixCache(identity(graph="kv-shared")))
    rng = random.Random(11)
    document = [rng.randrange(3, spec.vocab_size) for _ in range(64)]
    questions = [[rng.randrange(3, spec.vocab_size) for _ in range(8)] for _ in range(9)]
    seeded = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.9, top_k=40)
    params = [GREEDY if i % 2 == 0 else dataclasses.replace(seeded, seed=100 + i) for i in range(9)]

    def within() -> None:
        assert kv.held_bytes() <= kv.budget_bytes
        if blocks:
            held = [b for s in range(kv.slots) for b in kv.storage.blocks(s)]
            assert kv.held_bytes() == kv.storage.blocks_in_use * per_block
            assert (max(held, default=-1) + 1) * per_block <= kv.budget_bytes

    first = sched.submit(Generation(document + questions[0], dataclasses.replace(GREEDY, max_tokens=8),
                                    lambda g, e: None))
    run_to_end(sched, within)
    assert len(sched.prefix_cache.entries) == 1  # its 79 tokens kept: 5 blocks
    gens = [sched.submit(Generation(document + q, p, lambda g, e: None)) for q, p in zip(questions[1:], params[1:])]
    sched.step()
    within()
    at_once = len(sched.running)
    peak = max(at_once, run_to_end(sched, within))
    return at_once, peak, [first.generated] + [g.generated for g in gens], gens


@needs_kernel
def test_sequences_sharing_a_documents_prefix_are_admitted_past_what_slots_admit_with_the_same_tokens(layouts) -> None:
    """A budget holding 4 whole sequences (64 + 8 + 8 tokens: 5 blocks each, 20 blocks): in slots the kept prefix is
    taken over by the first question and the others wait a step for it (held back: it is no holder until its
    prefill), then copy the document from it, at most 4 at once; in a pool every question shares the kept document's
    4 blocks and adds one, 7 at once; each sequence's tokens are the slot layout's, greedy and seeded."""
    spec, on_slots, on_blocks = layouts
    slots_at_once, slots_peak, want, _gens = _document_run(spec, on_slots, 20, blocks=False)
    blocks_at_once, blocks_peak, got, gens = _document_run(spec, on_blocks, 20, blocks=True)
    assert got == want
    assert slots_at_once == 1 and slots_peak <= 4  # the first alone: the others share its blocks, held back a step
    assert blocks_at_once >= 4 + 3 and blocks_peak >= 7, (blocks_at_once, blocks_peak)
    assert all(g.prefix_hit == 64 for g in gens)


@needs_kernel
def test_a_burst_on_a_document_nobody_holds_prefills_it_once_in_both_layouts(layouts) -> None:
    """8 questions on a 4-block document at once, the cache empty, on the INT8 cache's kernel: the first is prefilled
    whole and the 7 others held back a step, then admitted with its 4 blocks as their hit (in a pool, shared: the
    document's blocks held once); the document's tokens are prefilled once, and both layouts give the tokens each
    question gives alone without a cache."""
    spec, on_slots, on_blocks = layouts
    rng = random.Random(13)
    document = [rng.randrange(3, spec.vocab_size) for _ in range(4 * BLOCK_TOKENS)]
    prompts = [document + [rng.randrange(3, spec.vocab_size) for _ in range(1 + i)] for i in range(8)]
    alone = []
    for prompt in prompts:
        sched = _scheduler(spec, on_slots, 2, 1 << 28)
        g = sched.submit(Generation(prompt, GREEDY, lambda g, e: None))
        run_to_end(sched)
        alone.append(g.generated)
    for model in (on_slots, on_blocks):
        counting = _Prefilled(model)
        sched = _scheduler(spec, counting, 8, 1 << 28, prefix_cache=PrefixCache(identity(graph="burst")))
        gens = [sched.submit(Generation(p, GREEDY, lambda g, e: None)) for p in prompts]
        sched.step()
        assert len(sched.running) == 1 and all(g.held_back for g in gens[1:2]) and not gens[2].held_back
        sched.step()
        assert len(sched.running) == 8 and [g.prefix_hit for g in gens] == [0] + [len(document)] * 7
        if model is on_blocks:
            pool = sched.slots.storage
            assert all(pool.references(b) == 8 for b in pool.blocks(gens[0].slot)[:4])
        run_to_end(sched)
        assert counting.tokens == sum(map(len, prompts)) - 7 * len(document)
        assert [g.generated for g in gens] == alone


@needs_kernel
def test_under_pressure_a_kept_prefix_is_dropped_freeing_its_own_blocks_only(layouts) -> None:
    """A kept document (5 blocks), a running question sharing its 4 document blocks, then an unrelated prompt the
    budget holds only once the kept prefix goes: the kept prefix is dropped, 1 block freed, the runner's blocks
    untouched, and both sequences give the tokens they give on slots with room to spare."""
    spec, on_slots, on_blocks = layouts
    rng = random.Random(12)
    document = [rng.randrange(3, spec.vocab_size) for _ in range(64)]
    question = [rng.randrange(3, spec.vocab_size) for _ in range(8)]
    other = [rng.randrange(3, spec.vocab_size) for _ in range(40)]
    long = SamplingParams(max_tokens=24, min_tokens=24)

    def run(model, blocks: bool, budget_blocks: int):
        storage = _exact(kv_storage(model, spec, 6) if blocks else HostKVBuffers(spec, 6, spec.max_context))
        per_block = 2 * spec.num_layers * spec.num_kv_heads * BLOCK_TOKENS * spec.head_dim
        kv = KVSlots(spec, 6, budget_blocks * per_block, storage=storage, block_tokens=16)
        sched = Scheduler(model, kv, None, spec.eos_token_ids, prefix_cache=PrefixCache(identity(graph="evict")))
        sched.submit(Generation(document + [7] * 8, dataclasses.replace(GREEDY, max_tokens=8), lambda g, e: None))
        run_to_end(sched)
        runner = sched.submit(Generation(document + question, long, lambda g, e: None))
        sched.step()
        seen = {}
        if blocks:
            pool = kv.storage
            seen["doc"] = pool.blocks(runner.slot)[:4]
            seen["bytes"] = {name: buf[list(seen["doc"])].copy() for name, buf in pool.buffers.items()}
            seen["held"] = kv.held_bytes()
            assert runner.prefix_hit == 64 and len(sched.prefix_cache.entries) == 1
            assert kv.freed_by_drop(next(iter(sched.prefix_cache.entries.values()))) == per_block
        newcomer = sched.submit(Generation(other, GREEDY, lambda g, e: None))
        sched.step()
        if blocks:
            assert newcomer.slot is not None and not sched.prefix_cache.entries  # admitted, the kept prefix dropped
            assert pool.blocks(runner.slot)[:4] == seen["doc"] and all(pool.references(b) == 1 for b in seen["doc"])
            for name, buf in pool.buffers.items():
                assert np.array_equal(buf[list(seen["doc"])], seen["bytes"][name])
            # The kept prefix's block of its own freed; the newcomer's 3 blocks taken (its 40 + 1 tokens).
            assert kv.held_bytes() == seen["held"] - per_block + 3 * per_block
        run_to_end(sched, lambda: kv.held_bytes() <= kv.budget_bytes)
        return runner.generated, newcomer.generated

    # 6 blocks held (the document's 4, the kept prefix's and the runner's own one), the newcomer's 3 and a block of
    # room for each of the two: 11 blocks; the budget has 10.
    got = run(on_blocks, True, 10)
    assert got == run(on_slots, False, 100)


# --------------------------------------------------------------------------- a request's choices in a pool

class _Prefilled:
    """The engine, with the prompt tokens each prefill launch wrote counted."""

    def __init__(self, model):
        self.model, self.tokens, self.kv_block_tokens = model, 0, model.kv_block_tokens

    def prefill(self, contexts, views, **kw):
        self.tokens += sum(len(c) for c in contexts)
        return self.model.prefill(contexts, views, **kw)

    def decode(self, *args, **kw):
        return self.model.decode(*args, **kw)


def _choices(prompt, params, n, **leader_kw):
    gens = []
    for i in range(n):
        gens.append(Generation(list(prompt), dataclasses.replace(params, seed=choice_seed(params.seed, i)),
                               lambda g, e: None, index=i, leader=gens[0] if gens else None,
                               **(leader_kw if i == 0 else {})))
    return gens


def _choices_scheduler(spec, model, budget_blocks: int, *, blocks: bool, **kw):
    """Paged admission over a pool (``blocks``) or the slots' buffers, 6 slots, a budget of ``budget_blocks`` blocks
    counted exactly; and the check that the account (and in a pool the blocks in use) stays within the budget."""
    storage = _exact(kv_storage(model, spec, 6) if blocks else HostKVBuffers(spec, 6, spec.max_context))
    per_block = 2 * spec.num_layers * spec.num_kv_heads * BLOCK_TOKENS * spec.head_dim
    kv = KVSlots(spec, 6, budget_blocks * per_block, storage=storage, block_tokens=16)
    sched = Scheduler(model, kv, None, spec.eos_token_ids, max_waiting=64, **kw)

    def within() -> None:
        assert kv.held_bytes() <= kv.budget_bytes
        if blocks:
            assert kv.held_bytes() == kv.storage.blocks_in_use * per_block
    return sched, within


@needs_kernel
def test_a_requests_choices_share_their_leaders_prompt_blocks_from_admission_and_are_admitted_at_once(layouts):
    """A 100-token prompt and 20 tokens each, n = 4: a sequence takes 7 blocks at admission (its prompt and first
    token), 8 by its end. A budget of 16 blocks holds the prompt's 6 full blocks once, each choice's 7th and 8th and
    the blocks of room, not 4 whole copies (28 at admission): in a pool the 4 choices are admitted in one step (the
    leader's 7 blocks, one of each sibling's own and 4 of room: 14), the siblings sharing the leader's prefill; in
    slots, where each copy is a copy, 2 at once. Each choice's tokens are those of the request run with room to
    spare, greedy and seeded, and the account never passes the budget."""
    spec, on_slots, on_blocks = layouts
    rng = random.Random(21)
    prompt = [rng.randrange(3, spec.vocab_size) for _ in range(100)]
    for params in (SamplingParams(max_tokens=20, min_tokens=20),
                   SamplingParams(max_tokens=20, min_tokens=20, temperature=0.9, top_k=40, seed=31)):
        sched, within = _choices_scheduler(spec, on_blocks, 100, blocks=True)
        spare = sched.submit_all(_choices(prompt, params, 4))
        run_to_end(sched, within)
        counting = _Prefilled(on_blocks)
        sched, within = _choices_scheduler(spec, counting, 16, blocks=True)
        gens = sched.submit_all(_choices(prompt, params, 4))
        sched.step()
        within()
        assert len(sched.running) == 4 and all(len(g.generated) == 1 for g in gens)
        assert [g.prefill_from for g in gens] == [None] + [gens[0]] * 3 and counting.tokens == len(prompt)
        pool = sched.slots.storage
        leader_blocks = pool.blocks(gens[0].slot)
        assert all(pool.blocks(g.slot)[:6] == leader_blocks[:6] for g in gens)
        assert all(pool.references(b) == 4 for b in leader_blocks[:6]) and pool.blocks_in_use == 6 + 4
        run_to_end(sched, within)
        assert [g.generated for g in gens] == [g.generated for g in spare]
        assert pool.blocks_in_use == 0 and sched.slots.active == 0
        sched, within = _choices_scheduler(spec, on_slots, 16, blocks=False)
        apart = sched.submit_all(_choices(prompt, params, 4))
        sched.step()
        within()
        assert len(sched.running) == 2  # the leader and one sibling: the rest wait, and prefill themselves
        run_to_end(sched, within)
        assert [g.generated for g in apart] == [g.generated for g in spare]


@needs_kernel
@pytest.mark.parametrize("stop", ["cancelled", "preempted"])
def test_a_leader_stopped_mid_prefill_hands_its_prompt_to_one_sibling(layouts, stop):
    """Chunked prefill beside a decoding stream: a request of 3 choices whose leader stops after its first chunk. In a
    pool the siblings share the leader's full prompt blocks from admission, so the first of them prefills the prompt
    in its place and the other waits on it (a shared block has one writer): cancelled, from the tokens the leader
    wrote (the prompt prefilled once in all); preempted, from the start (the leader prefills its own again when it
    resumes). Every choice's tokens are those of the request run whole with room to spare."""
    spec, _, on_blocks = layouts
    rng = random.Random(22)
    prompt = [rng.randrange(3, spec.vocab_size) for _ in range(100)]
    params = SamplingParams(max_tokens=10, min_tokens=10, temperature=0.9, top_k=40, seed=41)
    sched, within = _choices_scheduler(spec, on_blocks, 100, blocks=True)
    spare = sched.submit_all(_choices(prompt, params, 3))
    run_to_end(sched, within)
    counting = _Prefilled(on_blocks)
    gone = {"now": False}
    sched, within = _choices_scheduler(spec, counting, 40, blocks=True, chunk_tokens=32, cancel_check_s=0.0)
    stream = sched.submit(Generation([5, 6, 7], SamplingParams(max_tokens=40, min_tokens=40), lambda g, e: None))
    sched.step()
    gens = sched.submit_all(_choices(prompt, params, 3, is_cancelled=lambda: gone["now"]))
    sched.step()
    within()
    leader, first, second = gens
    chunk = leader.cached
    assert leader.prefilling and 0 < chunk < len(prompt)
    assert first.prefill_from is leader and second.prefill_from is leader
    pool = sched.slots.storage
    assert pool.blocks(first.slot)[:6] == pool.blocks(second.slot)[:6] == pool.blocks(leader.slot)[:6]
    if stop == "cancelled":
        gone["now"] = True
    else:
        sched.preempt(leader)
    sched.step()
    within()
    assert second.prefill_from is first
    run_to_end(sched, within)
    if stop == "cancelled":
        assert leader.finish_reason == "cancelled"
        assert counting.tokens == len(stream.prompt) + len(prompt)
        assert [first.generated, second.generated] == [g.generated for g in spare[1:]]
    else:
        assert counting.tokens == len(stream.prompt) + chunk + 2 * len(prompt)
        assert [g.generated for g in gens] == [g.generated for g in spare]


# --------------------------------------------------------------------------- preemption in a pool

class _Preemptions(NullMetrics):
    """The preemptions metric, counted."""

    def __init__(self) -> None:
        self.count = 0

    def preempted(self) -> None:
        self.count += 1


@needs_kernel
def test_a_blocks_preemption_takes_a_sequence_whose_release_frees_memory(layouts) -> None:
    """Two requests with one prompt and one greedy answer (the most tokens left) and a shorter one, all at a block's
    end. The first two's identical blocks are then held once (the second shares the first's, as a sharing of decoded
    blocks would hold them: admission today always leaves a sequence a block of its own) and the budget is what they
    hold. The shorter one's next block must come from a preemption: by tokens left alone the second would go, freeing
    nothing (the first holds its blocks), then the first, two preemptions; the shorter one is preempted instead, once,
    and every sequence's tokens are those of the run with room to spare."""
    spec, _, on_blocks = layouts
    rng = random.Random(23)
    prompt, other = ([rng.randrange(3, spec.vocab_size) for _ in range(16)] for _ in range(2))
    long, short = SamplingParams(max_tokens=40, min_tokens=40), SamplingParams(max_tokens=24, min_tokens=24)

    def submit(sched):
        return [sched.submit(Generation(list(p), params, lambda g, e: None))
                for p, params in ((other, short), (prompt, long), (prompt, long))]

    sched, within = _choices_scheduler(spec, on_blocks, 100, blocks=True)
    spare = submit(sched)
    run_to_end(sched, within)
    metrics = _Preemptions()
    sched, within = _choices_scheduler(spec, on_blocks, 100, blocks=True, metrics=metrics)
    kv, pool = sched.slots, sched.slots.storage
    shorter, first, second = submit(sched)
    while first.cached < 2 * BLOCK_TOKENS:
        sched.step()
        within()
    trio = (shorter, first, second)
    assert [g.cached for g in trio] == [32] * 3 and [len(pool.blocks(g.slot)) for g in trio] == [2] * 3
    for buf in pool.buffers.values():  # the same keys and values: holding them once changes no token
        assert np.array_equal(buf[list(pool.blocks(first.slot))], buf[list(pool.blocks(second.slot))])
    kv.copy(second.slot, first.slot, 32)
    assert pool.blocks(second.slot) == pool.blocks(first.slot)
    assert [kv.freed_by_release(g.slot) // kv.bytes_for(1) for g in trio] == [2, 0, 0]
    roomy, kv.budget_bytes = kv.budget_bytes, kv.held_bytes()  # no next block without a preemption
    assert kv.budget_bytes == 4 * kv.bytes_for(1)
    sched.step()
    within()
    assert metrics.count == 1 and shorter.preemptions == 1 and shorter.slot is None
    assert not first.preemptions and not second.preemptions and len(first.generated) == len(second.generated) == 18
    kv.budget_bytes = roomy
    run_to_end(sched, within)
    assert metrics.count == 1
    assert [g.generated for g in trio] == [g.generated for g in spare]
