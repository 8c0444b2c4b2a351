"""Sampling parameters of one generate request, checked, and the per-sequence token sampler.

:func:`parse_sampling` turns what a request gave (explicit Triton inputs, the vLLM-style
``sampling_parameters`` JSON, the model's defaults from ``generation.json``) into one frozen
:class:`SamplingParams`, refusing every bad value with a :class:`SamplingError` that names it (the
Triton model answers INVALID_ARG, the OpenAI frontend 400). :class:`Sampler` picks each next token:
repetition penalty (Hugging Face's: positive logits of seen tokens divided by it, negative ones
multiplied), eos blocked until ``min_tokens``, then greedy (``temperature == 0``) or temperature, top-k
and top-p sampling from the sequence's own random generator, seeded per request: the same seed gives
the same tokens whatever else the batch holds, and a sequence preempted and resumed keeps its
generator.

numpy and the standard library only (runs inside Triton's Python-backend stub).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
_SEED_LIMIT = 1 << 63
# Names of the vLLM-style sampling_parameters JSON this backend reads (others are refused, not ignored).
JSON_NAMES = ("max_tokens", "min_tokens", "ignore_eos", "temperature", "top_k", "top_p", "repetition_penalty",
              "seed", "stop", "exclude_input_in_output")


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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


def parse_sampling(given: Mapping[str, Any], defaults: Any, *, prompt_tokens: int, max_context: int) -> SamplingParams:
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
    return SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                          temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=penalty,
                          seed=seed, stop=_stops(v.get("stop")))


class Sampler:
    """Picks the next tokens of one sequence from its logits (its own seeded generator)."""

    def __init__(self, params: SamplingParams, eos_token_ids: Sequence[int], prompt_ids: Sequence[int]) -> None:
        self.params = params
        self.eos = np.asarray(sorted(set(int(e) for e in eos_token_ids)), dtype=np.int64)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self._seen = set(int(t) for t in prompt_ids) if params.repetition_penalty != 1.0 else None

    def choose(self, logits: np.ndarray, generated: int) -> int:
        """The next token from one row of logits; ``generated``: tokens this sequence made before it."""
        p = self.params
        x = np.array(logits, dtype=np.float32, copy=True)
        if self._seen:
            idx = np.fromiter(self._seen, dtype=np.int64)
            idx = idx[idx < x.size]
            seen = x[idx]
            x[idx] = np.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
        if generated < p.min_tokens and self.eos.size:
            x[self.eos[self.eos < x.size]] = -np.inf
        if p.greedy:
            token = int(np.argmax(x))
        else:
            token = self._sample(x)
        if self._seen is not None:
            self._seen.add(token)
        return token

    def _sample(self, x: np.ndarray) -> int:
        p = self.params
        x = x.astype(np.float64) / p.temperature
        if p.top_k and p.top_k < x.size:
            kth = np.partition(x, -p.top_k)[-p.top_k]
            x[x < kth] = -np.inf
        x -= np.max(x)
        probs = np.exp(x)
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            sorted_probs = probs[order]
            cum = np.cumsum(sorted_probs) / sorted_probs.sum()
            keep = int(np.searchsorted(cum, p.top_p) + 1)  # the smallest prefix whose mass reaches top_p
            cut = np.zeros_like(probs)
            cut[order[:keep]] = probs[order[:keep]]
            probs = cut
        cdf = np.cumsum(probs)
        token = int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"))
        return min(token, x.size - 1)
