"""Prefix caching over the KV slots (generation/prefix_cache.py): a request's tokens are the same with and without a
cache hit (greedy and seeded), the hit prefills only the rest of its context, kept slots are dropped least recently
used first under the budget, and the account never holds more than the budget; on every family of the zoo."""

from __future__ import annotations

import dataclasses
import random

import pytest

from model_factory.backend.contract import GenerationSpec
from model_factory.backend.generation.causal_lm import CausalLM
from model_factory.backend.generation.kv_slots import KVSlots
from model_factory.backend.generation.prefix_cache import (BLOCK_TOKENS, CachedPrefix, PrefixCache, chain, enabled,
                                                           identity)
from model_factory.backend.generation.sampling import SamplingParams, choice_seed
from model_factory.backend.generation.scheduler import Generation, Scheduler
from model_factory.backend.generation.sequence import NullMetrics

from tests.generative_repository import ZOO_VARIANTS, int8_kernel_engine, run_to_end, zoo_engine

SEED = identity(graph="test")


def _spec(**more) -> GenerationSpec:
    return GenerationSpec(family="llama", num_layers=1, num_attention_heads=2, num_kv_heads=1, head_dim=4,
                          hidden_size=8, vocab_size=100, max_context=64, eos_token_ids=(1,), **more)


# --------------------------------------------------------------------------- the table and the account


def test_block_hashes_chain_over_every_token_before_them_and_the_seed():
    a = chain(list(range(40)), SEED)
    assert len(a) == 40 // BLOCK_TOKENS
    b = chain([99] + list(range(1, 40)), SEED)  # the first token differs: every block's hash differs
    assert all(x != y for x, y in zip(a, b))
    assert chain(list(range(40)), identity(graph="other")) != a  # another graph, precision or KV type
    assert chain(list(range(40)), SEED, blocks=1) == a[:1] and chain(list(range(40)), SEED, start=a[:1]) == a


def test_lookup_finds_the_longest_whole_blocks_leaving_the_last_token_to_run():
    cache = PrefixCache(SEED)
    ids = list(range(3, 3 + 3 * BLOCK_TOKENS))
    entry = CachedPrefix(tokens=len(ids), slot=5, ids=ids, hashes=chain(ids, SEED))
    assert cache.kept(entry) == []
    assert cache.lookup(ids[:BLOCK_TOKENS]) is None  # one block, but its last token must run
    assert cache.lookup(ids[:BLOCK_TOKENS + 1]).tokens == BLOCK_TOKENS
    assert cache.lookup(ids).tokens == 2 * BLOCK_TOKENS  # the whole of it: less the last token's block
    assert cache.lookup(ids + [7]).tokens == 3 * BLOCK_TOKENS
    assert cache.lookup(ids[:20] + [0] * 30).tokens == BLOCK_TOKENS  # parts in the second block
    assert cache.lookup([0] + ids[1:]) is None
    longer = ids + list(range(50, 50 + BLOCK_TOKENS))
    bigger = CachedPrefix(tokens=len(longer), slot=6, ids=longer, hashes=chain(longer, SEED))
    assert cache.kept(bigger) == [entry]  # it extends the first: the caller drops that one
    cache.forget(entry)
    assert cache.lookup(longer + [1]).holder is bigger and cache.blocks() == 4


def test_kept_slots_are_counted_moved_out_of_the_way_and_taken_over():
    spec = _spec()
    slots = KVSlots(spec, 3, 1 << 20)
    a = slots.admit(10)
    b = slots.admit(10)
    for buf in slots.buffers.values():
        buf[a, :, :8] = 1.0
        buf[b, :, :8] = 2.0
    entry = CachedPrefix(tokens=8)
    assert slots.release(a, keep=entry) == 1  # b moved into slot 0; a's prefix kept in the highest free slot
    assert entry.slot == 2 and slots.free == 1
    assert all((buf[2, :, :8] == 1.0).all() and (buf[0, :, :8] == 2.0).all() for buf in slots.buffers.values())
    usage = slots.usage()
    assert usage.cached_slots == 1 and usage.cached_bytes == slots.bytes_for(8)
    assert slots.admit(4) == 1 and not slots.can_admit(4)  # no free slot left while it is kept
    slots.release(1)
    slots.release(0, keep=(second := CachedPrefix(tokens=8)))
    assert second.slot == 0 and slots.active == 0  # the last active slot: kept in place
    assert slots.admit(10, take=second) == 0 and second.slot is None and slots.usage().cached_slots == 1
    assert all((buf[0, :, :8] == 2.0).all() for buf in slots.buffers.values())  # taken over: its keys in place
    slots.release(0, keep=(third := CachedPrefix(tokens=8)))
    assert slots.admit(10) == 0 and third.slot == 1  # in the way: moved to a free slot
    assert all((buf[1, :, :8] == 2.0).all() for buf in slots.buffers.values())
    slots.drop(third)
    slots.drop(entry)
    assert slots.free == 2 and slots.usage().cached_bytes == 0


def test_pending_blocks_say_what_a_step_will_hold_by_the_caches_hashes():
    """What this step's admitted prompts will have written, in whole blocks (a split prompt's first chunk only),
    against a waiting prompt, its last token left to run as a lookup leaves it."""
    pending = PrefixCache(SEED).pending()
    ids = list(range(3, 3 + 4 * BLOCK_TOKENS))
    assert pending.shared(ids + [1]) == 0  # nothing admitted yet
    pending.add(ids + [7, 8], written=2 * BLOCK_TOKENS + 5)  # split: its first chunk writes 2 whole blocks
    assert pending.shared(ids + [1]) == 2 * BLOCK_TOKENS
    pending.add(ids + [9], written=len(ids) + 1)
    assert pending.shared(ids + [1]) == 4 * BLOCK_TOKENS and pending.shared(ids) == 3 * BLOCK_TOKENS
    assert pending.shared(ids[:20] + [0] * 30) == BLOCK_TOKENS  # parts in the second block
    assert pending.shared([0] + ids[1:]) == 0 and pending.shared(ids[:BLOCK_TOKENS - 1] + [0] * 40) == 0
    gen = Generation(ids + [1], GREEDY, lambda g, e: None)
    sibling = Generation(ids + [1], GREEDY, lambda g, e: None, index=1, leader=gen)
    cached = PrefixCache(SEED)
    cached.kept(CachedPrefix(tokens=len(ids), slot=0, ids=ids, hashes=chain(ids, SEED)))
    assert not pending.hold_back(gen, cached.lookup(ids + [1]))  # its own hit is as long: nothing to wait for
    assert not pending.hold_back(sibling, None)  # a sibling choice never waits
    assert pending.hold_back(gen, None) and gen.held_back
    assert not pending.hold_back(gen, None)  # once: next step it is admitted whatever it finds


def test_auto_is_on_unless_the_precision_depends_on_the_batch():
    assert enabled("auto", "fp32", ("int8",)) and not enabled("auto", "int8", ("int8",))
    assert enabled("on", "int8", ("int8",)) and not enabled("off", "fp32", ())


# --------------------------------------------------------------------------- on the real graph


class _Recording:
    """The engine, with each prefill's rows (new tokens) and cached prefix recorded."""

    def __init__(self, model):
        self.model, self.prefilled = model, []

    def prefill(self, contexts, views, past=None):
        self.prefilled.append(([len(c) for c in contexts], list(past or [0] * len(contexts))))
        return self.model.prefill(contexts, views, past=past)

    def decode(self, *args):
        return self.model.decode(*args)


def _alone(model, spec, prompt, params) -> list[int]:
    sched = Scheduler(model, KVSlots(spec, 2, 1 << 28), None, spec.eos_token_ids)
    g = sched.submit(Generation(list(prompt), params, lambda g, e: None))
    run_to_end(sched)
    return g.generated


GREEDY = SamplingParams(max_tokens=12, min_tokens=12)
SEEDED = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.9, top_k=40, seed=11)


def _document_questions(vocab: int, seed: int = 0, doc: int = 70, questions: int = 3) -> tuple[list, list]:
    rng = random.Random(seed)
    document = [rng.randrange(3, vocab) for _ in range(doc)]
    return document, [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 9))] for _ in range(questions)]


def _check_hits_equal_misses(model, spec, *, doc: int = 70) -> Scheduler:
    """One after another, then together: every request with a hit gives the tokens it gives alone, cold."""
    document, questions = _document_questions(spec.vocab_size, doc=doc)
    recording = _Recording(model)
    sched = Scheduler(recording, KVSlots(spec, 4, 1 << 28), None, spec.eos_token_ids, prefix_cache=PrefixCache(SEED))
    for params in (GREEDY, SEEDED):
        for q in questions:  # one at a time: each after the first finds the one before it kept
            g = sched.submit(Generation(document + q, params, lambda g, e: None))
            run_to_end(sched)
            assert g.generated == _alone(model, spec, document + q, params), (q, params)
            if params is GREEDY and q is questions[0]:
                assert g.prefix_hit == 0  # the first: nothing cached yet
                continue
            assert g.prefix_hit == (doc // BLOCK_TOKENS) * BLOCK_TOKENS
            assert recording.prefilled[-1] == ([len(document) + len(q) - g.prefix_hit], [g.prefix_hit])
    # The same document continued by what an earlier answer generated (a conversation's next turn): more blocks hit.
    first = sched.submit(Generation(document + questions[0], GREEDY, lambda g, e: None))
    run_to_end(sched)
    turn = document + questions[0] + first.generated + [5, 6, 7]
    nxt = sched.submit(Generation(turn, GREEDY, lambda g, e: None))
    run_to_end(sched)
    assert nxt.prefix_hit == ((len(turn) - 4) // BLOCK_TOKENS) * BLOCK_TOKENS > first.prefix_hit
    assert nxt.generated == _alone(model, spec, turn, GREEDY)
    # Several at once while one holder runs: each copies the prefix from its slot and prefills its question alone.
    holder = sched.submit(Generation(document + [9], SamplingParams(max_tokens=30, min_tokens=30), lambda g, e: None))
    sched.step()
    gens = [sched.submit(Generation(document + q, SEEDED, lambda g, e: None)) for q in questions]
    run_to_end(sched)
    assert all(g.prefix_hit for g in gens) and len(holder.generated) == 30
    assert [g.generated for g in gens] == [_alone(model, spec, document + q, SEEDED) for q in questions]
    return sched


@pytest.fixture(scope="module")
def engine(tiny_llm):
    from tests.generative_repository import generation_spec

    hf, onnx_dir = tiny_llm
    return generation_spec(hf, {}), CausalLM(onnx_dir / "model.onnx", threads=1, pad_token_id=0)


def test_a_hit_gives_the_tokens_of_a_whole_prefill_greedy_and_seeded(engine):
    spec, model = engine
    sched = _check_hits_equal_misses(model, spec)
    assert sched.slots.active == 0 and sched.slots.usage().cached_slots >= 1


def test_kept_prefixes_are_dropped_least_recently_used_first_within_the_budget(engine):
    """A budget of about three sequences, many documents: every step keeps reservations and kept prefixes within
    the budget, kept ones are dropped for the running ones (oldest first), and every sequence ends with its tokens."""
    spec, model = engine
    one = KVSlots(spec, 1, 1 << 30).bytes_for(80)
    slots = KVSlots(spec, 6, 3 * one)
    cache = PrefixCache(SEED)
    sched = Scheduler(model, slots, None, spec.eos_token_ids, prefix_cache=cache, max_waiting=64)
    rng = random.Random(3)
    docs = [[rng.randrange(3, spec.vocab_size) for _ in range(40)] for _ in range(5)]
    gens = []
    for i in range(40):
        doc = docs[rng.randrange(len(docs))]
        gens.append(sched.submit(Generation(doc + [rng.randrange(3, 99)], SamplingParams(max_tokens=8, min_tokens=8),
                                            lambda g, e: None)))
        for _ in range(rng.randrange(0, 4)):
            sched.step()
            usage = slots.usage()
            assert usage.reserved_bytes + usage.cached_bytes <= slots.budget_bytes
            assert slots.active + usage.cached_slots <= slots.slots
    run_to_end(sched)
    assert all(len(g.generated) == 8 for g in gens)
    assert sum(1 for g in gens if g.prefix_hit) >= 20
    for g in gens[::7]:
        assert g.generated == _alone(model, spec, g.prompt, g.params)


class _Counting(NullMetrics):
    """The scheduler's reports, the admissions held back for a shared prefix counted."""

    def __init__(self):
        self.held_back = 0

    def prefix_held_back(self) -> None:
        self.held_back += 1


def _choices(prompt, params, n: int) -> list[Generation]:
    """A request's ``n`` choices: choice 0 the leader, each seeded as the frontends seed them."""
    gens: list[Generation] = []
    for i in range(n):
        gens.append(Generation(list(prompt), dataclasses.replace(params, seed=choice_seed(params.seed, i)),
                               lambda g, e: None, index=i, leader=gens[0] if gens else None))
    return gens


def _burst(model, spec, prompts, params, *, n: int = 1):
    """Every prompt submitted at once (``n`` choices each) to a scheduler with an empty prefix cache and room for
    all; returns the recording engine, the metrics, the sequences and how many ran after the first step."""
    recording, metrics = _Recording(model), _Counting()
    sched = Scheduler(recording, KVSlots(spec, 12, 1 << 28), None, spec.eos_token_ids, metrics=metrics,
                      prefix_cache=PrefixCache(SEED))
    gens = [g for prompt in prompts for g in sched.submit_all(_choices(prompt, params, n))]
    sched.step()
    first = len(sched.running)
    run_to_end(sched)
    return recording, metrics, gens, first


def test_a_burst_on_a_document_nobody_holds_prefills_it_once(engine):
    """8 questions on one 4-block document at once, the cache empty: the first is admitted and prefilled whole, the
    7 others held back a step (the admission stops at the first of them), then admitted with the first's 4 blocks
    as their hit; the document's tokens run once, and every output is its output alone without a cache."""
    spec, model = engine
    document, questions = _document_questions(spec.vocab_size, seed=4, doc=4 * BLOCK_TOKENS, questions=8)
    prompts = [document + q for q in questions]
    recording, metrics, gens, first = _burst(model, spec, prompts, GREEDY)
    assert first == 1 and metrics.held_back == 1  # one held back; the 6 behind it wait in their places
    assert [g.prefix_hit for g in gens] == [0] + [len(document)] * 7
    assert recording.prefilled[0] == ([len(prompts[0])], [0])
    assert sorted(recording.prefilled[1:]) == sorted(([len(q)], [len(document)]) for q in questions[1:])
    assert sum(sum(rows) for rows, _ in recording.prefilled) == len(document) + sum(map(len, questions))
    assert [g.generated for g in gens] == [_alone(model, spec, p, GREEDY) for p in prompts]


def test_a_burst_sharing_less_than_a_block_is_admitted_at_once(engine):
    """A shared beginning under one block (a <bos> and a chat header) holds nothing back: all 8 are prefilled in
    the first step, none with a hit, each with its tokens alone."""
    spec, model = engine
    rng = random.Random(6)
    header = [rng.randrange(3, spec.vocab_size) for _ in range(BLOCK_TOKENS - 1)]
    prompts = [header + [3 + i] + [rng.randrange(3, spec.vocab_size) for _ in range(20)] for i in range(8)]
    recording, metrics, gens, first = _burst(model, spec, prompts, GREEDY)
    assert first == 8 and metrics.held_back == 0 and not any(g.prefix_hit for g in gens)
    assert sum(sum(rows) for rows, _ in recording.prefilled) == sum(map(len, prompts))
    assert [g.generated for g in gens] == [_alone(model, spec, p, GREEDY) for p in prompts]


def test_a_requests_choices_are_not_held_back_and_the_next_request_waits_for_their_prefix(engine):
    """Two requests of 3 seeded choices on one document at once: the first's choices share its prefill in the
    first step (no sibling held back), the second request waits a step and its leader then hits the document; its
    own siblings share its prefill as before. Every choice gives its tokens without a cache."""
    spec, model = engine
    document, questions = _document_questions(spec.vocab_size, seed=5, doc=3 * BLOCK_TOKENS + 4, questions=2)
    prompts = [document + q for q in questions]
    recording, metrics, gens, first = _burst(model, spec, prompts, SEEDED, n=3)
    assert first == 3 and metrics.held_back == 1
    assert [g.prefill_from for g in gens[:3]] == [None, gens[0], gens[0]]
    assert gens[3].prefix_hit == 3 * BLOCK_TOKENS and not any(g.held_back for g in gens[1:3] + gens[4:])
    plain = Scheduler(model, KVSlots(spec, 12, 1 << 28), None, spec.eos_token_ids)
    alone = []
    for prompt in prompts:
        alone += plain.submit_all(_choices(prompt, SEEDED, 3))
        run_to_end(plain)
    assert [g.generated for g in gens] == [g.generated for g in alone]


def test_off_by_default_in_the_scheduler_and_preemption_keeps_nothing(engine):
    spec, model = engine
    sched = Scheduler(model, KVSlots(spec, 2, 1 << 26), None, spec.eos_token_ids)
    g = sched.submit(Generation(list(range(3, 60)), GREEDY, lambda g, e: None))
    run_to_end(sched)
    assert g.prefix_hit == 0 and sched.slots.usage().cached_slots == 0


# --------------------------------------------------------------------------- every family of the zoo

@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(ZOO_VARIANTS))
def test_every_family_gives_the_same_tokens_with_a_hit(variant, tmp_path_factory):
    spec, model = zoo_engine(variant, tmp_path_factory)
    _check_hits_equal_misses(model, spec)


@pytest.mark.slow
def test_an_int8_cache_on_the_factorys_kernel_gives_the_same_tokens_with_a_hit(tiny_llm):
    """INT4 weights (batch-independent) and the INT8 KV cache, its attention on the factory's kernel: the continued
    prompt reads the cached INT8 keys as a whole prefill would."""
    spec, model = int8_kernel_engine(tiny_llm[0])
    _check_hits_equal_misses(model, spec)
