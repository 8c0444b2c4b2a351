"""Paged KV admission (generation/kv_blocks.py, KVSlots with ``block_tokens``): the account in blocks, and the
scheduler on the real graph of a tiny Llama admitting by blocks, growing a block at a time and preempting when the
budget has none left, against whole reservations of ``prompt + max_tokens``."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from model_factory.backend.contract import GenerationSpec
from model_factory.backend.generation.causal_lm import CausalLM
from model_factory.backend.generation.kv_blocks import block_tokens, choose_victim
from model_factory.backend.generation.kv_slots import HostKVBuffers, KVSlots, KVUsage
from model_factory.backend.generation.prefix_cache import BLOCK_TOKENS, PrefixCache, identity
from model_factory.backend.generation.sampling import SamplingParams
from model_factory.backend.generation.scheduler import Generation, QueueFull, Scheduler
from tests.backend.test_generation_parts import SPEC
from tests.generative_repository import EndsAt, agree_until_tie, generation_spec, reference_greedy, run_to_end

BLOCK = BLOCK_TOKENS


@pytest.fixture(scope="module")
def engine(tiny_llm):
    hf, onnx_dir = tiny_llm
    spec = generation_spec(hf, {})
    return spec, CausalLM(onnx_dir / "model.onnx", threads=1, pad_token_id=0), hf


def _slots(spec: GenerationSpec, count: int, budget_tokens: int, paged: bool = True) -> KVSlots:
    """``count`` slots and a budget of ``budget_tokens`` tokens, counted exactly (not in pages: a token of the tiny
    model is 64 bytes a head row, so a page would hold 64 tokens and hide the blocks)."""
    storage = HostKVBuffers(spec, count, spec.max_context)
    storage.granule_bytes = 1
    return KVSlots(spec, count, budget_tokens * spec.kv_bytes_per_token, storage=storage,
                   block_tokens=block_tokens("paged" if paged else "reserve"))


def test_the_account_in_blocks():
    spec = GenerationSpec(**{**SPEC.__dict__, "max_context": 1024})
    slots = _slots(spec, 4, 10 * BLOCK)
    per = spec.kv_bytes_per_token
    assert slots.held(1) == BLOCK and slots.held(BLOCK) == BLOCK and slots.held(BLOCK + 1) == 2 * BLOCK
    # Admission reserves the context and the token its first decode writes, in blocks; never past prompt + max_tokens.
    assert slots.admission_tokens(reserved=200, context=20) == 2 * BLOCK
    assert slots.admission_tokens(reserved=10, context=8) == BLOCK
    assert slots.headroom_bytes(3) == 3 * BLOCK * per
    assert slots.headroom_bytes(1) == 0  # alone: nothing to keep room for
    a = slots.admit(slots.admission_tokens(200, 20))
    assert slots.grow(a, 21) and slots.usage().reserved_tokens == 2 * BLOCK  # inside its second block: no new one
    assert slots.grow(a, 2 * BLOCK + 1) and slots.usage().reserved_tokens == 3 * BLOCK
    usage = slots.usage()
    assert usage.blocks_used == 3 and usage.blocks_free == 7
    assert usage.fragmentation == pytest.approx(1 - (2 * BLOCK + 1) / (3 * BLOCK))
    b = slots.admit(7 * BLOCK)
    assert not slots.grow(a, 3 * BLOCK + 1)  # the budget is spent: refused, nothing changed
    assert slots.usage().reserved_tokens == 10 * BLOCK and slots.usage().blocks_free == 0
    slots.release(b)
    assert slots.usage().blocks_free == 7
    # Whole reservations: the reservation already covers what the sequence writes; only that is recorded.
    whole = KVSlots(spec, 2, 1 << 30)
    s = whole.admit(whole.admission_tokens(reserved=100, context=20))
    assert whole.usage().reserved_tokens == 100 and whole.grow(s, 21) and not whole.grow(s, 101)
    assert whole.usage().fragmentation == pytest.approx(1 - 21 / 100)
    assert whole.usage().blocks_used == 0 and whole.usage().blocks_free == 0
    assert KVUsage(0, 1, 0, 0, 10).fragmentation == 0.0


def _workload(spec, model, *, paged: bool, prompt: int, n: int, max_tokens: int, count: int, budget_tokens: int,
              slots: int = 32):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, spec.vocab_size) for _ in range(prompt)] for _ in range(count)]
    kv = _slots(spec, slots, budget_tokens, paged=paged)
    sched = Scheduler(EndsAt(model, spec.eos_token_ids[0], prompt, n), kv, None, spec.eos_token_ids,
                      max_waiting=count)
    gens = [sched.submit(Generation(p, SamplingParams(max_tokens=max_tokens, min_tokens=n - 1), lambda g, e: None))
            for p in prompts]

    def within_budget():
        usage = kv.usage()
        assert usage.reserved_bytes + usage.cached_bytes <= usage.budget_bytes

    peak = run_to_end(sched, within_budget)
    assert kv.active == 0 and kv.usage().reserved_tokens == 0
    return prompts, gens, peak


def test_paged_admission_runs_more_sequences_in_the_same_budget_with_the_same_tokens(engine):
    """Clients ask max_tokens 64, their texts end at 24 tokens: reserving prompt + max_tokens runs 4 at once in a budget
    of 4 such reservations; blocks run more than twice as many, every sequence with transformers' tokens."""
    spec, model, hf = engine
    prompt, n, max_tokens = 8, 24, 64
    budget = 4 * (prompt + max_tokens)
    peaks = {}
    for paged in (False, True):
        prompts, gens, peaks[paged] = _workload(spec, model, paged=paged, prompt=prompt, n=n, max_tokens=max_tokens,
                                                count=12, budget_tokens=budget)
        ref = reference_greedy(hf, prompts, [n - 1] * len(prompts))
        for gen, (want, tie) in zip(gens, ref):
            assert gen.finish_reason == "stop" and len(gen.generated) == n and gen.generated[-1] in spec.eos_token_ids
            assert agree_until_tie(gen.generated[:-1], want, tie), (gen.generated, want, tie)
    assert peaks[False] == 4
    assert peaks[True] >= 2 * peaks[False], peaks


def test_a_sequence_that_outgrows_the_budget_is_preempted_and_resumes_with_the_same_tokens(engine):
    """Three sequences admitted for their first blocks in a budget that holds two at their full length: when the
    next block cannot be had the youngest (most tokens left) is preempted, resumes later, and every sequence gives
    transformers' tokens; nothing is ever reserved past the budget (checked each step)."""
    spec, model, hf = engine
    prompt, tokens = 8, 40
    per = 3 * BLOCK  # 8 + 40 tokens: three blocks
    prompts, gens, peak = _workload(spec, model, paged=True, prompt=prompt, n=tokens + 1, max_tokens=tokens,
                                    count=3, budget_tokens=2 * per)
    assert peak == 3
    assert sum(g.preemptions for g in gens) >= 1 and gens[2].preemptions >= 1
    ref = reference_greedy(hf, prompts, [tokens] * 3)
    for gen, (want, tie) in zip(gens, ref):
        assert gen.finish_reason == "length" and agree_until_tie(gen.generated, want, tie), (gen.generated, want)


def test_cancellation_returns_a_sequences_blocks(engine):
    spec, model, _ = engine
    kv = _slots(spec, 4, 20 * BLOCK)
    sched = Scheduler(model, kv, None, spec.eos_token_ids, cancel_check_s=0.0)
    gone = {"now": False}
    params = SamplingParams(max_tokens=60, min_tokens=60)
    first = sched.submit(Generation(list(range(3, 23)), params, lambda g, e: None, is_cancelled=lambda: gone["now"]))
    other = sched.submit(Generation([5, 6, 7], params, lambda g, e: None))
    for _ in range(3):
        sched.step()
    held = kv.usage()
    assert held.blocks_used == 2 + 1 and held.reserved_tokens == 3 * BLOCK
    gone["now"] = True
    sched.step()
    assert first.finish_reason == "cancelled" and first.slot is None
    after = kv.usage()
    assert after.blocks_used == 1 and after.blocks_free == held.blocks_free + 2
    run_to_end(sched)
    assert len(other.generated) == 60 and kv.usage().blocks_used == 0


def test_a_full_queue_is_refused_when_paged(engine):
    spec, model, _ = engine
    sched = Scheduler(model, _slots(spec, 1, 8 * BLOCK), None, spec.eos_token_ids, max_waiting=1)
    for _ in range(2):  # one for the free slot, one waiting
        sched.submit(Generation([5], SamplingParams(max_tokens=3), lambda g, e: None))
    with pytest.raises(QueueFull, match="retry after"):
        sched.submit(Generation([5], SamplingParams(max_tokens=3), lambda g, e: None))


def test_a_prefix_cache_hit_taken_over_counts_its_blocks_once(engine):
    """A finished sequence's slot kept for its prefix, then taken over in place by a prompt sharing it: the shared
    blocks are counted once (the kept prefix no longer counts; the new sequence's blocks cover them)."""
    spec, model, _ = engine
    kv = _slots(spec, 4, 32 * BLOCK)
    sched = Scheduler(model, kv, None, spec.eos_token_ids, prefix_cache=PrefixCache(identity(graph="paged")))
    document = [random.Random(5).randrange(3, spec.vocab_size) for _ in range(40)]
    params = SamplingParams(max_tokens=4, min_tokens=4)
    sched.submit(Generation(document + [7], params, lambda g, e: None))
    run_to_end(sched)
    kept = kv.usage()
    assert kept.cached_slots == 1 and kept.blocks_used == kept.cached_tokens // BLOCK == 3  # 44 tokens kept
    second = sched.submit(Generation(document + [9, 10], params, lambda g, e: None))
    sched.step()
    assert second.prefix_hit == 2 * BLOCK
    usage = kv.usage()
    assert usage.cached_slots == 0 and usage.cached_tokens == 0
    assert usage.blocks_used == usage.reserved_tokens // BLOCK == kv.held(len(second.prompt) + 1) // BLOCK == 3


def test_a_sequence_alone_fills_the_whole_budget(engine):
    """A budget of exactly one sequence's prompt + max_tokens: admitted paged (no room kept for others) and finished."""
    spec, model, _ = engine
    kv = _slots(spec, 2, 2 * BLOCK)
    sched = Scheduler(model, kv, None, spec.eos_token_ids)
    gen = sched.submit(Generation(list(range(3, 23)), SamplingParams(max_tokens=12, min_tokens=12), lambda g, e: None))
    run_to_end(sched)
    assert gen.finish_reason == "length" and len(gen.generated) == 12 and gen.preemptions == 0


def test_a_preemptions_victim_frees_memory_and_is_otherwise_the_one_with_the_most_tokens_left():
    """``choose_victim``: in a pool of blocks a sequence whose blocks another holds frees nothing, so the one that
    frees is taken though others have more tokens left; when none frees, the order as before (the block's
    preemption) or none (the preemption for a waiting request). In slots every release frees: the order alone."""
    from tests.backend.test_kv_pool import _account

    def key(gen):
        return gen.left, gen.arrival

    for blocks in (False, True):
        kv = _account(blocks, 4, 100)
        x = SimpleNamespace(slot=kv.admit(32), left=23, arrival=1)
        y = SimpleNamespace(slot=kv.admit(32, source=(x.slot, 32)), left=23, arrival=2)  # a pool: x's 2 blocks
        z = SimpleNamespace(slot=kv.admit(20), left=7, arrival=3)
        if blocks:
            assert [kv.freed_by_release(g.slot) for g in (x, y)] == [0, 0] and kv.freed_by_release(z.slot) > 0
            assert choose_victim([x, y, z], kv, key) is z
            assert choose_victim([x, y], kv, key) is y  # none frees: the most tokens left, the youngest of equals
            assert choose_victim([x, y], kv, key, last_resort=False) is None
        else:
            for among in ([x, y, z], [x, y]):
                for last_resort in (True, False):
                    assert choose_victim(among, kv, key, last_resort=last_resort) is y
