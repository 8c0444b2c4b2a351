"""Chunked prefill (generation/chunked_prefill.py): a long prompt prefilled in chunks beside the running sequences'
decode gives the tokens of a whole prefill (greedy and seeded), each step launches at most the budget's prompt
tokens while the running sequences keep decoding, and it composes with the prefix cache, n choices, cancellation
mid-prefill (memory freed) and preemption; on every family of the zoo, a sliding window crossed by the chunks too."""

from __future__ import annotations

import dataclasses
import random

import pytest

from model_factory.backend.batching.grouping import CostModel
from model_factory.backend.generation.causal_lm import CausalLM
from model_factory.backend.generation.chunked_prefill import (AUTO_MAX, AUTO_MIN, AUTO_WHOLE_CHUNKS, MIN_CHUNK,
                                                                chunk_tokens, whole_below)
from model_factory.backend.generation.kv_slots import KVSlots
from model_factory.backend.generation.prefix_cache import BLOCK_TOKENS, PrefixCache, identity
from model_factory.backend.generation.sampling import SamplingParams, choice_seed
from model_factory.backend.generation.scheduler import Generation, NullMetrics, Scheduler

from tests.generative_repository import ZOO_VARIANTS, run_to_end, zoo_engine

GREEDY = SamplingParams(max_tokens=10, min_tokens=10)
SEEDED = SamplingParams(max_tokens=10, min_tokens=10, temperature=0.9, top_k=40, seed=5)


# --------------------------------------------------------------------------- the budget


def test_auto_takes_the_chunk_whose_work_is_one_launchs_fixed_cost_and_off_is_zero():
    # b L = a: L = 1e-3 / 1e-5 = 100 tokens, rounded down to whole blocks of MIN_CHUNK.
    assert chunk_tokens("auto", CostModel(1e-3, 1e-5, 0.0), 2048) == 96
    # With a quadratic term: b L + c L^2 = a.
    assert chunk_tokens("auto", CostModel(1e-3, 1e-6, 1e-8), 2048) == 256  # L = 270
    assert chunk_tokens("auto", CostModel(1.0, 1e-6, 0.0), 2048) == AUTO_MAX  # launches dear, tokens cheap
    assert chunk_tokens("auto", CostModel(1e-6, 1e-3, 0.0), 2048) == AUTO_MIN  # never chunks of a few tokens
    assert chunk_tokens("auto", CostModel(1.0, 1e-6, 0.0), 128) == 128  # a launch holds max_prefill_tokens
    assert chunk_tokens("auto", CostModel(1.0, 0.0, 0.0), 2048) == AUTO_MAX
    assert chunk_tokens(0, CostModel(1e-3, 1e-5, 0.0), 2048) == 0 and chunk_tokens(200, None, 2048) == 200


# --------------------------------------------------------------------------- on the real graph


class _Recording:
    """The engine, with every launch recorded: prefills (rows' new tokens, cached) and decodes (rows)."""

    def __init__(self, model):
        self.model, self.launches = model, []

    def prefill(self, contexts, views, past=None):
        self.launches.append(("prefill", [len(c) for c in contexts], list(past or [0] * len(contexts))))
        return self.model.prefill(contexts, views, past=past)

    def decode(self, tokens, lengths, views):
        self.launches.append(("decode", len(tokens), None))
        return self.model.decode(tokens, lengths, views)


class _Chunks(NullMetrics):
    def __init__(self):
        self.chunks, self.steps = 0, 0

    def prefill_chunks(self, chunks: int) -> None:
        self.chunks += chunks
        self.steps += 1


def _alone(model, spec, prompt, params) -> list[int]:
    """The tokens of ``prompt`` prefilled whole (chunked prefill off), alone."""
    sched = Scheduler(model, KVSlots(spec, 2, 1 << 30), None, spec.eos_token_ids)
    g = sched.submit(Generation(list(prompt), params, lambda g, e: None))
    run_to_end(sched)
    return g.generated


def _prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _decoding(sched: Scheduler, tokens: int = 400) -> Generation:
    """A stream decoding (with none, there is nothing to keep level and prompts are prefilled whole)."""
    stream = sched.submit(Generation([5, 6, 7], SamplingParams(max_tokens=tokens, min_tokens=tokens),
                                     lambda g, e: None))
    sched.step()
    return stream


@pytest.fixture(scope="module")
def engine(tiny_llm):
    from tests.generative_repository import generation_spec

    hf, onnx_dir = tiny_llm
    return generation_spec(hf, {}), CausalLM(onnx_dir / "model.onnx", threads=1, pad_token_id=0)


def _check_chunked_equals_whole(model, spec, chunk: int, long: int = 300) -> _Recording:
    """Streams decoding while long prompts arrive, chunked: every request's tokens are its tokens alone and whole,
    no prefill launch holds more than ``chunk`` prompt tokens, and the running streams get a token every step."""
    rng = random.Random(1)
    recording = _Recording(model)
    metrics = _Chunks()
    sched = Scheduler(recording, KVSlots(spec, 8, 1 << 30), None, spec.eos_token_ids, chunk_tokens=chunk,
                      metrics=metrics)
    streams = [sched.submit(Generation(_prompt(rng, spec.vocab_size, 5 + i), SamplingParams(
        max_tokens=60, min_tokens=60), lambda g, e: None)) for i in range(3)]
    sched.step()
    sched.step()
    longs = [sched.submit(Generation(_prompt(rng, spec.vocab_size, long + 7 * i), params, lambda g, e: None))
             for i, params in enumerate((GREEDY, SEEDED))]
    before = {id(s): len(s.generated) for s in streams}
    steps = 0
    while any(g.cached == 0 or g.prefilling for g in longs):
        sched.step()
        steps += 1
        # Every stream got its token in this step: the long prompts' prefill holds no one still.
        assert all(len(s.generated) == before[id(s)] + steps for s in streams)
    assert steps >= 2 * long // chunk  # the long prompts took several steps
    run_to_end(sched)
    prefills = [(rows, past) for kind, rows, past in recording.launches if kind == "prefill"]
    assert all(sum(rows) <= chunk for rows, _ in prefills[1:])  # the first: the streams' three prompts, whole
    assert any(past[0] for _, past in prefills)  # chunks continued from their cached tokens
    assert metrics.chunks >= 2 * long // chunk and metrics.steps >= long // chunk
    for g in streams + longs:
        assert g.generated == _alone(model, spec, g.prompt, g.params)
    assert sched.slots.active == 0 and sched.slots.usage().reserved_bytes == 0
    return recording


def test_chunked_prompts_give_the_tokens_of_a_whole_prefill_while_the_streams_decode(engine):
    spec, model = engine
    _check_chunked_equals_whole(model, spec, chunk=64)


def test_a_chunk_of_any_size_gives_the_same_tokens(engine):
    spec, model = engine
    rng = random.Random(4)
    prompt = _prompt(rng, spec.vocab_size, 150)
    whole = _alone(model, spec, prompt, SEEDED)
    for chunk in (MIN_CHUNK, 17, 100, 149, 150, 1000):
        sched = Scheduler(model, KVSlots(spec, 2, 1 << 30), None, spec.eos_token_ids, chunk_tokens=chunk)
        stream = _decoding(sched, tokens=160)
        g = sched.submit(Generation(list(prompt), SEEDED, lambda g, e: None))
        sched.step()
        assert g.cached == min(chunk, len(prompt))
        run_to_end(sched)
        assert g.generated == whole, chunk
        assert stream.generated == _alone(model, spec, stream.prompt, stream.params)


def test_with_no_stream_decoding_prompts_are_prefilled_whole(engine):
    """Nothing decodes: no stream to keep level, so new prompts (and one left mid-prefill when the streams ended)
    are prefilled whole, as with chunking off: fresh prompts arriving together lose nothing to chunking."""
    spec, model = engine
    rng = random.Random(9)
    recording = _Recording(model)
    sched = Scheduler(recording, KVSlots(spec, 8, 1 << 30), None, spec.eos_token_ids, chunk_tokens=32)
    fresh = [sched.submit(Generation(_prompt(rng, spec.vocab_size, 100), GREEDY, lambda g, e: None))
             for _ in range(4)]
    sched.step()
    assert recording.launches == [("prefill", [100] * 4, [0] * 4)] and all(len(g.generated) == 1 for g in fresh)
    run_to_end(sched)
    stream = _decoding(sched, tokens=3)
    long = sched.submit(Generation(_prompt(rng, spec.vocab_size, 200), GREEDY, lambda g, e: None))
    sched.step()
    assert long.prefilling and long.cached == 32
    while len(stream.generated) < 3:
        sched.step()
    before = long.cached
    sched.step()  # the stream ended: the rest of the long prompt in one launch
    assert 0 < before < 200 - 32 and not long.prefilling and long.generated
    assert recording.launches[-1] == ("prefill", [200 - before], [before])
    run_to_end(sched)
    for g in fresh + [long]:
        assert g.generated == _alone(model, spec, g.prompt, g.params)


def test_short_prompts_take_what_the_budget_leaves_and_wait_for_the_rest(engine):
    """A step's budget: a long prompt's first chunk, then the short ones arriving behind it wait (holding no memory)
    until the chunks leave room; every one ends with its tokens."""
    spec, model = engine
    rng = random.Random(2)
    recording = _Recording(model)
    sched = Scheduler(recording, KVSlots(spec, 8, 1 << 30), None, spec.eos_token_ids, chunk_tokens=48)
    stream = _decoding(sched)
    recording.launches.clear()
    long = sched.submit(Generation(_prompt(rng, spec.vocab_size, 200), GREEDY, lambda g, e: None))
    shorts = [sched.submit(Generation(_prompt(rng, spec.vocab_size, 20), GREEDY, lambda g, e: None))
              for _ in range(4)]
    sched.step()
    assert long.prefilling and long.cached == 48 and all(s.slot is None for s in shorts)
    assert sched.slots.active == 2  # the stream and the long one: the waiting hold no reservation
    run_to_end(sched)
    assert all(sum(rows) <= 48 for kind, rows, _ in recording.launches if kind == "prefill")
    for g in [long, stream] + shorts:
        assert g.generated == _alone(model, spec, g.prompt, g.params)


def test_n_choices_wait_for_their_leaders_last_chunk_and_share_it(engine):
    spec, model = engine
    rng = random.Random(3)
    prompt = _prompt(rng, spec.vocab_size, 130)
    params = dataclasses.replace(SEEDED, logprobs=None)
    recording = _Recording(model)
    sched = Scheduler(recording, KVSlots(spec, 8, 1 << 30), None, spec.eos_token_ids, chunk_tokens=32)
    _decoding(sched)
    recording.launches.clear()
    gens = []
    for i in range(3):
        gens.append(Generation(list(prompt), dataclasses.replace(params, seed=choice_seed(params.seed, i)),
                               lambda g, e: None, index=i, leader=gens[0] if gens else None))
    sched.submit_all(gens)
    run_to_end(sched)
    # One prompt prefilled, in chunks: the siblings copied the leader's keys and values.
    assert sum(rows[0] for kind, rows, _ in recording.launches if kind == "prefill") == len(prompt)
    assert [g.generated for g in gens] == [_alone(model, spec, prompt, g.params) for g in gens]


def test_a_prompt_cancelled_mid_prefill_frees_its_memory_and_the_others_go_on(engine):
    spec, model = engine
    rng = random.Random(5)
    gone = {"now": False}
    sched = Scheduler(model, KVSlots(spec, 4, 1 << 30), None, spec.eos_token_ids, chunk_tokens=32,
                      cancel_check_s=0.0)
    stream = sched.submit(Generation(_prompt(rng, spec.vocab_size, 6), GREEDY, lambda g, e: None))
    sched.step()
    long = sched.submit(Generation(_prompt(rng, spec.vocab_size, 300), SamplingParams(max_tokens=50), lambda g, e:
                                   None, is_cancelled=lambda: gone["now"]))
    sched.step()
    sched.step()
    assert long.prefilling and 0 < long.cached < 300
    reserved = sched.slots.usage().reserved_bytes
    gone["now"] = True
    sched.step()
    assert long.finish_reason == "cancelled" and long.slot is None and not long.generated
    assert sched.slots.active == 1 and sched.slots.usage().reserved_bytes < reserved
    run_to_end(sched)
    assert stream.generated == _alone(model, spec, stream.prompt, GREEDY)
    assert sched.slots.usage().reserved_bytes == 0


def test_a_leader_cancelled_mid_prefill_leaves_its_siblings_to_prefill_themselves(engine):
    spec, model = engine
    rng = random.Random(6)
    prompt = _prompt(rng, spec.vocab_size, 120)
    gone = {"now": False}
    sched = Scheduler(model, KVSlots(spec, 4, 1 << 30), None, spec.eos_token_ids, chunk_tokens=32,
                      cancel_check_s=0.0)
    _decoding(sched)
    leader = Generation(list(prompt), GREEDY, lambda g, e: None, is_cancelled=lambda: gone["now"])
    sibling = Generation(list(prompt), SEEDED, lambda g, e: None, index=1, leader=leader)
    sched.submit_all([leader, sibling])
    sched.step()
    assert sibling.prefilling and sibling.prefill_from is leader
    gone["now"] = True
    run_to_end(sched)
    assert leader.finish_reason == "cancelled" and sibling.generated == _alone(model, spec, prompt, SEEDED)


def test_prefix_cache_hits_continue_in_chunks_with_the_same_tokens(engine):
    spec, model = engine
    rng = random.Random(7)
    document = _prompt(rng, spec.vocab_size, 200)
    recording = _Recording(model)
    sched = Scheduler(recording, KVSlots(spec, 4, 1 << 30), None, spec.eos_token_ids, chunk_tokens=48,
                      prefix_cache=PrefixCache(identity(graph="chunked")))
    first = sched.submit(Generation(document + [7, 8], GREEDY, lambda g, e: None))
    run_to_end(sched)
    # The same document with a long new part: the hit, then its rest in chunks of at most 48 tokens.
    tail = _prompt(rng, spec.vocab_size, 130)
    _decoding(sched)
    recording.launches.clear()
    later = sched.submit(Generation(document + tail, SEEDED, lambda g, e: None))
    run_to_end(sched)
    assert later.prefix_hit == (len(document) + 1) // BLOCK_TOKENS * BLOCK_TOKENS
    prefills = [(rows, past) for kind, rows, past in recording.launches if kind == "prefill"]
    assert len(prefills) >= 3 and all(sum(rows) <= 48 for rows, _ in prefills)
    assert prefills[0][1] == [later.prefix_hit]
    assert first.generated == _alone(model, spec, first.prompt, GREEDY)
    assert later.generated == _alone(model, spec, later.prompt, SEEDED)
    # A third finds the second's prefix, cached as its chunks went: its document and tail.
    _decoding(sched, tokens=20)
    third = sched.submit(Generation(document + tail + [9], GREEDY, lambda g, e: None))
    run_to_end(sched)
    assert third.prefix_hit >= len(document) + len(tail) - BLOCK_TOKENS
    assert third.generated == _alone(model, spec, third.prompt, GREEDY)


def test_preemption_with_chunks_keeps_the_tokens_and_the_budget(engine):
    """A budget of about two long sequences, preemption on, long and short prompts arriving: every step holds the
    reservations within the budget, and every sequence ends with its tokens alone."""
    spec, model = engine
    clock = {"t": 0.0}
    rng = random.Random(8)
    one = KVSlots(spec, 1, 1 << 30).bytes_for(260)
    slots = KVSlots(spec, 6, 2 * one)
    sched = Scheduler(model, slots, None, spec.eos_token_ids, chunk_tokens=40, preemption_wait_s=0.2,
                      clock=lambda: clock["t"], max_waiting=64)
    gens = []
    for i in range(10):
        n = rng.choice((8, 200))
        gens.append(sched.submit(Generation(_prompt(rng, spec.vocab_size, n), SamplingParams(
            max_tokens=30, min_tokens=30, temperature=0.8, seed=i), lambda g, e: None)))
        for _ in range(rng.randrange(1, 6)):
            clock["t"] += 0.1
            sched.step()
            assert slots.usage().reserved_bytes <= slots.budget_bytes
    while sched.has_work():
        clock["t"] += 0.1
        sched.step()
        assert slots.usage().reserved_bytes <= slots.budget_bytes
    assert any(g.preemptions for g in gens)
    for g in gens:
        assert g.generated == _alone(model, spec, g.prompt, g.params)


# --------------------------------------------------------------------------- every family of the zoo

@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(ZOO_VARIANTS))
def test_every_family_gives_the_same_tokens_chunked(variant, tmp_path_factory):
    spec, model = zoo_engine(variant, tmp_path_factory)
    _check_chunked_equals_whole(model, spec, chunk=24, long=min(60, spec.max_context // 2 - 20))


def test_under_auto_short_prompts_arriving_behind_a_stream_are_prefilled_whole_and_grouped(engine):
    """``auto`` splits only prompts of more than AUTO_WHOLE_CHUNKS chunks: a burst of short prompts arriving behind a
    stream that already decodes is one grouped launch (as with the budget off), a long one behind them is chunked to
    its end."""
    spec, model = engine
    rng = random.Random(11)
    recording = _Recording(model)
    chunk = 32
    sched = Scheduler(recording, KVSlots(spec, 8, 1 << 30), None, spec.eos_token_ids, chunk_tokens=chunk,
                      whole_below=whole_below("auto", chunk))
    assert sched.whole_below == AUTO_WHOLE_CHUNKS * chunk and whole_below(48, 48) == 0 and whole_below("auto", 0) == 0
    stream = _decoding(sched)
    recording.launches.clear()
    shorts = [sched.submit(Generation(_prompt(rng, spec.vocab_size, 100), GREEDY, lambda g, e: None))
              for _ in range(3)]
    long = sched.submit(Generation(_prompt(rng, spec.vocab_size, AUTO_WHOLE_CHUNKS * chunk + 40), GREEDY,
                                   lambda g, e: None))
    sched.step()
    prefills = [rows for kind, rows, _ in recording.launches if kind == "prefill"]
    assert [100, 100, 100] in prefills, recording.launches
    assert all(len(s.generated) == 1 for s in shorts)
    assert long.cached == 0 or long.prefilling  # the long one: chunked, never whole in that step
    run_to_end(sched)
    # Its tail too, once shorter than AUTO_WHOLE_CHUNKS chunks: in chunks, never a launch of that many tokens.
    prefills = [rows for kind, rows, _ in recording.launches if kind == "prefill"]
    assert all(sum(rows) <= chunk for rows in prefills if rows != [100, 100, 100]), prefills
    for g in [stream, long] + shorts:
        assert g.generated == _alone(model, spec, g.prompt, g.params)


# --------------------------------------------------------------------------- the ITL budget (itl_budget.py)


class _Clocked(_Recording):
    """The launches on a virtual clock: a decode launch costs ``decode_s``, a prefill ``cost`` of its new tokens (one
    row: a chunk), so what the ITL budget predicts and what a step takes are known exactly."""

    def __init__(self, model, cost, decode_s):
        super().__init__(model)
        self.cost, self.decode_s, self.now = cost, decode_s, 0.0

    def clock(self) -> float:
        return self.now

    def prefill(self, contexts, views, past=None):
        self.now += sum(self.cost.cost(1, len(c)) for c in contexts)
        return super().prefill(contexts, views, past=past)

    def decode(self, tokens, lengths, views):
        self.now += self.decode_s
        return super().decode(tokens, lengths, views)


class _Steps(_Chunks):
    def __init__(self):
        super().__init__()
        self.chunk_tokens, self.predicted, self.measured = 0, 0.0, 0.0

    def chunked_step(self, tokens: int, predicted_s: float, measured_s: float) -> None:
        self.chunk_tokens += tokens
        self.predicted += predicted_s
        self.measured += measured_s


def test_the_itl_budget_keeps_each_step_within_the_ratio_of_the_decode_step_with_the_same_tokens(engine):
    """Streams decoding while long prompts arrive, the chunk sized by the ITL budget: every step takes at most twice the
    decode launch (the chunk fitted to the other half by the cost model), the long prompts advance every step (at
    least the floor), and every request's tokens are its tokens alone and whole; the predicted step time is the
    measured one when the model is exact."""
    from model_factory.backend.generation.itl_budget import ItlBudget

    spec, model = engine
    rng = random.Random(21)
    cost, decode_s = CostModel(0.02, 0.0005, 0.0), 0.04
    clocked, metrics, errors = _Clocked(model, cost, decode_s), _Steps(), []
    sched = Scheduler(clocked, KVSlots(spec, 8, 1 << 30), None, spec.eos_token_ids, chunk_tokens=64,
                      clock=clocked.clock, metrics=metrics, itl_budget=ItlBudget(cost, 2.0, ceiling=512),
                      log_error=errors.append)
    streams = [sched.submit(Generation(_prompt(rng, spec.vocab_size, 5 + i), SamplingParams(
        max_tokens=60, min_tokens=60), lambda g, e: None)) for i in range(3)]
    sched.step()
    sched.step()  # one decode launch timed
    longs = [sched.submit(Generation(_prompt(rng, spec.vocab_size, 200 + 9 * i), params, lambda g, e: None))
             for i, params in enumerate((GREEDY, SEEDED))]
    steps = 0
    while any(g.cached == 0 or g.prefilling for g in longs):
        cached, began, launches = sum(g.cached for g in longs), clocked.now, len(clocked.launches)
        head = next(g for g in longs if g.cached == 0 or g.prefilling)  # the oldest prompt still to prefill
        want = min(MIN_CHUNK, len(head.prompt) - head.cached)
        sched.step()
        steps += 1
        # The decode launch and the chunk: within 2x the decode launch.
        assert clocked.now - began <= 2 * decode_s + 1e-9, clocked.launches[launches:]
        chunks = [rows for kind, rows, _ in clocked.launches[launches:] if kind == "prefill"]
        assert chunks and all(sum(rows) <= 32 for rows in chunks)  # 20 ms + 0.5 ms x 32 <= 40 ms
        assert sum(g.cached for g in longs) - cached >= want  # at least the floor, or what that prompt had left
    assert steps >= (200 + 209) // 32
    run_to_end(sched)
    assert not errors and metrics.chunk_tokens == 200 + 209 and metrics.predicted == pytest.approx(metrics.measured)
    for g in streams + longs:
        assert g.generated == _alone(model, spec, g.prompt, g.params)


class _HeldBack(NullMetrics):
    def __init__(self):
        self.held_back = 0

    def prefix_held_back(self) -> None:
        self.held_back += 1


def test_a_burst_behind_a_split_prompt_takes_what_its_chunks_wrote(engine):
    """Two questions on a new 100-token document at once beside a stream, chunks of 48: the first is split, and the
    second waits behind it (the split prompt's group is the step's last; nothing to hold back), then is admitted when
    the budget allows with the blocks the first has written by then as its hit, each with its tokens alone."""
    spec, model = engine
    rng = random.Random(17)
    document = _prompt(rng, spec.vocab_size, 100)
    metrics = _HeldBack()
    sched = Scheduler(model, KVSlots(spec, 4, 1 << 30), None, spec.eos_token_ids, chunk_tokens=48, metrics=metrics,
                      prefix_cache=PrefixCache(identity(graph="chunked-burst")))
    _decoding(sched, tokens=60)
    first, second = (sched.submit(Generation(document + q, GREEDY, lambda g, e: None)) for q in ([7, 8], [9, 10, 11]))
    sched.step()
    assert first.prefilling and first.cached == 48 and second.slot is None
    run_to_end(sched)
    assert metrics.held_back == 0 and first.prefix_hit == 0
    assert second.prefix_hit == len(document) // BLOCK_TOKENS * BLOCK_TOKENS  # the document prefilled once
    assert first.generated == _alone(model, spec, first.prompt, GREEDY)
    assert second.generated == _alone(model, spec, second.prompt, GREEDY)


class _NoEmptyRows:
    """The engine, refusing a prefill row of no tokens (ONNX Runtime's attention fails on one: "sequence_length shall
    be 1 when it is not prompt")."""

    def __init__(self, model):
        self.model = model

    def prefill(self, contexts, views, past=None, **kw):
        assert all(contexts), f"a prefill row of no tokens: {[len(c) for c in contexts]}, past {past}"
        return self.model.prefill(contexts, views, past=past, **kw)

    def decode(self, *args, **kw):
        return self.model.decode(*args, **kw)


# Seeds 34, 57, 74 and 95 launched an empty chunk before the admission re-checked a prompt whose hit was gone.
@pytest.mark.parametrize("seed", [*range(12), 34, 57, 74, 95])
def test_bursts_over_cached_prefixes_under_a_tight_budget_never_launch_an_empty_chunk(engine, seed):
    """Repeated documents arriving in bursts while others decode, chunked, paged, the prefix cache's kept slots dropped
    for room: a prompt admitted for its hit whose holder was dropped (or whose hit was refused) is the whole prompt
    again, held to what is left of the step's budget, never a first chunk of nothing (what the served Gemma 3 270M
    answered 8 concurrent quoting requests with in a third round: "the engine failed")."""
    spec, model = engine
    rng = random.Random(seed)
    docs = [_prompt(rng, spec.vocab_size, rng.randrange(40, 200)) for _ in range(6)]
    errors: list[str] = []
    ticks = iter(range(10 ** 9))
    budget = KVSlots(spec, 8, 1 << 30).bytes_for(rng.choice([600, 900, 1500, 4000]))
    sched = Scheduler(_NoEmptyRows(model), KVSlots(spec, 8, budget, block_tokens=rng.choice([0, 16])), None,
                      spec.eos_token_ids, chunk_tokens=rng.choice([32, 48, 64]), whole_below=rng.choice([0, 16, 32]),
                      preemption_wait_s=rng.choice([0.0, 0.001]), clock=lambda: next(ticks) * 1e-4,
                      prefix_cache=PrefixCache(identity(graph=f"bursts-{seed}")), log_error=errors.append)
    gens = []
    for _ in range(4):
        for _ in range(rng.randrange(2, 9)):
            n = rng.randrange(2, 40)
            params = SamplingParams(max_tokens=n, min_tokens=n)
            gens.append(sched.submit(Generation(list(rng.choice(docs)), params, lambda g, e: None)))
            for _ in range(rng.randrange(0, 3)):
                if sched.has_work():
                    sched.step()
        run_to_end(sched)
    assert not errors, errors[:2]
    assert {g.finish_reason for g in gens} == {"length"}  # every request ran to its end
