"""Speculative decoding with a draft graph (generation/draft_model.py), the scheduler in-process on real graphs: the
tokens of plain decoding (greedy and seeded) whatever the draft proposes; a draft that is the served graph itself
has every draft accepted; one that differs (the same weights, its KV cache in INT8) has some rejected, and its cache
follows the sequence through the rejections; the draft's slots go to the sequences drafting and are let go after."""

from __future__ import annotations

import dataclasses
import random

import pytest

from model_factory.backend.generation.causal_lm import CausalLM
from model_factory.backend.generation.draft_model import DraftModel, _common_prefix
from model_factory.backend.generation.kv_slots import KVSlots
from model_factory.backend.generation.sampling import SamplingParams
from model_factory.backend.generation.scheduler import Generation, Scheduler
from model_factory.backend.generation.speculative import SpeculativeConfig, Speculator
from tests.generative_repository import SpeculationCounts, run_to_end

GREEDY = SamplingParams(max_tokens=40, min_tokens=40)
SEEDED = SamplingParams(max_tokens=40, min_tokens=40, temperature=0.8, seed=7)


@pytest.fixture(scope="module")
def engine(tiny_llm):
    from tests.generative_repository import generation_spec

    hf, onnx_dir = tiny_llm
    return generation_spec(hf, {}), CausalLM(onnx_dir / "model.onnx", threads=1, pad_token_id=0)


def _generate(model, spec, prompts, params, draft=None, metrics=None, config=SpeculativeConfig()):
    sched = Scheduler(model, KVSlots(spec, 4, 1 << 30), None, spec.eos_token_ids, metrics=metrics)
    if draft is not None:
        sched.speculator = Speculator(config, metrics=metrics, draft=draft)
    gens = [sched.submit(Generation(list(p), params, lambda g, e: None)) for p in prompts]
    run_to_end(sched)
    return gens


def _prompts(vocab: int, n: int = 3) -> list[list[int]]:
    rng = random.Random(9)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 30))] for _ in range(n)]


def test_the_served_graph_as_its_own_draft_has_every_draft_accepted_and_plain_decodings_tokens(tiny_llm, engine):
    spec, model = engine
    _, onnx_dir = tiny_llm
    draft = DraftModel(CausalLM(onnx_dir / "model.onnx", threads=1, pad_token_id=0), spec, 1, spec.max_context)
    for params in (GREEDY, SEEDED):
        for prompt in _prompts(spec.vocab_size):
            plain = _generate(model, spec, [prompt], params)[0]
            counts = SpeculationCounts()
            got = _generate(model, spec, [prompt], params, draft, counts)[0]
            assert (got.generated, got.finish_reason) == (plain.generated, plain.finish_reason)
            if params is GREEDY:  # the same graph proposes the served model's own greedy tokens
                # (float rounding between the draft's launch shapes and the verification's may flip a near-tie)
                assert counts.drafts > 0 and counts.accepted >= 0.9 * counts.drafted
                # ... and the 39 tokens after the first took far fewer launches of the served graph than 39 decodes
                assert counts.drafts <= (GREEDY.max_tokens - 1) // 2
            else:  # sampling keeps a draft only where the sampled token agrees with it
                assert counts.drafts > 0 and counts.accepted < counts.drafted


def test_a_draft_that_differs_is_partly_rejected_and_the_output_is_still_plain_decodings(engine, tiny_llm_int8_cache):
    spec, model = engine
    kv8 = dataclasses.replace(spec, kv_dtype="int8")
    draft = DraftModel(CausalLM(tiny_llm_int8_cache, threads=1, pad_token_id=0, int8_attention="onnxruntime"), kv8,
                       1, spec.max_context)
    counts = SpeculationCounts()
    rejected = 0
    for params in (GREEDY, SEEDED):
        for prompt in _prompts(spec.vocab_size, 4):
            plain = _generate(model, spec, [prompt], params)[0]
            before = counts.drafted - counts.accepted
            got = _generate(model, spec, [prompt], params, draft, counts)[0]
            assert (got.generated, got.finish_reason) == (plain.generated, plain.finish_reason)
            rejected += counts.drafted - counts.accepted - before
    assert counts.accepted > 0 and rejected > 0  # both paths ran: the draft's cache followed the rejections


def test_several_sequences_share_the_drafts_slots_and_let_them_go(tiny_llm, engine):
    """Two sequences decoding with two draft slots: each drafts in a slot of its own, the output is plain decoding's,
    and once they end their slots hold nothing."""
    spec, model = engine
    _, onnx_dir = tiny_llm
    draft = DraftModel(CausalLM(onnx_dir / "model.onnx", threads=1, pad_token_id=0), spec, 2, spec.max_context)
    prompts = _prompts(spec.vocab_size, 2)
    plain = _generate(model, spec, prompts, GREEDY)
    counts = SpeculationCounts()
    got = _generate(model, spec, prompts, GREEDY, draft, counts, SpeculativeConfig(max_sequences=2))
    assert [g.generated for g in got] == [g.generated for g in plain]
    assert counts.drafts > 0 and counts.accepted >= 0.9 * counts.drafted
    draft.forget([])
    assert all(h.gen is None and not h.tokens for h in draft._held)


def test_the_common_prefix_is_bounded_and_exact():
    assert _common_prefix([1, 2, 3, 4], [1, 2, 9, 4], 10) == 2
    assert _common_prefix([1, 2, 3], [1, 2, 3, 4], 10) == 3
    assert _common_prefix([1, 2, 3, 4], [1, 2, 3, 4], 3) == 3  # the context's last token is always run again
    assert _common_prefix([], [1], 5) == 0 and _common_prefix([5], [1], 5) == 0


def test_the_draft_graph_and_its_slots_come_off_the_kv_budget(engine):
    """memory_budget_mib covers the served graph's weights, the draft's and its slots at their whole context; the
    cache gets the rest, and a budget that leaves none says the draft's share is in it."""
    from model_factory.backend.generate_model import kv_budget_bytes
    from model_factory.backend.settings import SettingsError, parse_settings

    def settings(**params: str):
        return parse_settings({"name": "m", "max_batch_size": 4,
                               "parameters": {k: {"string_value": v} for k, v in params.items()}})

    spec, _ = engine
    mib = 1 << 20
    spec = dataclasses.replace(spec, weights_bytes={"fp32": 40 * mib, "int4": 6 * mib})
    plain = settings(memory_budget_mib="256")
    drafting = settings(memory_budget_mib="256", speculative="draft", speculative_draft="int4",
                        speculative_max_sequences="2")
    slots = 2 * spec.max_context * spec.for_precision("int4").kv_bytes_per_token
    assert kv_budget_bytes(plain, spec, 0) == 216 * mib
    assert kv_budget_bytes(drafting, spec, 0) == 216 * mib - 6 * mib - slots
    with pytest.raises(SettingsError, match=r"the draft's and its slots' included\): raise it"):
        kv_budget_bytes(dataclasses.replace(drafting, memory_budget_mib=46), spec, 0)


class _Sequence:
    """What the draft reads of a sequence: its context."""

    def __init__(self, tokens):
        self.tokens, self.finish_reason = list(tokens), None

    def context(self):
        return self.tokens


def test_only_a_launch_bringing_its_slot_more_than_two_tokens_forward_is_a_catch_up(tiny_llm, engine):
    """The speculator leaves the catch-up out of its judgement: the prompt once, or what a pause decoded; a rejected
    draft (one token new) or every draft taken (the last draft and the served model's token) is drafting's own."""
    spec, _ = engine
    _, onnx_dir = tiny_llm
    draft = DraftModel(CausalLM(onnx_dir / "model.onnx", threads=1, pad_token_id=0), spec, 1, spec.max_context)
    seq = _Sequence(_prompts(spec.vocab_size, 1)[0])
    drafts = draft.propose(seq, 3)
    assert len(drafts) == 3 and draft.catch_up_seconds > 0  # the whole prompt
    other = next(t for t in range(3, spec.vocab_size) if t != drafts[1])
    seq.tokens += [drafts[0], other]  # the first draft taken, the second rejected: one token new to the slot
    drafts = draft.propose(seq, 3)
    assert draft.catch_up_seconds == 0.0
    seq.tokens += drafts + [5]  # all taken, and the served model's own token: two new
    drafts = draft.propose(seq, 3)
    assert draft.catch_up_seconds == 0.0
    seq.tokens += [7, 8, 9, 10]  # decoded while drafting paused
    draft.propose(seq, 3)
    assert draft.catch_up_seconds > 0


class _Launches:
    """The draft graph with its prefill launches' token counts recorded."""

    def __init__(self, model):
        self.model, self.prefills = model, []

    def prefill(self, rows, views, **kw):
        self.prefills.append(len(rows[0]))
        return self.model.prefill(rows, views, **kw)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_under_chunked_prefill_a_long_catch_up_runs_a_chunk_a_step_and_the_output_is_plain_decodings(tiny_llm, engine):
    """A catch-up longer than the scheduler prefills whole runs ``chunk_tokens`` a proposal, drafting nothing until its
    last chunk (the sequence decodes plainly meanwhile); the slot then holds the whole context and drafts follow."""
    spec, model = engine
    _, onnx_dir = tiny_llm
    draft = DraftModel(_Launches(CausalLM(onnx_dir / "model.onnx", threads=1, pad_token_id=0)), spec, 1,
                       spec.max_context)
    draft.chunk_tokens = 8
    seq = _Sequence(random.Random(3).choices(range(3, spec.vocab_size), k=30))
    assert [draft.propose(seq, 3) for _ in range(3)] == [[], [], []]  # 8, 16 and 24 of the 30 tokens
    assert draft.model.prefills == [8, 8, 8] and draft.catch_up_seconds > 0
    assert draft._held[0].tokens == seq.tokens[:24]
    assert len(draft.propose(seq, 3)) == 3 and draft.model.prefills[-1] == 6  # the rest, its last token's logits
    draft.whole_below = 64  # a catch-up the scheduler would prefill whole runs whole here too
    draft.forget([])
    assert len(draft.propose(seq, 3)) == 3 and draft.model.prefills[-1] == 30

    draft.whole_below = 0
    prompts = [random.Random(5 + i).choices(range(3, spec.vocab_size), k=45) for i in range(2)]
    for params in (GREEDY, SEEDED):
        for prompt in prompts:
            draft.model.prefills.clear()
            plain = _generate(model, spec, [prompt], params)[0]
            counts = SpeculationCounts()
            got = _generate(model, spec, [prompt], params, draft, counts)[0]
            assert (got.generated, got.finish_reason) == (plain.generated, plain.finish_reason)
            assert max(draft.model.prefills) <= 8 and counts.drafts > 0
