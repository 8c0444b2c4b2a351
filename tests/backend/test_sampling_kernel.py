"""Loading the compiled draw (``generation/sampling_kernel.py``): where it cannot be compiled, numpy's draw stays and
the reason is given once (the stub logs it); loaded, ``sample_token`` draws through it (its distribution is checked in
test_sampling_draw.py, which runs every test on both)."""

from __future__ import annotations


import numpy as np
import pytest

from model_factory.backend.generation import sampling_kernel
from model_factory.backend.generation.int8_attention import compile_problem
from model_factory.backend.generation.sampling import sample_token

needs_compiler = pytest.mark.skipif(compile_problem() is not None, reason=str(compile_problem()))


@pytest.fixture(autouse=True)
def numpy_after():
    sampling_kernel.unload()
    yield
    sampling_kernel.unload()


def test_a_kernel_that_cannot_be_compiled_leaves_numpy_s_draw_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("MF_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    why = sampling_kernel.load()
    assert why and why.startswith("the sampling kernel is not used (") and "does not run" in why, why
    assert why.endswith(": numpy's draw")
    assert not sampling_kernel.loaded()
    assert sampling_kernel.load() == why  # asked again: the same answer, no second compile
    x = np.random.default_rng(6).normal(size=2_000).astype(np.float32)
    assert sample_token(x, 0.8, 0, 1.0, lambda: 0.5) == _numpy_draw(x, 0.8, 0.5)


@needs_compiler
def test_the_kernel_compiles_once_into_the_cache_and_draws_what_numpy_draws(monkeypatch, tmp_path):
    """Compiled into $MF_KERNEL_CACHE on first load, the cached library reused after; its draw without top-p is the
    inverse CDF numpy's draw takes, on the same uniform, for a grid of them (both within float rounding of the same
    boundaries: the grid's points are far from any)."""
    monkeypatch.setenv("MF_KERNEL_CACHE", str(tmp_path))
    assert sampling_kernel.load() is None and sampling_kernel.loaded()
    built = list(tmp_path.rglob(sampling_kernel.LIBRARY_NAME))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    sampling_kernel.unload()
    assert sampling_kernel.load() is None and built[0].stat().st_mtime_ns == stamp
    x = np.random.default_rng(8).normal(scale=3.0, size=262_144).astype(np.float32)
    cdf = np.cumsum(np.exp((x.astype(np.float64) - x.max()) / 0.9))
    cdf /= cdf[-1]
    us = [u for u in np.linspace(0.013, 0.987, 61)  # those at least 1e-5 from a boundary (rounding moves ~1e-8)
          if np.abs(cdf - u).min() > 1e-5][:40]
    assert len(us) >= 20
    on_kernel = [sample_token(x, 0.9, 0, 1.0, lambda u=u: float(u)) for u in us]
    sampling_kernel.unload()
    assert on_kernel == [sample_token(x, 0.9, 0, 1.0, lambda u=u: float(u)) for u in us]


def _numpy_draw(x: np.ndarray, temperature: float, u: float) -> int:
    p = np.exp((x.astype(np.float64) - x.max()) / temperature)
    cdf = np.cumsum(p)
    return int(np.searchsorted(cdf, u * cdf[-1], side="right"))


@needs_compiler
def test_log_probabilities_on_the_kernel_are_numpy_s():
    """token_logprobs on the kernel's normalizer (and its blocks' maxima for the top ids): numpy's log-softmax to
    within float rounding, the same top ids; an impossible token and a row with nothing finite read as the floor."""
    from model_factory.backend.generation.sampling import LOGPROB_FLOOR, token_logprobs

    rng = np.random.default_rng(3)
    rows = [rng.normal(scale=4.0, size=262_144).astype(np.float32), rng.normal(size=1_000).astype(np.float32),
            np.array([0.0, -np.inf, 1.0], dtype=np.float32)]
    rows[0][[5, 77_000]] = 30.0  # a tie at the top
    cases = [(rows[0], 17, 20), (rows[0], 77_000, 5), (rows[1], 3, 0), (rows[1], 999, 7), (rows[2], 1, 3),
             (rows[2], 0, 5), (np.full(600, -np.inf, dtype=np.float32), 4, 2)]
    want = [token_logprobs(x, t, k) for x, t, k in cases]
    assert sampling_kernel.load() is None
    got = [token_logprobs(x, t, k) for x, t, k in cases]
    for g, w in zip(got, want):
        assert abs(g.logprob - w.logprob) <= 1e-5 and g.top_ids == w.top_ids, (g, w)
        assert np.allclose(g.top_logprobs, w.top_logprobs, rtol=0, atol=1e-5)
    assert got[1].top_ids[:2] == (5, 77_000)
    assert got[4].logprob == got[6].logprob == LOGPROB_FLOOR
