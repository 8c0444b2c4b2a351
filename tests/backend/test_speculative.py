"""Speculative decoding by prompt lookup (generation/speculative.py): the drafts, and on the real graph the tokens of
plain decoding with it on (greedy and seeded, eos / stop tokens and max_tokens met inside a draft, log-probabilities),
the batch bound, the back-off where verifications take longer than plain decoding (by a clock the fake models
advance), grammar rows left out; on every family of the zoo, a sliding window crossed by the verified drafts too."""

from __future__ import annotations

import random

import numpy as np
import pytest

from model_factory.backend.generation.causal_lm import CausalLM
from model_factory.backend.generation.kv_slots import KVSlots
from model_factory.backend.generation.sampling import SamplingParams
from model_factory.backend.generation.scheduler import Generation, Scheduler
from model_factory.backend.generation.speculative import (PAUSE_STEPS, WINDOW, SpeculativeConfig, Speculator,
                                                            propose)
from tests.generative_repository import SpeculationCounts, ZOO_VARIANTS, int8_kernel_engine, run_to_end, zoo_engine

# --------------------------------------------------------------------------- the drafts


def test_the_place_matching_longest_drafts_as_many_tokens_as_it_matched_plus_one():
    ctx = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 0, 2, 3, 4]
    # (2, 3, 4) matched 3 long at 1 (then 5, 9) and at 6 (then 7, 8, 0): the latest wins, 3 + 1 tokens of it.
    assert propose(ctx, 3, n_max=3, n_min=1) == [7, 8, 0]  # k at most
    assert propose(ctx, 8, n_max=3, n_min=1) == [7, 8, 0, 2]
    assert propose(ctx, 8, n_max=8, n_min=1) == [7, 8, 0, 2]  # (9 | 0, 2, 3, 4): no longer match there
    # Past the context's end the repetition goes on with its period (3 here: 3 1 2, 3 1 2).
    assert propose([1, 2, 3, 1, 2, 3, 1, 2], 8, n_max=8, n_min=1) == [3, 1, 2, 3, 1, 2]  # matched 5: 6 tokens
    assert propose([1, 2, 3, 1, 2, 3, 1, 2], 4, n_max=8, n_min=1) == [3, 1, 2, 3]
    assert propose([1, 2, 3, 1, 2, 3, 1, 2], 8, n_max=2, n_min=1) == [3, 1, 2]  # the match counted to n_max
    assert propose([5, 9, 9, 9], 4, n_max=2, n_min=2) == [9, 9, 9]  # a loop of one token: more of it
    assert propose([1, 2, 3, 1, 2], 5, n_max=2, n_min=2) == [3, 1, 2]
    # A longer match is preferred to a later one, up to n_max.
    assert propose([5, 1, 2, 6, 0, 1, 2, 7, 5, 1, 2], 2, n_max=3, n_min=2) == [6, 0]  # (5,1,2) beats the later (1,2)
    assert propose([5, 1, 2, 6, 0, 1, 2, 7, 5, 1, 2], 2, n_max=2, n_min=2) == [7, 5]


def test_the_match_found_is_the_longest_latest_one_as_a_plain_search_finds_it():
    rng = np.random.default_rng(5)
    for _ in range(300):
        ctx = rng.integers(0, 4, int(rng.integers(2, 40))).tolist()
        n_max, n_min, k = int(rng.integers(1, 7)), int(rng.integers(1, 3)), int(rng.integers(1, 9))
        best = None  # (length, end): every earlier end's match length, capped at n_max
        for end in range(1, len(ctx)):
            n = 0
            while n < min(n_max, end) and ctx[end - 1 - n] == ctx[len(ctx) - 1 - n]:
                n += 1
            if n and (best is None or n >= best[0]):
                best = (n, end)
        if best is None or best[0] < min(n_min, n_max):
            want = [] if best is None or best[0] < n_min else None
        else:
            n, end = best
            follow, period = ctx[end:], len(ctx) - end
            want = [follow[j % period] for j in range(min(k, n + 1))]
        if want is not None and n_min <= n_max:
            assert propose(ctx, k, n_max, n_min) == want, (ctx, k, n_max, n_min)


def test_no_draft_without_a_match_below_the_shortest_ngram_or_for_no_tokens():
    assert propose([1, 2, 3, 4, 5], 4, n_max=3, n_min=1) == []
    assert propose([1, 2, 9, 2], 4, n_max=3, n_min=2) == []  # only the 1-gram (2) recurs
    assert propose([1, 2, 9, 2], 4, n_max=3, n_min=1) == [9, 2]
    assert propose([1, 2, 1, 2], 0, n_max=2, n_min=1) == []
    assert propose([7], 3, n_max=2, n_min=1) == []


# --------------------------------------------------------------------------- on the real graph

# A random-weight model quotes nothing; a repetition penalty under 1 makes its output loop, which prompt lookup drafts
# (the penalty is applied per token as in plain decoding: the drafts' acceptance goes through it).
GREEDY = SamplingParams(max_tokens=48, min_tokens=48, repetition_penalty=0.7)
SEEDED = SamplingParams(max_tokens=48, min_tokens=48, temperature=0.2, repetition_penalty=0.5, seed=11)


class _Recording:
    """The engine with its verification launches recorded: (tokens run, cached before them)."""

    def __init__(self, model):
        self.model, self.verifications, self.decodes = model, [], 0

    def prefill(self, contexts, views, past=None, **kw):
        return self.model.prefill(contexts, views, past=past, **kw)

    def decode(self, tokens, lengths, views, **kw):
        self.decodes += 1
        return self.model.decode(tokens, lengths, views, **kw)

    def continued_logits(self, tokens, past, views, **kw):
        self.verifications.append((len(tokens), past))
        return self.model.continued_logits(tokens, past, views, **kw)


def _generate(model, spec, prompts, params, speculate: SpeculativeConfig | None, metrics=None) -> list[Generation]:
    sched = Scheduler(model, KVSlots(spec, 4, 1 << 30), None, spec.eos_token_ids, metrics=metrics)
    if speculate is not None:
        sched.speculator = Speculator(speculate, metrics=metrics)
    gens = [sched.submit(Generation(list(p), params, lambda g, e: None)) for p in prompts]
    run_to_end(sched)
    assert sched.slots.active == 0
    return gens


def _repetitive(rng: random.Random, vocab: int, n: int = 40) -> list[int]:
    """A prompt that quotes itself: a phrase of 8 tokens, other tokens, the phrase again (drafts to be had)."""
    phrase = [rng.randrange(3, vocab) for _ in range(8)]
    return phrase + [rng.randrange(3, vocab) for _ in range(n - 20)] + phrase + phrase[:4]


@pytest.fixture(scope="module")
def engine(tiny_llm):
    from tests.generative_repository import generation_spec

    hf, onnx_dir = tiny_llm
    return generation_spec(hf, {}), CausalLM(onnx_dir / "model.onnx", threads=1, pad_token_id=0)


def _check_same(model, spec, params, prompts, config=SpeculativeConfig()) -> tuple[SpeculationCounts, _Recording]:
    plain = _generate(model, spec, prompts, params, None)
    counts, recording = SpeculationCounts(), _Recording(model)
    spec_gens = [_generate(recording, spec, [p], params, config, counts)[0] for p in prompts]  # one stream each
    for a, b in zip(plain, spec_gens):
        assert b.generated == a.generated and b.finish_reason == a.finish_reason
    return counts, recording


def test_greedy_and_seeded_tokens_are_plain_decodings_and_drafts_are_accepted(engine):
    spec, model = engine
    rng = random.Random(3)
    prompts = [_repetitive(rng, spec.vocab_size) for _ in range(3)]
    for params in (GREEDY, SEEDED):
        counts, recording = _check_same(model, spec, params, prompts)
        assert counts.drafts == len(recording.verifications) > 0
        assert 0 < counts.accepted < counts.drafted  # some drafts taken, some not: both paths run
        # Each verification ran the last token and at most num_speculative_tokens drafts.
        assert all(2 <= n <= SpeculativeConfig().num_speculative_tokens + 1 for n, _ in recording.verifications)


def test_fewer_launches_where_the_output_repeats_its_context(engine):
    """Where the output loops prompt lookup drafts it, and the 48 tokens of one stream take fewer launches than 47
    decode steps."""
    spec, model = engine
    prompt = _repetitive(random.Random(5), spec.vocab_size)
    counts, recording = _check_same(model, spec, GREEDY, [prompt], SpeculativeConfig(num_speculative_tokens=6))
    launches = recording.decodes + len(recording.verifications)
    assert launches + counts.accepted == GREEDY.max_tokens - 1  # every accepted draft is a launch saved
    assert counts.accepted > 0 and launches < GREEDY.max_tokens - 1


class _Noting(Speculator):
    """The speculator, noting the verifications that ended their sequence on a drafted token the model agreed with,
    before the draft's end (the drafts after it dropped)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.ended_inside = 0

    def verify(self, gen, drafts, *a, **kw):
        before = len(gen.generated)
        agreed = super().verify(gen, drafts, *a, **kw)
        last = len(gen.generated) - 1 - before
        if gen.finish_reason == "stop" and last < len(drafts) and gen.generated[-1] == drafts[last]:
            self.ended_inside += 1
        return agreed


class _Tokens:
    """A tokenizer whose text of a token is ``<id>``: stop strings over token ids."""

    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def _with_text(model, spec, prompt, params, speculator=None) -> tuple[Generation, str]:
    sched = Scheduler(model, KVSlots(spec, 2, 1 << 30), _Tokens(), spec.eos_token_ids)
    sched.speculator = speculator
    text: list[str] = []
    gen = sched.submit(Generation(list(prompt), params, lambda g, e: text.append(e.text)))
    run_to_end(sched)
    return gen, "".join(text)


def test_a_stop_string_completed_inside_an_accepted_draft_ends_the_sequence_there(engine):
    import dataclasses

    spec, model = engine
    prompt = _repetitive(random.Random(5), spec.vocab_size)
    params = SamplingParams(max_tokens=48, repetition_penalty=0.7)
    plain = _generate(model, spec, [prompt], params, None)[0].generated
    inside = 0
    # The text of runs of 3 to 6 tokens of the output as the stop string. A drafted text occurred before, so a stop
    # string met inside a draft is one that starts earlier: where the output loops (a a a a ...), the run is first
    # complete inside a draft the model agrees with, and the sequence must end there, the stop string cut off.
    runs = {tuple(plain[i:i + n]) for n in range(3, 7) for i in range(4, 24)}
    for run in sorted(runs):
        stopping = dataclasses.replace(params, stop=(_Tokens.decode(run),))
        want, want_text = _with_text(model, spec, prompt, stopping)
        noting = _Noting(SpeculativeConfig(num_speculative_tokens=6))
        got, got_text = _with_text(model, spec, prompt, stopping, noting)
        assert (got.generated, got_text, got.finish_reason) == (want.generated, want_text, "stop")
        inside += noting.ended_inside
    assert inside  # some ended on an accepted draft with more drafted after it


def test_a_stop_token_or_eos_ends_the_sequence_where_plain_decoding_does(engine):
    import dataclasses

    spec, model = engine
    prompt = _repetitive(random.Random(5), spec.vocab_size)
    params = SamplingParams(max_tokens=48, repetition_penalty=0.7)
    plain = _generate(model, spec, [prompt], params, None)[0].generated
    for stop in list(dict.fromkeys(plain))[:8]:
        for stopping_spec, stopping in ((spec, dataclasses.replace(params, stop_token_ids=(stop,))),
                                        (dataclasses.replace(spec, eos_token_ids=(stop,)), params)):
            want = _generate(model, stopping_spec, [prompt], stopping, None)[0]
            got = _generate(model, stopping_spec, [prompt], stopping, SpeculativeConfig(num_speculative_tokens=6))[0]
            assert got.generated == want.generated == plain[:plain.index(stop) + 1]
            assert got.finish_reason == want.finish_reason == "stop"


def test_max_tokens_is_met_exactly_and_no_draft_runs_past_it(engine):
    spec, model = engine
    prompt = _repetitive(random.Random(5), spec.vocab_size)
    for max_tokens in (1, 2, 3, 7, 13):
        params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, repetition_penalty=0.7)
        counts, recording = _check_same(model, spec, params, [prompt], SpeculativeConfig(num_speculative_tokens=6))
        # A verification from `past` writes its tokens' keys and values within the reservation, and never drafts
        # more than the model's own last token can follow.
        assert all(past + n <= len(prompt) + max_tokens - 1 for n, past in recording.verifications)
        if max_tokens <= 2:
            assert not recording.verifications


def test_log_probabilities_of_accepted_tokens_are_plain_decodings(engine):
    spec, model = engine
    prompt = _repetitive(random.Random(5), spec.vocab_size)
    params = SamplingParams(max_tokens=32, min_tokens=32, repetition_penalty=0.7, logprobs=3)
    events: dict[bool, list] = {}
    for on in (False, True):
        sched = Scheduler(model, KVSlots(spec, 2, 1 << 30), None, spec.eos_token_ids)
        counts = SpeculationCounts()
        sched.speculator = Speculator(SpeculativeConfig(), metrics=counts) if on else None
        out: list = []
        sched.submit(Generation(list(prompt), params, lambda g, e: out.append(e)))
        run_to_end(sched)
        events[on] = out
        if on:
            assert counts.accepted > 0
    assert [e.token for e in events[True]] == [e.token for e in events[False]]
    for a, b in zip(events[False], events[True]):
        assert a.logprobs.logprob == pytest.approx(b.logprobs.logprob, abs=1e-4)
        assert a.logprobs.top_ids == b.logprobs.top_ids
        assert a.logprobs.top_logprobs == pytest.approx(b.logprobs.top_logprobs, abs=1e-4)


def test_no_drafts_while_more_sequences_decode_than_the_bound(engine):
    spec, model = engine
    rng = random.Random(3)
    prompts = [_repetitive(rng, spec.vocab_size) for _ in range(3)]
    counts, recording = SpeculationCounts(), _Recording(model)
    plain = _generate(model, spec, prompts, GREEDY, None)
    got = _generate(recording, spec, prompts, GREEDY, SpeculativeConfig(max_sequences=2), counts)
    assert [g.generated for g in got] == [g.generated for g in plain]
    # Three decode together (no drafts) until one ends... they end together here: min_tokens = max_tokens.
    assert counts.drafts == 0 and not recording.verifications
    two = _generate(recording, spec, prompts[:2], GREEDY, SpeculativeConfig(max_sequences=2), counts)
    assert [g.generated for g in two] == [g.generated for g in plain[:2]] and counts.drafts > 0


# --------------------------------------------------------------------------- the back-off, grammar rows


class _Gen:
    """What the speculator reads of a sequence."""

    def __init__(self, context, max_tokens=100, matcher=None):
        self.prompt, self.generated, self.cached = list(context), [], len(context) - 1
        self.params = SamplingParams(max_tokens=max_tokens)
        self.prefilling, self.finish_reason, self.matcher = False, None, matcher

    def context(self):
        return self.prompt + self.generated


class _Clock:
    """Seconds that pass only where a launch says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class _Timed:
    """A model whose verification launch takes ``seconds`` on ``clock`` and whose token at every position is
    ``tokens[i]`` (0 past them)."""

    def __init__(self, clock, seconds, tokens=()):
        self.clock, self.seconds, self.tokens = clock, seconds, list(tokens)

    def continued_logits(self, tokens, past, views, **kw):
        self.clock.now += self.seconds
        logits = np.zeros((len(tokens), 8), np.float32)
        for i in range(len(tokens)):
            logits[i, self.tokens[i] if i < len(self.tokens) else 0] = 1.0
        return logits


def _verify_window(speculator, gen, model):
    """WINDOW verifications of ``gen``'s drafts on ``model``, its context set back after each (drafts keep coming);
    the tokens each gave."""
    gave = []
    for _ in range(WINDOW):
        plan = speculator.plan([gen])
        assert id(gen) in plan
        drafts = plan[id(gen)][1]
        speculator.verify(gen, drafts, model, {}, lambda g, row: g.generated.append(int(np.argmax(row))), {})
        gave.append(len(gen.generated))
        assert gen.cached == len(gen.prompt) - 1 + len(gen.generated)  # the cache holds what was taken
        gen.generated.clear()
        gen.cached = len(gen.prompt) - 1
    return gave


def test_nothing_drafts_until_a_decode_launch_of_as_many_rows_was_timed():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4), clock=_Clock())
    gen = _Gen([1, 2, 3, 1, 2, 3, 1, 2] * 2)
    assert not speculator.plan([gen])
    speculator.observe_decode(2, 1.5)  # a launch of two rows: not what one decoding sequence's verifications replace
    assert not speculator.plan([gen])
    speculator.observe_decode(1, 1.0)
    assert id(gen) in speculator.plan([gen])
    speculator.observe_decode(1, 2.0)  # smoothed, not replaced
    assert 1.0 < speculator.decode_seconds[1] < 2.0 and speculator.decode_seconds[2] == 1.5


def test_a_sequence_whose_verifications_take_longer_than_plain_decoding_pauses_then_drafts_again():
    clock = _Clock()
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4), clock=clock)
    speculator.observe_decode(1, 1.0)
    gen = _Gen([1, 2, 3, 1, 2, 3, 1, 2] * 2)
    # Rejected drafts (the model's token 0, never drafted): one token a verification of 1.2 decode launches.
    assert _verify_window(speculator, gen, _Timed(clock, 1.2)) == [1] * WINDOW
    assert all(not speculator.plan([gen]) for _ in range(PAUSE_STEPS))  # slower than plain decoding: paused
    assert id(gen) in speculator.plan([gen])


def test_a_sequence_whose_verifications_gain_time_keeps_drafting():
    clock = _Clock()
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4), clock=clock)
    speculator.observe_decode(1, 1.0)
    gen = _Gen([1, 2, 3] * 5 + [1, 2])  # drafts 3 1 2 3
    # The first draft token (3) agreed, the second not: two tokens from a launch of 1.5 decode launches.
    for _ in range(3):
        assert _verify_window(speculator, gen, _Timed(clock, 1.5, [3])) == [2] * WINDOW
    # The same launch giving one token: paused.
    _verify_window(speculator, gen, _Timed(clock, 1.5))
    assert not speculator.plan([gen])


class _Drafting:
    """A draft model whose first proposal catches up (``catch_up`` seconds on ``clock``) and each one drafts ``[3]`` in
    0.1 s."""

    def __init__(self, clock, catch_up):
        self.clock, self.catch_up, self.catch_up_seconds = clock, catch_up, 0.0

    def propose(self, gen, k):
        self.clock.now += self.catch_up + 0.1
        self.catch_up_seconds, self.catch_up = self.catch_up, 0.0
        return [3]

    def forget(self, live):
        pass


def test_a_draft_models_catch_up_is_left_out_of_the_judgement():
    clock = _Clock()
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4), clock=clock, draft=_Drafting(clock, 100.0))
    speculator.observe_decode(1, 1.0)
    gen = _Gen([1, 2, 3] * 5 + [1, 2])
    # Two tokens from 0.1 s of drafting and a launch of 1.0: paying, whatever the first proposal's 100 s catch-up.
    assert _verify_window(speculator, gen, _Timed(clock, 1.0, [3])) == [2] * WINDOW
    assert id(gen) in speculator.plan([gen])


def test_grammar_rows_and_rows_near_max_tokens_draft_nothing():
    speculator = Speculator(SpeculativeConfig())
    speculator.observe_decode(1, 1.0)
    ctx = [1, 2, 3, 1, 2, 3, 1, 2]
    assert not speculator.plan([_Gen(ctx, matcher=object())])
    assert not speculator.plan([_Gen(ctx, max_tokens=1)])
    assert speculator.plan([_Gen(ctx, max_tokens=2)])


# --------------------------------------------------------------------------- every family of the zoo

@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(ZOO_VARIANTS))
def test_every_family_gives_the_tokens_of_plain_decoding(variant, tmp_path_factory):
    spec, model = zoo_engine(variant, tmp_path_factory)  # 40-token prompts, 48 tokens: past Mistral's 16-token window
    rng = random.Random(7)
    prompts = [_repetitive(rng, spec.vocab_size) for _ in range(2)]
    for params in (GREEDY, SEEDED):
        counts, _ = _check_same(model, spec, params, prompts)
        assert counts.drafts > 0


@pytest.mark.slow
def test_an_int8_cache_on_the_factorys_kernel_gives_the_tokens_of_plain_decoding(tiny_llm):
    """INT4 weights (batch-independent) and the INT8 KV cache, its attention on the factory's kernel: a verification is
    a continued prompt over the cached INT8 keys, as the kernel computes one."""
    spec, model = int8_kernel_engine(tiny_llm[0])
    assert model.attention.startswith("model-factory Int8KVAttention")
    rng = random.Random(3)
    prompts = [_repetitive(rng, spec.vocab_size) for _ in range(2)]
    for params in (GREEDY, SEEDED):
        counts, _ = _check_same(model, spec, params, prompts)
        assert counts.accepted > 0


def test_paged_admission_reserves_the_blocks_a_draft_writes_or_the_row_does_not_draft(engine):
    """With ``kv_admission = "paged"`` each decoding row holds blocks up to its next token; a verification writes its
    drafts beyond that: they run only where the budget gives their blocks too, so every slot's reservation covers what
    it holds after each step (the drafts cross blocks), and the tokens are plain decoding's."""
    from model_factory.backend.generation.kv_blocks import block_tokens
    from model_factory.backend.generation.kv_slots import HostKVBuffers

    spec, model = engine
    prompt = _repetitive(random.Random(3), spec.vocab_size)
    plain = _generate(model, spec, [prompt], GREEDY, None)[0]
    storage = HostKVBuffers(spec, 2, spec.max_context)
    storage.granule_bytes = 1  # tokens counted exactly (a page of the tiny model holds 64 tokens)
    slots = KVSlots(spec, 2, 1 << 30, storage=storage, block_tokens=block_tokens("paged"))
    budget = slots.bytes_for(slots.held(len(prompt) + GREEDY.max_tokens))  # the blocks it holds at its end
    slots = KVSlots(spec, 2, budget, storage=storage, block_tokens=block_tokens("paged"))
    counts = SpeculationCounts()
    sched = Scheduler(model, slots, None, spec.eos_token_ids, metrics=counts)
    sched.speculator = Speculator(SpeculativeConfig(num_speculative_tokens=6), metrics=counts)
    gen = sched.submit(Generation(list(prompt), GREEDY, lambda g, e: None))

    def covered() -> None:
        if gen.slot is not None:
            assert slots.usage().reserved_bytes <= budget
            assert slots.held(gen.cached) <= slots._reserved[gen.slot], (gen.cached, slots._reserved[gen.slot])

    run_to_end(sched, covered)
    assert gen.generated == plain.generated and counts.accepted > 0
