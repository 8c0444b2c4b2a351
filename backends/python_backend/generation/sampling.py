"""Sampling parameters of one generate request, checked, and the per-sequence token sampler.

:func:`parse_sampling` turns what a request gave (explicit Triton inputs, the vLLM-style
``sampling_parameters`` JSON, the model's defaults from ``generation.json``) into one frozen
:class:`SamplingParams`, refusing every bad value with a :class:`SamplingError` that names it (the
Triton model answers INVALID_ARG, the OpenAI frontend 400). :class:`Sampler` picks each next token:
repetition penalty (Hugging Face's: positive logits of seen tokens divided by it, negative ones
multiplied), OpenAI's presence and frequency penalties over the generated tokens (``logit -= count *
frequency_penalty + (count > 0) * presence_penalty``), ``logit_bias`` added, eos and ``stop_token_ids``
blocked until ``min_tokens``, then greedy (``temperature == 0``) or temperature, top-k and top-p sampling
from the sequence's own random generator, seeded per request: the same seed gives the same tokens whatever
else the batch holds, and a sequence preempted and resumed keeps its generator. A choice ``i > 0`` of a
request with ``n`` choices samples from :func:`choice_seed` (the request's seed and ``i``), so a seeded
request with ``n`` choices is reproducible too. A greedy sequence with nothing that changes its logits takes its row's
argmax in place, without the copy the adjustments make (a 262k vocabulary's row is 1 MiB); one that samples with
nothing to adjust draws from the row in place too (before ``min_tokens``, its stopping tokens set to -inf in the row
for the draw and put back). The draw (:func:`sample_token`) never sorts or copies the
vocabulary in float64: float32 probabilities in a per-thread buffer, a two-level inverse CDF, top-k by blocks, top-p by
rejection (each under a millisecond a row at Gemma's 262k tokens, where a full-vocabulary draw took 2-30 ms).

Log-probabilities (``logprobs``: None, or how many alternatives beside the chosen token) are the model's own
distribution: the log-softmax of the raw logits, before penalties, bias and temperature (what vLLM reports by
default, and what OpenAI's API documents as the token's log-probability). The top alternatives come from
:func:`top_ids` (the blocks of the largest maxima, then an ``argpartition``: no sort, no partition of the whole
vocabulary), and only for the sequences that ask.

numpy and the standard library only (runs inside Triton's Python-backend stub).
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from . import sampling_kernel

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_LOGPROBS = 20  # OpenAI's chat top_logprobs bound (completions' logprobs are at most 5: the frontend says so)
MAX_CHOICES = 128  # OpenAI's bound on n
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 64
LOGPROB_FLOOR = -9999.0  # an impossible token's log-probability, as vLLM reports it (JSON has no -inf)
_SEED_LIMIT = 1 << 63
# Names of the vLLM-style sampling_parameters JSON this backend reads (others are refused, not ignored).
JSON_NAMES = ("max_tokens", "min_tokens", "ignore_eos", "temperature", "top_k", "top_p", "repetition_penalty",
              "seed", "stop", "exclude_input_in_output", "presence_penalty", "frequency_penalty", "logit_bias",
              "stop_token_ids", "logprobs", "n", "guided")


class SamplingError(ValueError):
    """A request's generation parameter that is out of range or of the wrong type (the message names it)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is generated (every value checked by :func:`parse_sampling`)."""

    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, ids sorted
    stop_token_ids: tuple[int, ...] = ()  # generation stops at these tokens too (vLLM's), their text not output
    logprobs: int | None = None  # None: none; k: the chosen token's and the k most likely
    n: int = 1  # sequences generated for the request (choices 0..n-1)
    guided: Any = None  # a grammar the output follows (structured.grammar.GuidedSpec), None: free

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's log-probability and the most likely alternatives (ids and log-probabilities, the
    most likely first), from the raw logits of the step that chose it."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


_SCRATCH = threading.local()


def _scratch(size: int) -> np.ndarray:
    """This thread's float32 work buffer of ``size`` (kept between draws: a 1 MiB array made afresh each draw cost
    more in page faults than the arithmetic)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.size < size:
        buf = _SCRATCH.buf = np.empty(size, dtype=np.float32)
    return buf[:size]


def token_logprobs(logits: np.ndarray, token: int, top: int) -> TokenLogprobs:
    """Log-softmax of ``logits`` at ``token`` and at the ``top`` most likely ids (argpartition, then a sort of
    those ``top`` only: a 262k vocabulary costs one pass for the normalizer and one for the partition; on the
    compiled kernel the normalizer's first pass gives the blocks' maxima :func:`top_ids` reads)."""
    x = np.ascontiguousarray(logits, dtype=np.float32).reshape(-1)
    maxima = None
    if sampling_kernel.loaded():  # one pass for the blocks' maxima (top_ids reads them too), one for the sum
        lse, maxima = sampling_kernel.log_normalizer(x)
    else:
        peak = float(x.max())
        with np.errstate(invalid="ignore"):  # nothing finite (-inf - -inf): NaN, read as the floor below
            work = np.subtract(x, np.float32(peak), out=_scratch(x.size))
        lse = peak + math.log(float(np.exp(work, out=work).sum(dtype=np.float64)))

    def lp(value: float) -> float:
        out = float(value) - lse
        return out if math.isfinite(out) and out > LOGPROB_FLOOR else LOGPROB_FLOOR

    if top <= 0:
        return TokenLogprobs(lp(x[token]))
    idx = top_ids(x, int(top), maxima)
    return TokenLogprobs(lp(x[token]), tuple(int(i) for i in idx), tuple(lp(x[i]) for i in idx))


_BLOCK = sampling_kernel.BLOCK  # top_ids' blocks: the kernel's, whose maxima token_logprobs hands it


def block_maxima(x: np.ndarray) -> np.ndarray:
    """The maximum of each run of :data:`_BLOCK` entries of ``x`` (the last run may be shorter)."""
    return np.maximum.reduceat(x, np.arange(0, x.size, _BLOCK))


def _block_members(blocks: np.ndarray, size: int) -> np.ndarray:
    """The entries of ``blocks`` (of a row of ``size``), in order."""
    members = (np.sort(blocks)[:, None] * _BLOCK + np.arange(_BLOCK)).reshape(-1)
    return members[members < size] if members.size and members[-1] >= size else members


def top_ids(x: np.ndarray, k: int, maxima: np.ndarray | None = None) -> np.ndarray:
    """The ``k`` largest entries' ids, the largest first (ties in token order). Over a large vocabulary, by blocks:
    the top ``k`` lie in the ``k`` blocks of the largest maxima (a block holding one of them has a maximum at least
    the k-th value, and at most ``k`` blocks do), so one pass for the blocks' maxima (``maxima``, if the caller has
    them) and an ``argpartition`` of ``k`` blocks' entries replace a partition of the whole row (numpy's partition
    of 262k floats took 10x the maxima's pass)."""
    k = min(int(k), x.size)
    if -(-x.size // _BLOCK) <= 4 * k:
        cand = np.arange(x.size)
    else:
        maxima = block_maxima(x) if maxima is None else maxima
        cand = _block_members(np.argpartition(maxima, maxima.size - k)[maxima.size - k:], x.size)
    vals = x[cand]
    if k < cand.size:
        keep = np.sort(np.argpartition(vals, cand.size - k)[cand.size - k:])
        cand, vals = cand[keep], vals[keep]
    return cand[np.argsort(-vals, kind="stable")]


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request seeded ``seed``: the seed itself for choice 0 (n = 1 is
    unchanged), one derived from both for the others (numpy's SeedSequence); None stays None (random)."""
    if seed is None or index == 0:
        return seed
    state = np.random.SeedSequence([int(seed), int(index)]).generate_state(2, np.uint32)
    return (int(state[0]) << 31 | int(state[1]) >> 1) % _SEED_LIMIT


def _number(name: str, value: Any, kind: type) -> Any:
    if isinstance(value, (np.generic, np.ndarray)):
        value = np.asarray(value).reshape(-1)
        if value.size != 1:
            raise SamplingError(f"{name} must be one value, got {value.size}")
        value = value[0].item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingError(f"{name}={value!r} must be a number")
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise SamplingError(f"{name}={value!r} must be a whole number")
        return int(value)
    value = float(value)
    if not math.isfinite(value):
        raise SamplingError(f"{name}={value!r} must be finite")
    return value


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, (np.generic, np.ndarray)):
        value = np.asarray(value).reshape(-1)
        if value.size != 1:
            raise SamplingError(f"{name} must be one value, got {value.size}")
        value = value[0].item()
    if not isinstance(value, bool):
        raise SamplingError(f"{name}={value!r} must be true or false")
    return value


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)):
        value = [value]
    if isinstance(value, np.ndarray):
        value = value.reshape(-1).tolist()
    if not isinstance(value, (list, tuple)):
        raise SamplingError(f"stop={value!r} must be a string or a list of strings")
    out = []
    for item in value:
        if isinstance(item, bytes):
            try:
                item = item.decode("utf-8")
            except UnicodeDecodeError:
                raise SamplingError("stop holds bytes that are not UTF-8") from None
        if not isinstance(item, str):
            raise SamplingError(f"stop entry {item!r} must be a string")
        if not item:
            raise SamplingError("stop holds an empty string (it would stop before the first token)")
        if len(item) > MAX_STOP_LENGTH:
            raise SamplingError(f"stop entry of {len(item)} characters is longer than {MAX_STOP_LENGTH}")
        out.append(item)
    if len(out) > MAX_STOP_STRINGS:
        raise SamplingError(f"stop holds {len(out)} strings: at most {MAX_STOP_STRINGS}")
    return tuple(out)


def _token_id(name: str, value: Any, vocab_size: int | None) -> int:
    if isinstance(value, str):  # logit_bias keys are token ids as JSON strings (OpenAI's shape)
        try:
            value = int(value.strip())
        except ValueError:
            raise SamplingError(f"{name} key {value!r} must be a token id") from None
    token = _number(name, value, int)
    if token < 0 or (vocab_size is not None and token >= vocab_size):
        raise SamplingError(f"{name} holds token id {token}, outside the vocabulary [0, {vocab_size})")
    return token


def _logit_bias(value: Any, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise SamplingError("logit_bias must be an object of token id -> bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise SamplingError(f"logit_bias holds {len(value)} tokens: at most {MAX_LOGIT_BIAS}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = _token_id("logit_bias", key, vocab_size)
        bias = _number("logit_bias", bias, float)
        if not -100.0 <= bias <= 100.0:
            raise SamplingError(f"logit_bias={bias} for token {token} must be between -100 and 100")
        out[token] = bias
    return tuple(sorted(out.items()))


def _stop_token_ids(value: Any, vocab_size: int | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, np.ndarray):
        value = value.reshape(-1).tolist()
    if not isinstance(value, (list, tuple)):
        raise SamplingError(f"stop_token_ids={value!r} must be a list of token ids")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise SamplingError(f"stop_token_ids holds {len(value)} ids: at most {MAX_STOP_TOKEN_IDS}")
    return tuple(sorted({_token_id("stop_token_ids", t, vocab_size) for t in value}))


def parse_sampling(given: Mapping[str, Any], defaults: Any, *, prompt_tokens: int, max_context: int,
                   vocab_size: int | None = None) -> SamplingParams:
    """Checked :class:`SamplingParams` from the values a request gave (None or absent: the default).

    ``defaults`` is the model's ``contract.SamplingDefaults``: a request that names no temperature is
    greedy unless the model's generation config samples (``do_sample``). A prompt that leaves no room in the
    context, or ``max_tokens`` past it, is refused with both lengths; without ``max_tokens`` the default is
    cut to the room left.
    """
    v = {k: val for k, val in given.items() if val is not None}
    room = max_context - prompt_tokens
    if prompt_tokens < 1:
        raise SamplingError("the prompt is empty: give text_input or prompt_ids with at least one token")
    if room < 1:
        raise SamplingError(f"the prompt has {prompt_tokens} tokens and the context holds {max_context}: "
                            "shorten the prompt")
    if "max_tokens" in v:
        max_tokens = _number("max_tokens", v["max_tokens"], int)
        if max_tokens < 1:
            raise SamplingError(f"max_tokens={max_tokens} must be at least 1")
        if max_tokens > room:
            raise SamplingError(f"max_tokens={max_tokens} with a prompt of {prompt_tokens} tokens exceeds the "
                                f"context of {max_context} tokens: at most {room}")
    else:
        max_tokens = max(1, min(int(defaults.max_tokens), room))
    min_tokens = _number("min_tokens", v.get("min_tokens", 0), int)
    if not 0 <= min_tokens <= max_tokens:
        raise SamplingError(f"min_tokens={min_tokens} must be between 0 and max_tokens={max_tokens}")
    default_t = float(defaults.temperature) if defaults.do_sample else 0.0
    temperature = _number("temperature", v.get("temperature", default_t), float)
    if not 0.0 <= temperature <= 100.0:
        raise SamplingError(f"temperature={temperature} must be between 0 (greedy) and 100")
    top_k = _number("top_k", v.get("top_k", defaults.top_k if defaults.do_sample else 0), int)
    if top_k == -1:  # vLLM's spelling of "off"
        top_k = 0
    if top_k < 0:
        raise SamplingError(f"top_k={top_k} must be 0 or -1 (off) or positive")
    top_p = _number("top_p", v.get("top_p", defaults.top_p if defaults.do_sample else 1.0), float)
    if not 0.0 < top_p <= 1.0:
        raise SamplingError(f"top_p={top_p} must be in (0, 1]")
    penalty = _number("repetition_penalty", v.get("repetition_penalty", defaults.repetition_penalty), float)
    if not 0.0 < penalty <= 100.0:
        raise SamplingError(f"repetition_penalty={penalty} must be in (0, 100] (1: off)")
    seed = v.get("seed")
    if seed is not None:
        seed = _number("seed", seed, int)
        if not 0 <= seed < _SEED_LIMIT:
            raise SamplingError(f"seed={seed} must be between 0 and 2**63 - 1")
    ignore_eos = _flag("ignore_eos", v.get("ignore_eos", False))
    presence, frequency = (_number(name, v.get(name, 0.0), float) for name in ("presence_penalty", "frequency_penalty"))
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -2.0 <= value <= 2.0:
            raise SamplingError(f"{name}={value} must be between -2 and 2")
    logprobs = v.get("logprobs")
    if logprobs is not None:
        logprobs = _number("logprobs", logprobs, int)
        if not 0 <= logprobs <= MAX_LOGPROBS:
            raise SamplingError(f"logprobs={logprobs} must be between 0 and {MAX_LOGPROBS} (alternatives per token)")
    n = _number("n", v.get("n", 1), int)
    if not 1 <= n <= MAX_CHOICES:
        raise SamplingError(f"n={n} must be between 1 and {MAX_CHOICES}")
    return SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                          temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=penalty,
                          seed=seed, stop=_stops(v.get("stop")), presence_penalty=presence,
                          frequency_penalty=frequency, logit_bias=_logit_bias(v.get("logit_bias"), vocab_size),
                          stop_token_ids=_stop_token_ids(v.get("stop_token_ids"), vocab_size), logprobs=logprobs, n=n)


class Sampler:
    """Picks the next tokens of one sequence from its logits (its own seeded generator)."""

    def __init__(self, params: SamplingParams, eos_token_ids: Sequence[int], prompt_ids: Sequence[int]) -> None:
        self.params = params
        # Tokens blocked until min_tokens: eos, and the stop token ids (they would end the sequence as well).
        self.eos = np.asarray(sorted(set(int(e) for e in eos_token_ids) | set(params.stop_token_ids)),
                              dtype=np.int64)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self._seen = set(int(t) for t in prompt_ids) if params.repetition_penalty != 1.0 else None
        # Generated tokens' counts, kept only when a presence or frequency penalty asks for them.
        self._counts: dict[int, int] | None = {} if (params.presence_penalty or params.frequency_penalty) else None
        self._bias_ids = np.asarray([t for t, _ in params.logit_bias], dtype=np.int64)
        self._bias = np.asarray([b for _, b in params.logit_bias], dtype=np.float32)
        self.last: TokenLogprobs | None = None  # the last chosen token's log-probabilities, when asked
        # Greedy with nothing that changes the logits but min_tokens' block: chosen by _plain_greedy, in place.
        self._unadjusted = self._seen is None and self._counts is None and not self._bias_ids.size
        self._plain = params.greedy and self._unadjusted
        self._blocked = frozenset(int(e) for e in self.eos)

    def adjusted(self, logits: np.ndarray, generated: int, allowed: np.ndarray | None = None) -> np.ndarray:
        """The logits the choice is made from: repetition, presence and frequency penalties, logit_bias, the
        stopping tokens blocked before ``min_tokens``, and, with a grammar, every token outside ``allowed`` (its
        mask: one boolean a token) blocked; where ``min_tokens`` would leave the grammar nothing (its end allows
        only eos), the grammar wins (a copy; ``logits`` is left as it is)."""
        p = self.params
        x = np.array(logits, dtype=np.float32, copy=True).reshape(-1)
        if self._seen:
            idx = np.fromiter(self._seen, dtype=np.int64)
            idx = idx[idx < x.size]
            seen = x[idx]
            x[idx] = np.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
        if self._counts:
            idx = np.fromiter(self._counts.keys(), dtype=np.int64, count=len(self._counts))
            counts = np.fromiter(self._counts.values(), dtype=np.float32, count=len(self._counts))
            keep = idx < x.size
            x[idx[keep]] -= counts[keep] * np.float32(p.frequency_penalty) + np.float32(p.presence_penalty)
        if self._bias_ids.size:
            keep = self._bias_ids < x.size
            x[self._bias_ids[keep]] += self._bias[keep]
        if allowed is not None:
            keep = np.zeros(x.size, dtype=bool)
            keep[:min(x.size, allowed.size)] = allowed[:x.size]
            if generated < p.min_tokens and self.eos.size and keep[self.eos[self.eos < x.size]].sum() < keep.sum():
                x[self.eos[self.eos < x.size]] = -np.inf
            x[~keep] = -np.inf
            return x
        if generated < p.min_tokens and self.eos.size:
            x[self.eos[self.eos < x.size]] = -np.inf
        return x

    def choose(self, logits: np.ndarray, generated: int, allowed: np.ndarray | None = None) -> int:
        """The next token from one row of logits; ``generated``: tokens this sequence made before it; ``allowed``:
        a grammar's mask (None: every token). With ``logprobs`` asked, :attr:`last` holds its log-probabilities
        (from ``logits`` as the model gave them)."""
        p = self.params
        plain = self._plain and allowed is None and isinstance(logits, np.ndarray) and logits.dtype == np.float32
        token = self._plain_greedy(logits, generated) if plain else None
        if token is None:
            if not p.greedy and self._unadjusted and allowed is None:
                # Nothing to adjust but, before min_tokens, the stopping tokens' block: drawn from the row itself.
                blocked = generated < p.min_tokens and self.eos.size
                token = self._sample_blocking(logits, generated) if blocked else self._sample(logits)
            else:
                x = self.adjusted(logits, generated, allowed)
                token = int(np.argmax(x)) if p.greedy else self._sample(x)
        if self._seen is not None:
            self._seen.add(token)
        if self._counts is not None:
            self._counts[token] = self._counts.get(token, 0) + 1
        self.last = token_logprobs(logits, token, p.logprobs) if p.logprobs is not None else None
        return token

    def _plain_greedy(self, logits: np.ndarray, generated: int) -> int | None:
        """Greedy without penalties or bias: the row's argmax, read in place (no copy of the row: 1 MiB a row at a
        262k vocabulary, 32 MiB a step at 32 rows). Before ``min_tokens`` the argmax stands unless it is a blocked
        stopping token (blocking only lowers those: no other token's rank changes, ties included); None then, and
        the caller takes the full path."""
        token = int(np.argmax(logits))
        if generated < self.params.min_tokens and self.eos.size and token in self._blocked:
            return None
        return token

    def _sample_blocking(self, logits: np.ndarray, generated: int) -> int:
        """A draw from ``logits`` with the stopping tokens blocked (before ``min_tokens``) without a copy of the row:
        their logits set to -inf for the draw and put back after it (the row is as it was when this returns; the
        engine loop is the only one to read it meanwhile). A row that cannot be written is copied."""
        row = logits.reshape(-1) if isinstance(logits, np.ndarray) and logits.dtype == np.float32 else None
        if row is None or not row.flags.writeable or not np.may_share_memory(row, logits):
            return self._sample(self.adjusted(logits, generated))
        ids = self.eos[self.eos < row.size]
        saved = row[ids]  # a copy (fancy indexing)
        row[ids] = -np.inf
        try:
            return self._sample(row)
        finally:
            row[ids] = saved

    def _sample(self, x: np.ndarray) -> int:
        return sample_token(x, self.params.temperature, self.params.top_k, self.params.top_p, self.rng.random)


_DRAW_BLOCK = 256  # tokens a block of the two-level draw (a 262k vocabulary: 1,024 blocks)
_MAX_REJECTIONS = sampling_kernel.MAX_REJECTIONS  # the same bound on both draws
_EXACT_NEAR = 1e-4  # a float32 sum's error over 262k tokens is ~1e-6 of it: within this of the edge, float64


def sample_token(x: np.ndarray, temperature: float, top_k: int, top_p: float, uniform: Callable[[], float]) -> int:
    """A token drawn from ``softmax(x / temperature)`` cut to the ``top_k`` largest (ties at the k-th kept), then to
    the nucleus of ``top_p`` (the fewest most likely tokens whose mass reaches it, ties in token order), with the
    uniforms in [0, 1) that ``uniform`` gives (one, or more where top-p rejects a draw).

    What a 262k vocabulary costs: no sort and no float64 copy of it. One float32 pass for the probabilities; an
    inverse-CDF draw in token order over two levels (the blocks' sums, then one block's); top-k from
    :func:`top_ids`; top-p by rejection, as FlashInfer's GPU sampling does it: a token drawn from the whole
    distribution is in the nucleus when the tokens before it (more likely, or as likely and earlier) hold less than
    ``top_p`` of the mass, one masked sum; a token outside it takes the tokens after it out too, and the draw is made
    again from those left (a superset of the nucleus, so what is accepted follows the nucleus' distribution exactly);
    a rejection has probability ``1 - top_p`` at most. Numpy's argsort of a 262k row for top-p took 30 ms a row,
    200x greedy's argmax (Gemma 3 270M's vocabulary, whose generation config samples with top-k 64 and top-p 0.95).
    ``x`` is not changed; tokens at -inf (a grammar's mask, eos before min_tokens) are never drawn while any other
    is possible."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if sampling_kernel.loaded():
        token = sampling_kernel.draw(x, temperature, top_k, top_p, uniform)
        return int(np.argmax(x)) if token is None else token
    idx = None
    if top_k and top_k < x.size:
        maxima = block_maxima(x) if x.size > 4 * _BLOCK else None
        if np.isnan(x if maxima is None else maxima).any():
            return int(np.argmax(x))  # a NaN logit (its block's maximum is NaN): the argmax, as without top-k
        kth = x[top_ids(x, int(top_k), maxima)[-1]]
        if maxima is None:
            idx = np.flatnonzero(x >= kth)  # ties at the k-th kept, in token order
        else:  # the same, looked for only in the blocks that reach the k-th value
            idx = _block_members(np.flatnonzero(maxima >= kth), x.size)
            idx = idx[x[idx] >= kth]
    vals = x if idx is None else x[idx]
    peak = vals.max()
    if not np.isfinite(peak):
        return int(np.argmax(x))  # nothing finite to weigh: every token blocked but the best
    probs = np.subtract(vals, peak, out=_scratch(vals.size))  # a thread's own buffer: no fresh pages to fault in
    probs *= np.float32(min(1.0 / temperature, 1e30))  # a temperature near 0 stays finite: greedy, ties drawn
    np.exp(probs, out=probs)  # relative to the most likely token's: 1 at the peak
    pos = _draw(probs, uniform()) if top_p >= 1.0 else _draw_nucleus(probs, top_p, uniform)
    return int(pos if idx is None else idx[pos])


def _draw(probs: np.ndarray, u: float) -> int:
    """The position that ``u`` draws from ``probs`` by the inverse CDF in order (two levels over a large row)."""
    if probs.size <= 4 * _DRAW_BLOCK:
        cdf = np.cumsum(probs, dtype=np.float64)
        return _last_positive(probs, int(np.searchsorted(cdf, u * cdf[-1], side="right")))
    return _two_level(probs, u)


def _draw_nucleus(probs: np.ndarray, top_p: float, uniform: Callable[[], float]) -> int:
    """A position drawn from the top-p nucleus of ``probs`` by rejection (:func:`sample_token`); ``probs`` is
    overwritten (the rejected tails zeroed)."""
    total = float(probs.sum(dtype=np.float64))
    need = top_p * total
    for _ in range(_MAX_REJECTIONS):
        pos = _draw(probs, uniform())
        edge = probs[pos]
        earlier = float(edge) * int(np.count_nonzero(probs[:pos] == edge))  # as likely and earlier in token order
        before = _mass_above(probs, edge) + earlier
        if abs(before - need) <= _EXACT_NEAR * need:  # near the edge: the sum again, in float64
            before = float(probs[probs > edge].sum(dtype=np.float64)) + earlier
        if before < need:
            return pos
        probs[probs < edge] = 0.0  # less likely than a token outside the nucleus: outside too
        tail = probs[pos:]
        tail[tail == edge] = 0.0  # the token itself, and the ties after it
    return int(np.argmax(probs))  # a bound, not a path taken (each rejection drops the token drawn and every one less
    # likely, so the draws close in on the nucleus fast): the most likely token is in every nucleus


def _mass_above(probs: np.ndarray, edge: np.float32) -> float:
    """The mass of the tokens more likely than ``edge`` (a float32 dot product: a masked sum over most of a 262k row
    took 6x longer)."""
    return float(np.dot(probs, (probs > edge).astype(np.float32)))


def _two_level(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw over ``probs`` in order: the block whose running sum passes ``u`` of the total, then the
    token inside it (a positive one: a block's own sum may round a hair below the blocks' running sum)."""
    whole = probs.size // _DRAW_BLOCK * _DRAW_BLOCK
    sums = probs[:whole].reshape(-1, _DRAW_BLOCK).sum(axis=1)
    if whole < probs.size:
        sums = np.append(sums, probs[whole:].sum())
    starts = np.arange(0, probs.size, _DRAW_BLOCK)
    running = np.cumsum(sums, dtype=np.float64)
    target = u * running[-1]
    b = _last_positive(sums, int(np.searchsorted(running, target, side="right")))
    lo = int(starts[b])
    block = probs[lo:lo + _DRAW_BLOCK]
    inner = np.cumsum(block, dtype=np.float64)
    rest = target - (running[b - 1] if b else 0.0)
    return lo + _last_positive(block, int(np.searchsorted(inner, rest, side="right")))


def _last_positive(weights: np.ndarray, pos: int) -> int:
    """``pos`` if it holds a positive weight, else the last positive one before it (a draw that rounding carried
    past the end, or onto a zero)."""
    if pos < weights.size and weights[pos] > 0:
        return pos
    positive = np.flatnonzero(weights[:min(pos, weights.size)] > 0)
    return int(positive[-1]) if positive.size else int(np.argmax(weights))
