"""A request's sibling choices sharing their leader's prefill (generation/siblings.py): which share it and where they
go in a prefill group, what a sibling is admitted from in a pool of blocks and in slots, where its placeholder row
writes, and who prefills the prompt when the leader stops mid-prefill. The scheduler running them on a real graph is
tested in test_scheduler.py, test_chunked_prefill.py and (in a pool) test_kv_pool.py."""

from __future__ import annotations

from model_factory.backend.contract import GenerationSpec
from model_factory.backend.generation.kv_pool import BlockKVBuffers
from model_factory.backend.generation.kv_slots import HostKVBuffers, KVSlots
from model_factory.backend.generation.sampling import SamplingParams
from model_factory.backend.generation.scheduler import Generation
from model_factory.backend.generation.siblings import (admission_source, placeholder_at, shares_prefill,
                                                        sharing_last, take_over)

PROMPT = list(range(3, 43))  # 40 tokens: 2 full blocks of 16 and a partly filled third


def _spec() -> GenerationSpec:
    return GenerationSpec(family="llama", num_layers=1, num_attention_heads=2, num_kv_heads=1, head_dim=4,
                          hidden_size=8, vocab_size=100, max_context=64, eos_token_ids=(1,), kv_dtype="int8")


def _kv(blocks: bool) -> KVSlots:
    spec = _spec()
    storage = BlockKVBuffers(spec, 6, 64, 16) if blocks else HostKVBuffers(spec, 6, 64)
    return KVSlots(spec, 6, 1 << 20, storage=storage, block_tokens=16)


def _request(n: int) -> list[Generation]:
    gens: list[Generation] = []
    for i in range(n):
        gens.append(Generation(list(PROMPT), SamplingParams(max_tokens=8), lambda g, e: None, index=i,
                               leader=gens[0] if gens else None))
    return gens


def test_fresh_siblings_with_their_leader_share_its_prefill_behind_the_launched_rows() -> None:
    leader, first, second, resumed = _request(4)
    resumed.preemptions = 1  # preempted once: it prefills what it has itself
    other = Generation([5, 6], SamplingParams(max_tokens=4), lambda g, e: None)
    group = [leader, first, other, second, resumed]
    assert [shares_prefill(g, group) for g in group] == [False, True, False, True, False]
    assert not shares_prefill(first, [first, second])  # its leader not admitted with it: it prefills itself
    assert sharing_last(group) == [leader, other, resumed, first, second]
    assert [g.prefill_from for g in group] == [None, leader, None, leader, None]


def test_in_a_pool_a_sibling_is_admitted_from_its_leaders_slot_and_its_placeholder_writes_past_the_shared_blocks():
    for blocks in (True, False):
        kv = _kv(blocks)
        leader, first = sharing_last(_request(2))
        leader.slot = kv.admit(41)
        source = admission_source(first, kv)
        assert source == ((leader.slot, 40) if blocks else None)
        first.slot = kv.admit(41, source=source)
        if blocks:  # the leader's 2 full blocks shared from admission; its own: the third (copied) and nothing more
            assert kv.storage.blocks(first.slot)[:2] == kv.storage.blocks(leader.slot)[:2]
            assert kv.held_bytes() == (3 + 1) * kv.admission_bytes(16)
        else:
            assert kv.held_bytes() == 2 * kv.admission_bytes(41)
        first.prefilling = leader.prefilling = True
        leader.cached = 24
        assert placeholder_at(first, kv) == (32 if blocks else 0)  # a pool: past the shared blocks
        assert placeholder_at(leader, kv) == 24  # its own next chunk writes it again
        assert admission_source(leader, kv) is None


def test_a_leader_stopped_mid_prefill_is_replaced_by_its_first_waiting_sibling() -> None:
    for blocks, stop, want in ((True, "cancelled", 20), (True, "preempted", 0), (False, "cancelled", 0)):
        kv = _kv(blocks)
        leader, first, second = sharing_last(_request(3))
        for gen in (leader, first, second):
            gen.slot, gen.prefilling = kv.admit(41, source=admission_source(gen, kv)), True
        heirs: dict = {}
        take_over(first, heirs, kv)
        assert first.prefill_from is leader and not heirs  # the leader prefills on
        leader.cached = 20  # its first chunk written
        if stop == "cancelled":
            leader.finish_reason = "cancelled"
        else:
            leader.preemptions, leader.cached = 1, 30  # preempted and admitted again: in blocks of its own
        for gen in (first, second):
            take_over(gen, heirs, kv)
        assert first.prefill_from is None and second.prefill_from is first
        assert first.cached == want and second.cached == 0
