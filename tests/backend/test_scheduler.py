"""The scheduler on the real graph (onnxruntime-genai's builder output of a tiny Llama), without Triton:
continuous batching, compaction and admission by memory give transformers' greedy tokens."""

from __future__ import annotations

import random

import numpy as np
import pytest

from model_factory.backend.generation.causal_lm import CausalLM
from model_factory.backend.contract import GenerationSpec
from model_factory.backend.generation.kv_slots import KVSlots
from model_factory.backend.generation.sampling import SamplingError, SamplingParams
from model_factory.backend.generation.scheduler import Generation, QueueFull, Scheduler
from tests.generative_repository import agree_until_tie, generation_spec, reference_greedy


@pytest.fixture(scope="module")
def engine(tiny_llm):
    hf, onnx_dir = tiny_llm
    spec = generation_spec(hf, {})
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    return spec, CausalLM(onnx_dir / "model.onnx", threads=1, pad_token_id=0), tok, hf


def _run_all(sched: Scheduler, gens: list[Generation], limit: int = 10_000) -> None:
    for _ in range(limit):
        if not sched.has_work():
            return
        sched.step()
    raise AssertionError("the scheduler did not finish")


def _collector():
    events: dict[int, list] = {}

    def emit(gen, event):
        events.setdefault(id(gen), []).append(event)

    return events, emit


def test_sixteen_mixed_sequences_match_transformers_through_admission_and_compaction(engine):
    spec, model, tok, hf = engine
    rng = random.Random(0)
    prompts = [[rng.randrange(3, spec.vocab_size) for _ in range(rng.randrange(1, 40))] for _ in range(16)]
    max_tokens = [rng.randrange(1, 24) for _ in range(16)]
    # 5 slots and a budget for about 3 long sequences: admission waits, finished slots are compacted.
    slots = KVSlots(spec, 5, budget_bytes=KVSlots(spec, 1, 1 << 30).bytes_for(64) * 3)
    events, emit = _collector()
    sched = Scheduler(model, slots, tok, spec.eos_token_ids, max_waiting=16)
    gens = [sched.submit(Generation(p, SamplingParams(max_tokens=n, min_tokens=n), emit))
            for p, n in zip(prompts, max_tokens)]
    peak = 0
    while sched.has_work():
        sched.step()
        peak = max(peak, slots.active)
        assert slots.usage().reserved_bytes <= slots.budget_bytes
    assert 1 < peak <= 5
    ref = reference_greedy(hf, prompts, max_tokens)
    ties = 0
    for gen, (want, tie) in zip(gens, ref):
        assert len(gen.generated) == len(want)
        assert agree_until_tie(gen.generated, want, tie), (gen.generated, want, tie)
        ties += tie is not None
        assert events[id(gen)][-1].finish_reason == "length"
    assert ties <= 3
    assert slots.active == 0 and slots.usage().reserved_bytes == 0


def test_streamed_text_is_the_decoded_tokens(engine):
    spec, model, tok, _ = engine
    events, emit = _collector()
    sched = Scheduler(model, KVSlots(spec, 4, 1 << 26), tok, spec.eos_token_ids)
    prompt = tok.encode("Permission is hereby granted").ids
    gen = sched.submit(Generation(prompt, SamplingParams(max_tokens=30, min_tokens=30), emit))
    _run_all(sched, [gen])
    text = "".join(e.text for e in events[id(gen)])
    assert text == tok.decode(gen.generated, skip_special_tokens=True)
    assert "\ufffd" not in "".join(e.text for e in events[id(gen)][:-1]) or text.count("\ufffd") >= 1


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    spec, model, tok, _ = engine
    params = SamplingParams(max_tokens=20, min_tokens=20, temperature=0.9, top_k=50, top_p=0.9, seed=1234)
    outs = []
    for company in (0, 5):
        _, emit = _collector()
        sched = Scheduler(model, KVSlots(spec, 8, 1 << 26), tok, spec.eos_token_ids)
        target = sched.submit(Generation([5, 6, 7, 8], params, emit))
        for k in range(company):
            sched.submit(Generation([9 + k] * (k + 2), SamplingParams(max_tokens=7, temperature=1.0, seed=k), emit))
        _run_all(sched, [target])
        outs.append(target.generated)
    assert outs[0] == outs[1]
    other = SamplingParams(max_tokens=20, min_tokens=20, temperature=0.9, top_k=50, top_p=0.9, seed=4321)
    _, emit = _collector()
    sched = Scheduler(model, KVSlots(spec, 8, 1 << 26), tok, spec.eos_token_ids)
    g = sched.submit(Generation([5, 6, 7, 8], other, emit))
    _run_all(sched, [g])
    assert g.generated != outs[0]


def test_cancelled_sequence_frees_its_slot_at_the_next_step(engine):
    spec, model, tok, _ = engine
    events, emit = _collector()
    sched = Scheduler(model, KVSlots(spec, 4, 1 << 26), tok, spec.eos_token_ids, cancel_check_s=0.0)
    cancelled = {"now": False}
    gen = sched.submit(Generation([5, 6, 7], SamplingParams(max_tokens=50, min_tokens=50), emit,
                                  is_cancelled=lambda: cancelled["now"]))
    other = sched.submit(Generation([8, 9], SamplingParams(max_tokens=10, min_tokens=10), emit))
    sched.step()
    sched.step()
    assert sched.slots.active == 2
    cancelled["now"] = True
    sched.step()
    assert gen.finish_reason == "cancelled" and sched.slots.active == 1
    assert sched.running == [other] and other.slot == 0
    _run_all(sched, [other])
    assert len(other.generated) == 10


def test_waiting_queue_is_bounded(engine):
    spec, model, tok, _ = engine
    _, emit = _collector()
    sched = Scheduler(model, KVSlots(spec, 1, 1 << 26), tok, spec.eos_token_ids, max_waiting=2)
    for _ in range(3):  # one for the free slot, two waiting
        sched.submit(Generation([5], SamplingParams(max_tokens=3), emit))
    with pytest.raises(QueueFull, match="retry after"):
        sched.submit(Generation([5], SamplingParams(max_tokens=3), emit))
    sched.step()  # one runs, two wait: still full
    assert len(sched.running) == 1 and len(sched.waiting) == 2
    with pytest.raises(QueueFull):
        sched.submit(Generation([5], SamplingParams(max_tokens=3), emit))
    # No waiting at all: a request is taken while a slot is free, and refused while none is.
    alone = Scheduler(model, KVSlots(spec, 1, 1 << 26), tok, spec.eos_token_ids, max_waiting=0)
    alone.submit(Generation([5], SamplingParams(max_tokens=3), emit))
    with pytest.raises(QueueFull):
        alone.submit(Generation([5], SamplingParams(max_tokens=3), emit))


def test_preempted_sequence_resumes_with_the_same_tokens(engine):
    spec, model, tok, hf = engine
    clock = {"t": 0.0}
    events, emit = _collector()
    one = KVSlots(spec, 2, 1 << 30).bytes_for(40)
    sched = Scheduler(model, KVSlots(spec, 2, one), tok, spec.eos_token_ids, preemption_wait_s=0.2,
                      clock=lambda: clock["t"])
    first = sched.submit(Generation([5, 6, 7, 8], SamplingParams(max_tokens=30, min_tokens=30), emit))
    for _ in range(3):
        sched.step()
    clock["t"] = 1.0
    second = sched.submit(Generation([9, 10, 11], SamplingParams(max_tokens=8, min_tokens=8), emit))
    sched.step()  # second waits: no memory
    clock["t"] = 1.1
    sched.step()
    clock["t"] = 1.5
    assert second.slot is None and first.preemptions == 0
    sched.step()  # waited 0.5 s > 0.2 s: first (the most tokens left) is preempted, second admitted
    assert first.preemptions == 1 and second.slot is not None
    _run_all(sched, [first, second])
    ref = reference_greedy(hf, [first.prompt, second.prompt], [30, 8])
    assert agree_until_tie(first.generated, *ref[0]) and agree_until_tie(second.generated, *ref[1])


def test_preemption_never_admits_past_the_budget_whatever_the_arrivals(engine):
    """Long and short sequences arriving at random under a budget of three long ones, preemption on: every step keeps
    the reservations within the budget (the ones chosen earlier in a step that preempts included), and every sequence
    ends with all its tokens."""
    spec, model, tok, _ = engine
    clock = {"t": 0.0}
    unit = KVSlots(spec, 1, 1 << 30).bytes_for(24)
    slots = KVSlots(spec, 8, 3 * unit)
    sched = Scheduler(model, slots, tok, spec.eos_token_ids, preemption_wait_s=0.2, max_waiting=64,
                      clock=lambda: clock["t"])
    rng = random.Random(7)
    gens = []
    for step in range(400):
        if step < 120 and rng.random() < 0.3:
            n = rng.choice([4, 20])  # a short one, or one holding a whole unit
            gens.append(sched.submit(Generation([rng.randrange(3, 200) for _ in range(4)],
                                                SamplingParams(max_tokens=n, min_tokens=n), lambda g, e: None)))
        sched.step()
        assert slots.usage().reserved_bytes <= slots.budget_bytes
        clock["t"] += 0.1
        if step >= 120 and not sched.has_work():
            break
    assert not sched.has_work() and any(g.preemptions for g in gens)
    assert all(g.finish_reason == "length" and len(g.generated) == g.params.max_tokens for g in gens)


def test_an_admission_that_fails_midway_loses_no_sequence(engine, monkeypatch):
    """Should the slots refuse a sequence the step chose (never expected), those not admitted wait again at the head
    of the queue, in order, the admitted ones are prefilled, and every sequence ends with all its tokens."""
    from model_factory.backend.generation.kv_slots import AdmissionError

    spec, model, tok, _ = engine
    slots = KVSlots(spec, 8, 1 << 30)
    errors: list[str] = []
    sched = Scheduler(model, slots, tok, spec.eos_token_ids, log_error=errors.append)
    gens = [sched.submit(Generation([5 + i, 6, 7], SamplingParams(max_tokens=6, min_tokens=6), lambda g, e: None))
            for i in range(5)]
    real_admit, calls = slots.admit, {"n": 0}

    def admit_refusing_the_third(tokens, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise AdmissionError("refused for the test")
        return real_admit(tokens, **kw)

    monkeypatch.setattr(slots, "admit", admit_refusing_the_third)
    sched.step()
    assert [g.slot is not None for g in gens] == [True, True, False, False, False]
    assert list(sched.waiting) == gens[2:] and len(errors) == 1 and "admission stopped short" in errors[0]
    assert all(len(g.generated) == 1 for g in gens[:2])  # the admitted ones were prefilled: their first token
    _run_all(sched, gens)
    assert all(g.finish_reason == "length" and len(g.generated) == 6 for g in gens)


def test_grouping_by_max_tokens_admits_the_smallest_bucket_first_until_one_waited_the_bound(engine):
    """With max_tokens_grouping_s set, waiting requests are taken by power-of-two bucket of max_tokens (the smallest
    first, arrival order within one), and a request that waited the bound goes first; off, arrival order holds."""
    spec, model, tok, _ = engine
    unit = KVSlots(spec, 1, 1 << 30).bytes_for(4 + 20)

    def run(grouping_s: float) -> list[str]:
        clock = {"t": 0.0}
        admitted: list[str] = []
        sched = Scheduler(model, KVSlots(spec, 8, unit), tok, spec.eos_token_ids, max_waiting=16,
                          max_tokens_grouping_s=grouping_s, clock=lambda: clock["t"])

        def submit(name: str, n: int) -> Generation:
            def emit(gen, event, name=name):
                if len(gen.generated) == 1 and event.token is not None:
                    admitted.append(name)
            return sched.submit(Generation([5, 6, 7, 8], SamplingParams(max_tokens=n, min_tokens=n), emit))

        gens = [submit("running", 20)]  # holds the whole budget
        sched.step()
        for name, n in (("long-a", 20), ("short-a", 3), ("mid", 9), ("short-b", 2)):
            clock["t"] += 0.1
            gens.append(submit(name, n))
        while sched.has_work():
            sched.step()
            clock["t"] += 0.01
        assert all(len(g.generated) == g.params.max_tokens for g in gens)
        return admitted

    # Off: arrival order (the long one blocks those behind it until the budget frees).
    assert run(0.0) == ["running", "long-a", "short-a", "mid", "short-b"]
    # Grouped, a bound none reaches: the buckets of 2 and 3 (2 bits), then 9 (4 bits), then 20 (5 bits).
    assert run(60.0) == ["running", "short-a", "short-b", "mid", "long-a"]
    # Grouped, a bound every waiting request reaches before the budget frees: arrival order again.
    assert run(0.05) == ["running", "long-a", "short-a", "mid", "short-b"]


class _CountingModel:
    """The engine, with the contexts each prefill launched recorded."""

    def __init__(self, model):
        self.model, self.prefilled = model, []

    def prefill(self, contexts, views):
        self.prefilled.append([len(c) for c in contexts])
        return self.model.prefill(contexts, views)

    def decode(self, *args):
        return self.model.decode(*args)


def _siblings(prompt, params, n, emit):
    import dataclasses

    from model_factory.backend.generation.sampling import choice_seed

    gens = []
    for i in range(n):
        gens.append(Generation(list(prompt), dataclasses.replace(params, seed=choice_seed(params.seed, i)), emit,
                               index=i, leader=gens[0] if gens else None))
    return gens


def test_n_choices_share_one_prefill_and_equal_each_choice_run_alone(engine):
    spec, model, tok, _ = engine
    prompt = [5, 6, 7, 8, 9, 10, 11]
    for params in (SamplingParams(max_tokens=12, min_tokens=12),
                   SamplingParams(max_tokens=12, min_tokens=12, temperature=0.9, top_k=40, seed=77, logprobs=2)):
        counting = _CountingModel(model)
        events, emit = _collector()
        sched = Scheduler(counting, KVSlots(spec, 8, 1 << 26), tok, spec.eos_token_ids)
        other = sched.submit(Generation([40, 41], SamplingParams(max_tokens=5, min_tokens=5), emit))
        gens = sched.submit_all(_siblings(prompt, params, 3, emit))
        _run_all(sched, gens)
        # One launch: the other request's prompt and the leader's; the two siblings copied the leader's cache.
        assert sorted(n for launch in counting.prefilled for n in launch) == [2, 7] and len(other.generated) == 5
        alone = []
        for gen in gens:
            _, emit2 = _collector()
            solo = Scheduler(model, KVSlots(spec, 2, 1 << 26), tok, spec.eos_token_ids)
            g = solo.submit(Generation(list(prompt), gen.params, emit2))
            _run_all(solo, [g])
            alone.append(g.generated)
        assert [g.generated for g in gens] == alone
        if params.greedy:
            assert alone[0] == alone[1] == alone[2]
        else:
            assert len({tuple(a) for a in alone}) > 1  # each choice its own seed
            assert all(e.logprobs is not None and len(e.logprobs.top_ids) == 2
                       for g in gens for e in events[id(g)])
        assert sched.slots.active == 0


def test_n_choices_are_queued_together_or_not_at_all(engine):
    spec, model, tok, _ = engine
    _, emit = _collector()
    sched = Scheduler(model, KVSlots(spec, 2, 1 << 26), tok, spec.eos_token_ids, max_waiting=1)
    with pytest.raises(SamplingError, match="n=4"):
        sched.submit_all(_siblings([5], SamplingParams(max_tokens=3), 4, emit))
    sched.submit_all(_siblings([5], SamplingParams(max_tokens=3), 3, emit))
    with pytest.raises(QueueFull):
        sched.submit_all(_siblings([5], SamplingParams(max_tokens=3), 2, emit))
    assert len(sched._arrivals) == 3


def test_a_stop_token_id_ends_the_sequence_without_its_text(engine):
    spec, model, tok, _ = engine
    events, emit = _collector()
    sched = Scheduler(model, KVSlots(spec, 2, 1 << 26), tok, spec.eos_token_ids)
    first = sched.submit(Generation([5, 6, 7], SamplingParams(max_tokens=6, min_tokens=6), emit))
    _run_all(sched, [first])
    stop_at = first.generated[3]
    events, emit = _collector()
    sched = Scheduler(model, KVSlots(spec, 2, 1 << 26), tok, spec.eos_token_ids)
    gen = sched.submit(Generation([5, 6, 7], SamplingParams(max_tokens=6, stop_token_ids=(stop_at,)), emit))
    _run_all(sched, [gen])
    cut = first.generated.index(stop_at)
    assert gen.generated == first.generated[:cut + 1] and events[id(gen)][-1].finish_reason == "stop"
    assert events[id(gen)][-1].text == "" or tok.decode([stop_at]) not in events[id(gen)][-1].text


def test_siblings_admitted_apart_from_their_leader_prefill_themselves(engine):
    spec, model, tok, _ = engine
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.8, seed=3)
    counting = _CountingModel(model)
    _, emit = _collector()
    sched = Scheduler(counting, KVSlots(spec, 1, 1 << 26), tok, spec.eos_token_ids)  # one slot: one at a time
    gens = sched.submit_all(_siblings(prompt, params, 3, emit))
    _run_all(sched, gens)
    assert counting.prefilled == [[5], [5], [5]]
    shared = _CountingModel(model)
    sched = Scheduler(shared, KVSlots(spec, 4, 1 << 26), tok, spec.eos_token_ids)
    together = sched.submit_all(_siblings(prompt, params, 3, emit))
    _run_all(sched, together)
    assert shared.prefilled == [[5]]
    assert [g.generated for g in gens] == [g.generated for g in together]
