"""The sampler's draw (``sampling.sample_token``) against the distribution it must draw from, computed here the plain
way (float64 softmax, a full sort for top-p). Without top-p one uniform draws by the inverse CDF in token order: on an
even grid of ``u`` each token gets its probability's share of the grid to within a step, and the very token the
plain inverse CDF gives; with top-p (drawn by rejection, more uniforms where a draw falls outside the nucleus) the
counts of seeded draws must match the nucleus' distribution to within 4 standard deviations, and nothing outside it
is drawn. Small vocabularies (one level) and Gemma's 262,144 tokens (two levels); masked tokens never drawn.

Every test runs on each draw the backend has: numpy's, and the compiled kernel (``sampling_kernel``; on a host with
AVX-512 its AVX2 build too), where this host can compile it."""

from __future__ import annotations

import numpy as np
import pytest

from model_factory.backend.generation import sampling_kernel
from model_factory.backend.generation.int8_attention import _cpu_flags
from model_factory.backend.generation.sampling import Sampler, SamplingParams, sample_token

DRAWS = ["numpy", "kernel"] + (["kernel-avx2"] if "avx512f" in _cpu_flags().split() else [])


@pytest.fixture(autouse=True, params=DRAWS)
def draw(request):
    """The draw sample_token uses for the test: numpy's, or the kernel (skipped, with the reason, where it cannot be
    compiled here)."""
    sampling_kernel.unload()
    if request.param != "numpy":
        why = sampling_kernel.load(isa="avx2" if request.param == "kernel-avx2" else "native")
        if why:
            pytest.skip(why)
        assert sampling_kernel.loaded()
    yield request.param
    sampling_kernel.unload()

GRID = 20_000  # draws a case (1,000 at 262k tokens: about a millisecond each)


def _distribution(x: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The probabilities the draw must follow: softmax(x / T), top-k (ties at the k-th kept), then top-p (the fewest
    most likely tokens whose mass reaches top_p, ties in token order), renormalised."""
    z = x.astype(np.float64) / temperature
    if top_k and top_k < z.size:
        z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
    p = np.exp(z - z.max())
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order]) / p.sum()
        keep = order[:int(np.searchsorted(cum, top_p)) + 1]
        p = np.where(np.isin(np.arange(p.size), keep), p, 0.0)
    return p / p.sum()


def _plain_inverse_cdf(dist: np.ndarray, u: float) -> int:
    cdf = np.cumsum(dist)
    return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), dist.size - 1)


def _grid(vocab: int) -> np.ndarray:
    n = GRID if vocab < 100_000 else GRID // 20
    return (np.arange(n) + 0.5) / n


CASES = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 50, 1.0), (0.7, 0, 0.9), (1.0, 64, 0.95), (1.5, 0, 0.95),
         (0.3, 0, 0.5), (2.0, 1000, 0.99)]


@pytest.mark.parametrize("vocab,temperature,top_k,top_p",
                         [(v, *c) for v in (97, 1_000) for c in CASES] + [(262_144, *c) for c in CASES[:6]])
def test_the_draw_gives_each_token_its_probability(vocab, temperature, top_k, top_p):
    rng = np.random.default_rng(vocab)
    x = rng.normal(scale=4.0, size=vocab).astype(np.float32)  # Gemma's logits spread about this wide
    x[rng.choice(vocab, size=3, replace=False)] += 12.0  # a few likely tokens, as a language model has
    before = x.copy()
    dist = _distribution(x, temperature, top_k, top_p)
    if top_p >= 1.0:
        us = _grid(vocab)
        tokens = [sample_token(x, temperature, top_k, top_p, lambda u=u: float(u)) for u in us]
        counts = np.bincount(tokens, minlength=vocab)
        assert np.abs(counts - dist * us.size).max() <= 2.0  # a token's share of the grid: its probability, a step
        step = 50 if vocab < 100_000 else 10
        assert all(t == _plain_inverse_cdf(dist, u) for t, u in zip(tokens[::step], us[::step]))
    else:
        draws = GRID if vocab < 100_000 else GRID // 10
        uniforms = np.random.default_rng(7)
        counts = np.bincount([sample_token(x, temperature, top_k, top_p, uniforms.random) for _ in range(draws)],
                             minlength=vocab)
        expected = dist * draws
        assert (np.abs(counts - expected) <= 4 * np.sqrt(expected * (1 - dist)) + 3).all()
    assert counts[dist == 0].sum() == 0  # nothing outside top-k / the nucleus
    assert np.array_equal(x, before), "the draw changed the logits"


def test_masked_tokens_are_never_drawn_even_where_rounding_lands_on_them():
    rng = np.random.default_rng(1)
    x = rng.normal(size=262_144).astype(np.float32)
    allowed = np.zeros(x.size, dtype=bool)
    allowed[[5, 300, 70_000, 262_143]] = True  # a grammar's few tokens, far apart (different blocks)
    x[~allowed] = -np.inf
    us = np.concatenate([np.linspace(0.0, 1.0 - 1e-16, 2_001), [np.nextafter(1.0, 0.0)]])
    assert {sample_token(x, 1.0, 0, 1.0, lambda u=u: float(u)) for u in us} == {5, 300, 70_000, 262_143}
    uniforms = np.random.default_rng(3)
    assert {sample_token(x, 1.0, 0, 0.5, uniforms.random) for _ in range(200)} <= {5, 300, 70_000, 262_143}
    only = np.full(1_000, -np.inf, dtype=np.float32)
    only[999] = 0.0
    assert {sample_token(only, 0.8, 0, 1.0, lambda u=u: float(u)) for u in us} == {999}


def test_the_sampler_draws_from_the_row_unchanged_and_blocks_eos_before_min_tokens():
    rng = np.random.default_rng(2)
    x = rng.normal(size=4_096).astype(np.float32)
    x[7] = 40.0  # eos, far the likeliest
    before = x.copy()
    free = Sampler(SamplingParams(max_tokens=9, temperature=1.0, seed=4), eos_token_ids=(7,), prompt_ids=())
    assert {free.choose(x, 0) for _ in range(20)} == {7}
    assert np.array_equal(x, before)
    held = Sampler(SamplingParams(max_tokens=9, min_tokens=5, temperature=1.0, seed=4), (7,), ())
    assert 7 not in {held.choose(x, i) for i in range(5)}
    assert np.array_equal(x, before)  # blocked for the draw in the row itself, and put back
    assert held.choose(x, 5) == 7
    frozen = x.copy()
    frozen.flags.writeable = False  # a row that cannot be written: blocked in a copy
    assert 7 not in {held.choose(frozen, i) for i in range(5)}
    assert np.array_equal(frozen, before)
    again = Sampler(SamplingParams(max_tokens=9, temperature=1.0, top_p=0.9, seed=4), (7,), ())
    first = Sampler(SamplingParams(max_tokens=9, temperature=1.0, top_p=0.9, seed=4), (7,), ())
    x[7] = 0.0
    assert [again.choose(x, i) for i in range(30)] == [first.choose(x, i) for i in range(30)]  # seeded: repeatable


def test_a_draw_rejected_outside_the_nucleus_is_made_again_from_the_same_nucleus():
    # Two likely tokens hold 0.55 and 100 equal ones the other 0.45: at top_p 0.5 the nucleus is the two (after the
    # first, 0.3 < 0.5), and 45 % of first draws land outside it. What is drawn again must still be judged against the
    # whole distribution's mass, not what is left after the rejection: the two keep their 0.3 : 0.25.
    probs = np.array([0.3, 0.25] + [0.0045] * 100)
    x = np.log(probs).astype(np.float32)
    uniforms = np.random.default_rng(11)
    counts = np.bincount([sample_token(x, 1.0, 0, 0.5, uniforms.random) for _ in range(20_000)], minlength=102)
    assert counts[2:].sum() == 0
    share = counts[0] / 20_000
    assert abs(share - 0.3 / 0.55) <= 4 * np.sqrt(0.3 / 0.55 * 0.25 / 0.55 / 20_000)


def test_a_temperature_near_zero_draws_the_most_likely_token():
    x = np.random.default_rng(5).normal(size=262_144).astype(np.float32)
    best = int(np.argmax(x))
    assert {sample_token(x, 1e-40, 0, 1.0, lambda u=u: u) for u in (0.0, 0.5, 0.999)} == {best}
    assert {sample_token(x, 1e-40, 0, 0.9, np.random.default_rng(1).random) for _ in range(3)} == {best}


def test_ties_at_the_kth_value_are_kept_and_the_nucleus_takes_ties_in_token_order():
    x = np.zeros(3_000, dtype=np.float32)
    x[[10, 2_000]] = 3.0
    x[[5, 700, 1_500, 2_999]] = 2.0  # the 3rd largest value, four times: top-k 3 keeps all six
    us = (np.arange(6_000) + 0.5) / 6_000
    counts = np.bincount([sample_token(x, 1.0, 3, 1.0, lambda u=u: float(u)) for u in us], minlength=x.size)
    dist = _distribution(x, 1.0, 3, 1.0)
    assert set(np.flatnonzero(counts)) == {5, 10, 700, 1_500, 2_000, 2_999}
    assert np.abs(counts - dist * us.size).max() <= 2.0
    flat = np.zeros(100, dtype=np.float32)  # 100 equal tokens: the nucleus of 0.05 is the first five
    uniforms = np.random.default_rng(9)
    counts = np.bincount([sample_token(flat, 1.0, 0, 0.05, uniforms.random) for _ in range(5_000)], minlength=100)
    assert set(np.flatnonzero(counts)) == {0, 1, 2, 3, 4}
    assert (np.abs(counts[:5] - 1_000) <= 4 * np.sqrt(1_000 * 0.8)).all()


def test_a_nan_or_infinite_logit_takes_the_argmax_as_numpy_does():
    x = np.random.default_rng(4).normal(size=5_000).astype(np.float32)
    x[1_234] = np.inf
    assert sample_token(x, 1.0, 0, 0.9, np.random.default_rng(0).random) == 1_234
    x[1_234], x[77] = 0.0, np.nan
    assert sample_token(x, 1.0, 40, 1.0, np.random.default_rng(0).random) == int(np.argmax(x)) == 77

