"""The ITL-aware chunk budget of chunked prefill: a step's prompt tokens sized so the running streams' token interval
stays within ``max_itl_ratio`` times the decode-only step's.

A step with a chunk is the running sequences' decode launch and then the chunk's launch (ONNX Runtime's CPU attention
takes a continued prompt one row at a time), so the running streams wait for both. With ``d`` the decode launch's time
for the running batch and ``r`` the ratio, the step's chunks get ``(r - 1) d`` seconds: the first launch the most
whole blocks of :data:`~.chunked_prefill.MIN_CHUNK` tokens whose predicted cost fits, and never fewer than ``floor``
(a block: a 2,048-token prompt still ends in 128 steps however large the batch, where a floor of nothing would
starve it while the streams decode), another launch in the same step (a new prompt's first chunk after one that
ended) only when its cost fits what the first left. While nothing decodes the scheduler prefills whole (TTFT first):
no budget is asked for.

What is predicted, and how it follows the machine:

* ``d``: the decode launches the scheduler times (:meth:`ItlBudget.observe_decode`), an exponential average per
  number of rows (the nearest measured count for one not seen yet), so it follows the running batch and the context
  growing; none yet (the first step of the first streams): the floor.
* a chunk of ``L`` tokens after ``P`` cached ones: the prefill cost model the load fits (``a + b n L + c n L^2``,
  ``prefill_cost.py``) at ``n = 1``, its attention term over the cached tokens too (``c L (L + P)``), times a
  correction the chunk launches keep (the exponential average of measured over modelled, between
  :data:`SCALE_MIN` and :data:`SCALE_MAX`): the model is fitted on fresh prompts at load, a continued chunk on a busy
  machine is dearer or cheaper.

The smaller chunks cost the long prompt its time to first token: every chunk pays a launch's fixed cost ``a``, so a
prompt of ``T`` tokens takes about ``T / L`` steps of ``r d`` each where one whole prefill is ``a + b T + c T^2``.
"""

from __future__ import annotations

import math
from typing import Any

from ..contract import PREFILL_CHUNK_AUTO
from .chunked_prefill import AUTO_MAX, MIN_CHUNK

ALPHA = 0.3  # weight of a new measurement in the exponential averages
SCALE_MIN, SCALE_MAX = 0.25, 8.0  # the bounds of the chunk cost's measured / modelled correction

__all__ = ["ALPHA", "ItlBudget", "SCALE_MAX", "SCALE_MIN", "itl_budget", "observe_launch"]


def observe_launch(times: dict[int, float], rows: int, seconds: float, alpha: float = ALPHA) -> None:
    """``times[rows]``, the exponential average of a decode launch of ``rows`` rows, moved by one launch of ``seconds``
    (its first one: that launch). The ITL budget's ``d`` and the speculator's reference (speculative.py) both."""
    old = times.get(rows)
    times[rows] = seconds if old is None else old + alpha * (seconds - old)


class ItlBudget:
    """The chunk budget of one instance's steps (see the module docstring); ``ceiling``: the most prompt tokens one
    step's chunks take (``max_prefill_tokens``, at most), ``floor``: the fewest its first chunk takes."""

    def __init__(self, cost: Any, ratio: float, ceiling: int, floor: int = MIN_CHUNK) -> None:
        if ratio <= 1.0:
            raise ValueError(f"max_itl_ratio must be above 1 (a chunk always adds to the step), got {ratio}")
        self.cost, self.ratio = cost, float(ratio)
        self.floor = max(MIN_CHUNK, int(floor) // MIN_CHUNK * MIN_CHUNK)
        self.ceiling = max(self.floor, int(ceiling) // MIN_CHUNK * MIN_CHUNK)
        self.scale = 1.0  # measured / modelled chunk cost
        self._decode: dict[int, float] = {}  # rows -> seconds of a decode launch (exponential average)

    # ------------------------------------------------------------------ predictions

    def modelled(self, tokens: int, past: int = 0) -> float:
        """The cost model's seconds for one chunk of ``tokens`` after ``past`` cached tokens (uncorrected)."""
        c = self.cost
        return float(c.a) + float(c.b) * tokens + float(c.c) * tokens * (tokens + past)

    def chunk_seconds(self, tokens: int, past: int = 0) -> float:
        """The predicted seconds of one chunk launch (the model, corrected by what the chunks measured)."""
        return self.scale * self.modelled(tokens, past)

    def decode_seconds(self, rows: int) -> float | None:
        """The decode launch of ``rows`` rows as measured (the nearest row count measured), None before any."""
        if not self._decode or rows <= 0:
            return None
        if rows in self._decode:
            return self._decode[rows]
        return self._decode[min(self._decode, key=lambda r: (abs(r - rows), -r))]

    def allowance(self, rows: int) -> float | None:
        """The seconds a step's chunks may take beside a decode launch of ``rows`` rows (None: not measured yet)."""
        d = self.decode_seconds(rows)
        return None if d is None else (self.ratio - 1.0) * d

    def fit(self, seconds: float, past: int = 0, first: bool = True) -> int:
        """The most whole blocks of prompt tokens one chunk launch after ``past`` cached tokens may take within
        ``seconds`` (at most ``ceiling``); the first launch of a step at least ``floor``, another 0 when none fits."""
        a = self.chunk_seconds(0, past)
        room = seconds - a
        tokens = 0
        if room > 0:
            b = self.scale * float(self.cost.b)
            c = self.scale * float(self.cost.c)
            if c > 0:  # c L^2 + (b + c P) L = room
                lin = b + c * past
                tokens = int((-lin + math.sqrt(lin * lin + 4 * c * room)) / (2 * c))
            elif b > 0:
                tokens = int(room / b)
            else:
                tokens = self.ceiling
        tokens = min(tokens, self.ceiling) // MIN_CHUNK * MIN_CHUNK
        return max(tokens, self.floor) if first else tokens

    # ------------------------------------------------------------------ measurements

    def observe_decode(self, rows: int, seconds: float) -> None:
        observe_launch(self._decode, rows, seconds)

    def observe_chunk(self, tokens: int, past: int, seconds: float) -> None:
        modelled = self.modelled(tokens, past)
        if modelled <= 0:
            return
        ratio = min(SCALE_MAX, max(SCALE_MIN, seconds / modelled))
        self.scale += ALPHA * (ratio - self.scale)


def itl_budget(setting: int | str, ratio: float, chunk: int, cost: Any, max_prefill_tokens: int) -> ItlBudget | None:
    """The budget for ``prefill_chunk_tokens`` = ``setting`` and ``max_itl_ratio`` = ``ratio``: under ``auto`` with a
    ratio (not 0) and chunking on (``chunk``, what ``auto`` took, is the fallback before a decode launch is timed);
    None otherwise (a number given fixes the chunk)."""
    if setting != PREFILL_CHUNK_AUTO or not ratio or not chunk:
        return None
    return ItlBudget(cost, ratio, ceiling=min(AUTO_MAX, max_prefill_tokens))
