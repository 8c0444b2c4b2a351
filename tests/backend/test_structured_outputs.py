"""Structured outputs' grammar interface (``generation/structured``) on a byte-level BPE tokenizer trained here:
every token sequence the mask allows parses (random walks over the allowed tokens, for a JSON schema, a regex, a
choice and a Lark grammar), the mask covers logits wider than the tokenizer, compiled grammars are cached by their
canonical source, what the engine cannot compile is refused naming the construct, and the scheduler generates
under a grammar (greedy and sampled) with a fake model whose logits are random."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llguidance", reason="llguidance (extra serve) is the grammar engine")
jsonschema = pytest.importorskip("jsonschema")

from model_factory.backend.contract import GenerationSpec  # noqa: E402
from model_factory.backend.generation.kv_slots import KVSlots  # noqa: E402
from model_factory.backend.generation.sampling import Sampler, SamplingError, SamplingParams  # noqa: E402
from model_factory.backend.generation.scheduler import Generation, Scheduler  # noqa: E402
from model_factory.backend.generation.structured.engines import load_engine  # noqa: E402
from model_factory.backend.generation.structured.grammar import (GrammarError, Grammars, StepMasks,  # noqa: E402
                                                                 allowed_tokens, mask_words, parse_guided)

EXTRA = 7  # the model's logits are wider than the tokenizer (padded vocabularies): those ids are never allowed
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "kind": {"enum": ["person", "company"]},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    "where": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
              "required": ["zip"], "additionalProperties": False}},
    "required": ["name", "age", "kind", "ok", "tags", "where"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=["<|endoftext|>", "<|im_end|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(sorted(str(p) for p in Path("/usr/share/common-licenses").glob("*") if p.is_file())[:8], trainer)
    return tok


@pytest.fixture(scope="module")
def grammars(tok):
    engine = load_engine(tok.to_str(), tok.get_vocab_size() + EXTRA, [tok.token_to_id("<|im_end|>")])
    return Grammars(engine)


def _walk(grammars, tok, spec, rng: random.Random, limit: int = 400) -> str:
    """Random tokens among those the mask allows until the grammar ends (eos taken when allowed, half the time)."""
    matcher = grammars.compile(spec).matcher()
    eos = tok.token_to_id("<|im_end|>")
    ids: list[int] = []
    for _ in range(limit):
        row = np.zeros(mask_words(grammars.vocab_size), dtype=np.int32)
        matcher.fill_mask(row)
        allowed = np.flatnonzero(allowed_tokens(row, grammars.vocab_size))
        assert allowed.size and allowed.max() < tok.get_vocab_size(), "the padded ids are never allowed"
        if eos in allowed and (allowed.size == 1 or rng.random() < 0.5):
            break
        token = int(allowed[rng.randrange(allowed.size)]) if eos not in allowed else int(
            rng.choice([t for t in allowed if t != eos]))
        assert matcher.accept(token)
        ids.append(token)
        if matcher.finished():
            break
    else:
        raise AssertionError("the grammar did not end")
    return tok.decode(ids, skip_special_tokens=False)


def test_every_token_sequence_the_mask_allows_is_json_valid_against_the_schema(grammars, tok):
    spec = parse_guided({"json": SCHEMA})
    rng = random.Random(0)
    for _ in range(25):
        text = _walk(grammars, tok, spec, rng)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_choice_json_object_and_lark_walks_parse(grammars, tok):
    rng = random.Random(1)
    for _ in range(10):
        assert re.fullmatch(r"[a-c]{2,5}-[0-9]{1,3}", _walk(grammars, tok, parse_guided({"regex": r"[a-c]{2,5}-[0-9]{1,3}"}), rng))
        assert _walk(grammars, tok, parse_guided({"choice": ["yes", "no", "maybe so"]}), rng) in ("yes", "no", "maybe so")
        lark = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'
        assert re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", _walk(grammars, tok, parse_guided({"grammar": lark}), rng))
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}
    assert json.loads(_walk(grammars, tok, parse_guided({"json": schema}), rng)) in ({"a": True}, {"a": False})


def test_a_token_outside_the_mask_is_refused(grammars, tok):
    matcher = grammars.compile(parse_guided({"choice": ["yes", "no"]})).matcher()
    row = np.zeros(mask_words(grammars.vocab_size), dtype=np.int32)
    matcher.fill_mask(row)
    allowed = allowed_tokens(row, grammars.vocab_size)
    banned = int(np.flatnonzero(~allowed)[0])
    assert not matcher.accept(banned)


def test_compiled_once_per_canonical_source(grammars):
    before = grammars.compiled
    a = grammars.compile(parse_guided({"json": {"type": "object", "properties": {"x": {"type": "integer"}}}}))
    b = grammars.compile(parse_guided({"json": '{"properties": {"x": {"type": "integer"}}, "type": "object"}'}))
    assert a is b and grammars.compiled == before + 1


@pytest.mark.parametrize("schema, named", [
    ({"type": "object", "if": {"type": "string"}}, "if"),
    ({"type": "string", "format": "weird"}, "weird"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}}, "$defs/x"),
])
def test_a_schema_the_engine_cannot_compile_is_refused_naming_the_construct(grammars, schema, named):
    with pytest.raises(GrammarError, match=re.escape(named)) as info:
        grammars.compile(parse_guided({"json": schema}))
    assert isinstance(info.value, SamplingError)  # INVALID_ARG on the generate path, a 400 on the OpenAI one


@pytest.mark.parametrize("value, says", [
    ({"json": {}, "regex": "a"}, "exactly one"), ({"jsn": {}}, "unknown"), ({"choice": []}, "non-empty"),
    ({"json": "{not json"}, "not JSON"), ({"json_object": False}, "true"), ("x", "object"),
])
def test_bad_guided_objects_are_refused(value, says):
    with pytest.raises(SamplingError, match=says):
        parse_guided(value)


def test_the_guided_spec_round_trips_through_sampling_parameters():
    spec = parse_guided({"json": {"b": 1, "a": [1, 2]}})
    assert spec.source == '{"a":[1,2],"b":1}' and parse_guided(spec.as_json()) == spec
    assert parse_guided({"json_object": True}).as_json() == {"json_object": True}


def test_the_sampler_takes_only_allowed_tokens_and_the_grammar_wins_over_min_tokens():
    logits = np.array([5.0, 4.0, 3.0, 2.0, 1.0], dtype=np.float32)
    allowed = np.array([False, False, True, True, False])
    assert Sampler(SamplingParams(max_tokens=4), [4], []).choose(logits, 0, allowed) == 2
    sampled = Sampler(SamplingParams(max_tokens=4, temperature=1.0, seed=3), [4], [])
    assert {sampled.choose(logits, 0, allowed) for _ in range(50)} <= {2, 3}
    only_eos = np.array([False, False, False, False, True])  # the grammar's end during min_tokens: eos all the same
    assert Sampler(SamplingParams(max_tokens=4, min_tokens=3), [4], []).choose(logits, 0, only_eos) == 4
    eos_or_2 = np.array([False, False, True, False, True])
    assert Sampler(SamplingParams(max_tokens=4, min_tokens=3), [4], []).choose(logits, 0, eos_or_2) == 2


class RandomLM:
    """Logits drawn at random: any output is the grammar's doing."""

    device, attention = "cpu", ""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab, self.rng = vocab, np.random.default_rng(seed)

    def prefill(self, contexts, views):
        return self.rng.normal(0, 3, (len(contexts), self.vocab)).astype(np.float32)

    def decode(self, ids, lengths, views):
        return self.rng.normal(0, 3, (len(ids), self.vocab)).astype(np.float32)


@pytest.mark.parametrize("temperature, worker_from", [(0.0, None), (1.0, None), (1.0, 0)])
def test_the_scheduler_generates_under_a_grammar_beside_free_sequences(grammars, tok, temperature, worker_from):
    """Greedy and sampled; the masks made in place (few rows of a small vocabulary) or on the worker thread."""
    vocab, eos = grammars.vocab_size, tok.token_to_id("<|im_end|>")
    spec = GenerationSpec(family="llama", num_layers=1, num_attention_heads=1, num_kv_heads=1, head_dim=4,
                          hidden_size=4, vocab_size=vocab, max_context=512, eos_token_ids=(eos,))
    sched = Scheduler(RandomLM(vocab), KVSlots(spec, 8, 64 << 20), tok, (eos,))
    if worker_from is not None:
        sched.masks = StepMasks(worker_from=worker_from)
    compiled = grammars.compile(parse_guided({"json": SCHEMA}))
    texts: dict[int, list[str]] = {}
    reasons: dict[int, str] = {}

    def emit(gen, event):
        texts.setdefault(gen.id, []).append(event.text)
        if event.finish_reason:
            reasons[gen.id] = event.finish_reason

    gens = []
    for i in range(6):
        params = SamplingParams(max_tokens=300, temperature=temperature, seed=i)
        gens += sched.submit_all([Generation([5, 6, 7], params, emit, grammar=compiled if i % 2 == 0 else None)])
    for _ in range(2000):
        if not sched.has_work():
            break
        sched.step()
    for i, gen in enumerate(gens):
        if i % 2 == 0:
            assert reasons[gen.id] == "stop", "".join(texts[gen.id])
            jsonschema.validate(json.loads("".join(texts[gen.id])), SCHEMA)
        else:
            assert gen.matcher is None and reasons[gen.id] in ("stop", "length")


def test_guided_is_read_from_sampling_parameters_and_mirrored_for_a_rollouts_shadow():
    from model_factory.backend.generation.requests import read_generate_request, request_inputs

    spec = GenerationSpec(family="llama", num_layers=1, num_attention_heads=1, num_kv_heads=1, head_dim=4,
                          hidden_size=4, vocab_size=100, max_context=64, eos_token_ids=(2,))
    sent = {"prompt_ids": np.array([3, 4, 5], dtype=np.int32), "max_tokens": np.array([7], dtype=np.int32),
            "sampling_parameters": np.array([json.dumps({"guided": {"json": SCHEMA}}).encode()], dtype=np.object_)}
    req = read_generate_request(sent.get, None, spec, 64)
    assert req.params.guided == parse_guided({"json": SCHEMA})
    again = read_generate_request(request_inputs(req).get, None, spec, 64)
    assert again.params == req.params
    sent["sampling_parameters"] = np.array([b'{"guided": {"regex": ""}}'], dtype=np.object_)
    with pytest.raises(SamplingError, match="guided.regex"):
        read_generate_request(sent.get, None, spec, 64)


def test_vllm_triton_backends_guided_decoding_and_structured_outputs_are_read_as_guided():
    """vLLM's Triton backend takes the grammar as ``guided_decoding`` (an object or its JSON text, with a ``backend``)
    or ``structured_outputs``: the same grammar as ``guided``, one name a request, errors named under the name sent."""
    from model_factory.backend.generation.requests import read_generate_request

    spec = GenerationSpec(family="llama", num_layers=1, num_attention_heads=1, num_kv_heads=1, head_dim=4,
                          hidden_size=4, vocab_size=100, max_context=64, eos_token_ids=(2,))

    def read(parameters):
        sent = {"prompt_ids": np.array([3, 4], dtype=np.int32),
                "sampling_parameters": np.array([json.dumps(parameters).encode()], dtype=np.object_)}
        return read_generate_request(sent.get, None, spec, 64).params.guided

    want = parse_guided({"json": SCHEMA})
    assert read({"guided_decoding": {"json": SCHEMA, "backend": "xgrammar"}}) == want
    assert read({"guided_decoding": json.dumps({"json": json.dumps(SCHEMA), "json_object": False})}) == want
    assert read({"structured_outputs": json.dumps({"choice": ["a", "b"]})}) == parse_guided({"choice": ["a", "b"]})
    assert read({"guided_decoding": {"regex": "[0-9]+", "choice": None}}) == parse_guided({"regex": "[0-9]+"})
    for bad, says in (({"guided": {"regex": "x"}, "guided_decoding": {"regex": "y"}}, "guided and guided_decoding"),
                      ({"guided_decoding": "{not json"}, "guided_decoding is not JSON"),
                      ({"structured_outputs": {"whitespace_pattern": " "}}, r"structured_outputs has unknown names"),
                      ({"guided_decoding": {"regex": ""}}, r"guided_decoding\.regex"),
                      ({"guided_decoding": ["json"]}, "guided_decoding must be an object")):
        with pytest.raises(SamplingError, match=says):
            read(bad)


def test_objects_that_do_not_say_additional_properties_are_generated_closed(grammars, tok):
    """An open object (pydantic's schemas say nothing of additionalProperties) is generated with the keys it names
    only: every walk's keys are the schema's, and each answer is valid against the schema as sent."""
    from model_factory.backend.generation.structured.grammar import closed_objects

    open_schema = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"$ref": "#/$defs/B"}},
                   "required": ["a", "b"],
                   "$defs": {"B": {"type": "object", "properties": {"c": {"enum": [1, 2]}}, "required": ["c"]}}}
    closed = closed_objects(open_schema)
    assert closed["additionalProperties"] is False and closed["$defs"]["B"]["additionalProperties"] is False
    assert "additionalProperties" not in open_schema  # the schema as sent is not changed
    kept = {"type": "object", "additionalProperties": {"type": "integer"}, "allOf": [{"properties": {"x": {}}}]}
    assert closed_objects(kept) == kept
    rng = random.Random(1)
    for _ in range(20):
        out = json.loads(_walk(grammars, tok, parse_guided({"json": open_schema}), rng))
        jsonschema.validate(out, open_schema)
        assert set(out) == {"a", "b"} and set(out["b"]) == {"c"}
