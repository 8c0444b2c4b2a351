"""Sampling checks, incremental detokenization, stop strings and the KV slots, each alone."""

from __future__ import annotations

import numpy as np
import pytest

from model_factory.backend.contract import GenerationSpec, SamplingDefaults
from model_factory.backend.generation.detokenize import IncrementalDetokenizer, StopMatcher
from model_factory.backend.generation.kv_slots import AdmissionError, KVSlots
from model_factory.backend.generation.sampling import Sampler, SamplingError, SamplingParams, parse_sampling

SPEC = GenerationSpec(family="llama", num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64,
                      vocab_size=100, max_context=64, eos_token_ids=(2,))


def _parse(**given):
    return parse_sampling(given, SamplingDefaults(), prompt_tokens=10, max_context=64)


@pytest.mark.parametrize("given, named", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 55}, "max_tokens=55"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"), ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"), ({"ignore_eos": 1}, "ignore_eos"), ({"stop": [""]}, "stop"),
    ({"stop": ["x"] * 17}, "stop"), ({"stop": 5}, "stop"), ({"max_tokens": "3"}, "max_tokens"),
])
def test_every_bad_value_is_refused_by_name(given, named):
    with pytest.raises(SamplingError, match=named):
        _parse(**given)


def test_a_prompt_that_fills_the_context_names_both_lengths():
    with pytest.raises(SamplingError, match="70 tokens and the context holds 64"):
        parse_sampling({}, SamplingDefaults(), prompt_tokens=70, max_context=64)


def test_defaults_greedy_and_cut_to_the_room_left():
    p = parse_sampling({}, SamplingDefaults(max_tokens=128), prompt_tokens=60, max_context=64)
    assert p.greedy and p.max_tokens == 4
    assert _parse(top_k=-1).top_k == 0
    assert _parse(max_tokens=np.array([5], dtype=np.int32)).max_tokens == 5


def test_sampler_greedy_min_tokens_and_repetition_penalty():
    logits = np.array([0.0, 1.0, 5.0, 3.0], dtype=np.float32)  # eos (2) is the argmax
    s = Sampler(SamplingParams(max_tokens=4, min_tokens=2), eos_token_ids=(2,), prompt_ids=())
    assert s.choose(logits, 0) == 3 and s.choose(logits, 2) == 2
    penal = Sampler(SamplingParams(max_tokens=4, repetition_penalty=4.0), (0,), prompt_ids=(2,))
    assert penal.choose(logits, 0) == 3  # 5 / 4 < 3


def test_seeded_sampling_repeats_and_top_k_one_is_greedy():
    logits = np.random.default_rng(0).normal(size=50).astype(np.float32)
    a = Sampler(SamplingParams(max_tokens=9, temperature=1.0, seed=3), (0,), ())
    b = Sampler(SamplingParams(max_tokens=9, temperature=1.0, seed=3), (0,), ())
    assert [a.choose(logits, i) for i in range(9)] == [b.choose(logits, i) for i in range(9)]
    k1 = Sampler(SamplingParams(max_tokens=9, temperature=2.0, top_k=1, seed=1), (0,), ())
    assert {k1.choose(logits, i) for i in range(9)} == {int(np.argmax(logits))}
    p = Sampler(SamplingParams(max_tokens=9, temperature=1.0, top_p=1e-6, seed=1), (0,), ())
    assert {p.choose(logits, i) for i in range(9)} == {int(np.argmax(logits))}


class ByteTokenizer:
    """Token i is byte i (a byte-level vocabulary): a multi-byte character spans tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_split_character_is_emitted_only_when_whole():
    detok = IncrementalDetokenizer(ByteTokenizer())
    pieces = [detok.add(b) for b in "a€b".encode()]  # € is three bytes
    assert pieces == ["a", "", "", "€", "b"]
    assert all("\ufffd" not in p for p in pieces)
    tail = IncrementalDetokenizer(ByteTokenizer())
    assert tail.add(0xE2) == "" and tail.flush() == "\ufffd"


def test_stop_strings_cut_the_text_and_hold_back_a_possible_start():
    m = StopMatcher(["END", "##"])
    assert m.feed("hello E") == "hello "
    assert m.feed("N") == ""
    assert m.feed("Dx") == "" and m.stopped
    n = StopMatcher(["END"])
    assert n.feed("abE") == "ab" and n.feed("x") == "Ex" and n.flush() == ""
    assert StopMatcher([]).feed("E") == "E"


def test_slots_compact_admit_by_memory_and_give_pages_back():
    spec = GenerationSpec(**{**SPEC.__dict__, "max_context": 1024})  # a slot spans whole pages
    one = KVSlots(spec, 1, 1 << 30).bytes_for(32)
    slots = KVSlots(spec, 4, budget_bytes=2 * one)
    a, b = slots.admit(32), slots.admit(32)
    assert (a, b) == (0, 1) and not slots.can_admit(1) and slots.usage().ratio == 1.0
    for name in slots.names:
        slots.buffers[name][1, :, :32] = 7.0
    assert slots.release(0) == 1  # slot 1's rows moved into slot 0
    assert all((slots.buffers[n][0, :, :32] == 7.0).all() for n in slots.names)
    # The freed slot's whole pages went back to the system: they read as zeros (its second head row is one).
    assert all((slots.buffers[n][1, 1, :32] == 0).all() for n in slots.names)
    assert slots.active == 1 and slots.can_admit(32) and not slots.fits_ever(1025)
    with pytest.raises(AdmissionError):
        KVSlots(SPEC, 1, budget_bytes=10)
    views = slots.views(0, 1)
    assert all(v.flags.c_contiguous and v.shape == (1, 2, 1024, 16) for v in views.values())


def test_generation_json_round_trips_the_batch_dependent_precisions():
    from dataclasses import replace

    spec = replace(SPEC, batch_dependent=("int8",), weights_bytes={"fp32": 10, "int8": 3})
    again = GenerationSpec.from_json(spec.to_json())
    assert again == spec and again.batch_dependent == ("int8",)
    assert GenerationSpec.from_json(SPEC.to_json()).batch_dependent == ()  # none by default


def test_an_fp16_precision_runs_on_half_width_kv_slots():
    """generation.json names the precisions whose graph keeps another KV element type; the spec of one precision
    sizes its slots and admission from it (FP16: half the bytes per token, float16 buffers)."""
    from dataclasses import replace

    from model_factory.backend.contract import ParameterError

    spec = replace(SPEC, max_context=1024, kv_dtypes={"fp16": "float16"})
    again = GenerationSpec.from_json(spec.to_json())
    assert again == spec and again.for_precision("fp32") is again and again.for_precision("int4") is again
    half = again.for_precision("fp16")
    assert half.kv_dtype == "float16" and 2 * half.kv_bytes_per_token == again.kv_bytes_per_token
    slots32, slots16 = KVSlots(again, 2, 1 << 30), KVSlots(half, 2, 1 << 30)
    assert all(b.dtype == np.float16 for b in slots16.buffers.values())
    assert 2 * slots16.bytes_for(1024) == slots32.bytes_for(1024)
    with pytest.raises(ParameterError, match="kv_dtypes.fp16='bfloat16'"):
        replace(SPEC, kv_dtypes={"fp16": "bfloat16"})


def test_the_account_is_the_slots_and_the_storage_only_holds_the_buffers():
    """KVSlots keeps the account over any storage of its slots (host memory here; kv_device's buffers on a GPU,
    which commit a token's bytes exactly instead of whole pages)."""
    from model_factory.backend.generation.kv_slots import HostKVBuffers

    spec = GenerationSpec(**{**SPEC.__dict__, "max_context": 1024})
    host = HostKVBuffers(spec, 2, 1024)
    slots = KVSlots(spec, 2, 1 << 30, storage=host)
    assert slots.buffers is host.buffers and slots.views(0, 2) is host.views(0, 2)
    assert slots.bytes_for(1) == len(slots.names) * spec.num_kv_heads * HostKVBuffers.granule_bytes
    with pytest.raises(ValueError, match="holds 2 slots of 1024 tokens, not 3 of 1024"):
        KVSlots(spec, 3, 1 << 30, storage=host)
    from model_factory.backend.generation.kv_device import DeviceKVBuffers

    # A storage that commits a token's bytes exactly (device memory, committed when allocated) is counted so.
    exact_storage = HostKVBuffers(spec, 2, 1024)
    exact_storage.granule_bytes = DeviceKVBuffers.granule_bytes
    exact = KVSlots(spec, 2, 2 * 1024 * spec.kv_bytes_per_token, storage=exact_storage)
    assert exact.bytes_for(3) == 3 * spec.kv_bytes_per_token
    assert exact.admit(1024) == 0 and exact.admit(1024) == 1 and exact.usage().ratio == 1.0
