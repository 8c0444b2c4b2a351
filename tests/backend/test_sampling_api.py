"""The OpenAI sampling parameters in the backend's sampler, alone: log-probabilities against numpy's
log-softmax, presence and frequency penalties (OpenAI's definitions), logit_bias, stop_token_ids, the per-choice
seeds, and their checks; each token's text for the logprobs output."""

from __future__ import annotations

import math

import numpy as np
import pytest

from model_factory.backend.contract import SamplingDefaults
from model_factory.backend.generation.detokenize import TokenTexts
from model_factory.backend.generation.sampling import (LOGPROB_FLOOR, Sampler, SamplingError, SamplingParams,
                                                       choice_seed, parse_sampling, token_logprobs)


def _parse(**given):
    return parse_sampling(given, SamplingDefaults(), prompt_tokens=10, max_context=64, vocab_size=100)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


def test_logprobs_are_the_log_softmax_of_the_raw_logits_and_the_top_k_its_largest():
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=4.0, size=262_144).astype(np.float32)  # Gemma's vocabulary size
    want = _log_softmax(logits)
    got = token_logprobs(logits, 17, 20)
    assert math.isclose(got.logprob, want[17], abs_tol=1e-4)
    order = np.argsort(-want)[:20]
    assert list(got.top_ids) == [int(i) for i in order]
    assert np.allclose(got.top_logprobs, want[order], atol=1e-4)
    assert list(got.top_logprobs) == sorted(got.top_logprobs, reverse=True)
    assert token_logprobs(logits, 3, 0).top_ids == ()
    # An impossible token (masked to -inf) reads as the floor, never -inf (not JSON).
    masked = np.array([0.0, -np.inf, 1.0], dtype=np.float32)
    assert token_logprobs(masked, 1, 3).logprob == LOGPROB_FLOOR
    assert token_logprobs(masked, 0, 5).top_ids == (2, 0, 1)


@pytest.mark.parametrize("size, k", [(262_144, 20), (262_145 + 100, 5), (151_936, 1), (2048, 20), (7, 3), (5, 9)])
def test_top_ids_by_blocks_are_the_largest_whatever_the_size(size, k):
    from model_factory.backend.generation.sampling import top_ids

    x = np.random.default_rng(size).normal(size=size).astype(np.float32)
    x[-1] = 50.0  # in the tail past the last whole block
    want = np.argsort(-x, kind="stable")[:min(k, size)]
    assert list(top_ids(x, k)) == [int(i) for i in want]


def test_the_sampler_reports_logprobs_of_the_model_not_of_the_penalised_logits():
    logits = np.array([0.0, 1.0, 5.0, 3.0], dtype=np.float32)
    s = Sampler(SamplingParams(max_tokens=4, logprobs=2, logit_bias=((3, 100.0),)), (0,), ())
    assert s.choose(logits, 0) == 3  # forced by the bias
    assert math.isclose(s.last.logprob, _log_softmax(logits)[3], abs_tol=1e-6)
    assert s.last.top_ids == (2, 3)
    quiet = Sampler(SamplingParams(max_tokens=4), (0,), ())
    quiet.choose(logits, 0)
    assert quiet.last is None


def test_presence_and_frequency_penalties_follow_openai():
    logits = np.zeros(6, dtype=np.float32)
    s = Sampler(SamplingParams(max_tokens=9, presence_penalty=0.5, frequency_penalty=0.25), (0,), prompt_ids=(4,))
    for token in (1, 1, 1, 2):  # counts over the generated tokens only: the prompt's 4 is not penalised
        s._counts[token] = s._counts.get(token, 0) + 1
    x = s.adjusted(logits, 5)
    assert np.allclose(x, [0.0, -(3 * 0.25 + 0.5), -(0.25 + 0.5), 0.0, 0.0, 0.0])
    # Greedy with a repeating favourite: without a penalty it repeats, with one it moves on.
    favourite = np.array([0.0, 2.0, 1.9, 1.8], dtype=np.float32)
    plain = Sampler(SamplingParams(max_tokens=3), (0,), ())
    assert [plain.choose(favourite, i) for i in range(3)] == [1, 1, 1]
    penal = Sampler(SamplingParams(max_tokens=3, frequency_penalty=0.5), (0,), ())
    assert [penal.choose(favourite, i) for i in range(3)] == [1, 2, 3]
    # A negative presence penalty favours what was said.
    keen = Sampler(SamplingParams(max_tokens=3, presence_penalty=-2.0), (0,), ())
    assert [keen.choose(np.array([0.0, 1.0, 1.5], dtype=np.float32), i) for i in range(2)] == [2, 2]


def test_logit_bias_forces_and_bans_and_min_tokens_blocks_stop_token_ids():
    logits = np.array([0.0, 1.0, 5.0, 3.0, 2.0], dtype=np.float32)
    assert Sampler(SamplingParams(max_tokens=2, logit_bias=((2, -100.0),)), (0,), ()).choose(logits, 0) == 3
    sampled = Sampler(SamplingParams(max_tokens=9, temperature=1.0, seed=5, logit_bias=((1, 100.0),)), (0,), ())
    assert {sampled.choose(logits, i) for i in range(9)} == {1}
    blocked = Sampler(SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=(2,)), (0,), ())
    assert blocked.choose(logits, 0) == 3 and blocked.choose(logits, 2) == 2


def test_the_new_values_are_parsed_and_bad_ones_refused_by_name():
    p = _parse(presence_penalty=1.5, frequency_penalty=-2, logit_bias={"7": 5, "3": -100}, stop_token_ids=[9, 9, 4],
               logprobs=3, n=4)
    assert (p.presence_penalty, p.frequency_penalty, p.logprobs, p.n) == (1.5, -2.0, 3, 4)
    assert p.logit_bias == ((3, -100.0), (7, 5.0)) and p.stop_token_ids == (4, 9)
    assert _parse().n == 1 and _parse().logprobs is None
    for given, named in [({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": "x"}, "frequency"),
                         ({"logit_bias": {"100": 1}}, "logit_bias holds token id 100"),
                         ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
                         ({"logit_bias": [1]}, "logit_bias"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
                         ({"stop_token_ids": 5}, "stop_token_ids"), ({"logprobs": 21}, "logprobs"),
                         ({"logprobs": -1}, "logprobs"), ({"n": 0}, "n=0"), ({"n": 129}, "n=129")]:
        with pytest.raises(SamplingError, match=named):
            _parse(**given)


def test_each_choice_has_its_own_reproducible_seed():
    assert choice_seed(None, 3) is None and choice_seed(42, 0) == 42
    seeds = [choice_seed(42, i) for i in range(8)]
    assert len(set(seeds)) == 8 and seeds == [choice_seed(42, i) for i in range(8)]
    assert all(0 <= s < 2**63 for s in seeds) and choice_seed(43, 1) not in seeds


class _Tok:
    """A byte-level vocabulary: token i is GPT-2's spelling of byte i; 300 is a special token."""

    def __init__(self):
        from model_factory.backend.generation.detokenize import _byte_alphabet

        self.alphabet = _byte_alphabet()

    def decode(self, ids, skip_special_tokens=True):
        return "".join("<s>" if i == 300 else bytes([i]).decode("utf-8", errors="replace") for i in ids)

    def id_to_token(self, i):
        return "<s>" if i == 300 else self.alphabet[i]


def test_a_token_text_is_itself_or_its_bytes_when_it_splits_a_character():
    texts = TokenTexts(_Tok())
    assert texts(ord("a")) == ("a", [97]) and texts(300) == ("<s>", list(b"<s>"))
    assert texts(0xE2) == ("bytes:\\xe2", [0xE2])
    assert TokenTexts(None)(5) == ("<5>", [])


def test_plain_greedy_reads_the_row_in_place_and_picks_as_the_full_path_does():
    rng = np.random.default_rng(3)
    rows = rng.normal(size=(40, 4096)).astype(np.float32)
    rows[:10, 7] = 50.0  # eos the argmax: blocked before min_tokens, the next best taken
    rows[10:20, [5, 9]] = 60.0  # a tie: the first index, on both paths
    rows[20:25, [7, 11]] = 70.0  # eos tied with another token
    params = SamplingParams(max_tokens=8, min_tokens=4, stop_token_ids=(3,))
    fast = Sampler(params, (7,), ())
    assert fast._plain
    for i, row in enumerate(rows):
        for generated in (0, 4):
            want = int(np.argmax(fast.adjusted(row, generated)))
            assert fast.choose(row, generated) == want
    assert fast.choose(rows[0], 0) != 7 and fast.choose(rows[0], 4) == 7
    # In place: the row is never copied for an argmax that stands (adjusted() is the copying path).
    calls = []
    fast.adjusted = lambda *a, **k: calls.append(a) or Sampler.adjusted(fast, *a, **k)
    fast.choose(rows[30], 0)
    assert calls == []
    fast.choose(rows[0], 0)  # eos on top before min_tokens: the full path
    assert len(calls) == 1
    # Anything that changes the logits takes the full path.
    for changed in (dict(repetition_penalty=1.2), dict(presence_penalty=0.5), dict(logit_bias=((1, 2.0),)),
                    dict(temperature=0.7)):
        assert not Sampler(SamplingParams(max_tokens=4, **changed), (7,), (1, 2))._plain
