"""Chunked prefill: a long prompt prefilled in chunks over several engine steps, beside the running sequences' decode.

Without it a new prompt is prefilled whole in one step, and every running sequence waits for that launch: a 2,048-token
prompt holds every stream still for its whole prefill (token jitter). With a budget of ``C`` prompt tokens per step
(``prefill_chunk_tokens``, contract), one :meth:`Scheduler.step` is the decode launch of the running sequences and
then at most ``C`` prompt tokens of prefill:

* the sequences already mid-prefill go first, oldest first, each continuing its prompt from its cached tokens in a
  launch of its own (``CausalLM.prefill`` with ``past``: the path a prefix-cache hit takes for the rest of its prompt;
  ONNX Runtime's CPU attention takes a continued prompt one row at a time);
* then new prompts are admitted with what is left of the budget: whole ones grouped into launches as before, and the
  first that does not fit whole starts its prefill with a first chunk of what is left (at least :data:`MIN_CHUNK`
  tokens, else it waits in the queue, holding no memory). The siblings of a request with ``n`` choices are admitted
  with their leader and wait for its last chunk (its keys and values are then copied into their slots; in a pool of
  blocks they share its full prompt blocks from admission, and one takes its place if it stops: ``siblings``).

While no sequence decodes there is no stream to keep level: new prompts, and one left mid-prefill when the streams
ended, are prefilled whole, as with the budget off.

Admission is unchanged: by memory for the whole prompt and ``max_tokens``, at admission, so a chunk is never launched
that the cache cannot hold. A sequence mid-prefill holds its slot among the running ones; the batched decode launch,
which binds the running slots as one contiguous slice, runs its row as a placeholder (the next prompt token at its
cached length, its logits unused; that position is written again by its next chunk), and nothing is sampled for it
until its last chunk gives the first token's logits.

Exactness: a chunk computes its tokens' keys and values over the cached ones as a whole prefill does (the prefix
cache relies on the same), so the tokens are those of a whole prefill, greedy and seeded
(``tests/backend/test_chunked_prefill.py``, every family of the zoo and a sliding window crossed by the chunks).

``auto``: the chunk whose modelled prefill cost (the cost model ``a + b n L + c n L^2`` the factory fits at load) is
twice the fixed cost ``a`` of a launch, i.e. one chunk adds about what a small decode step costs, rounded down to whole
blocks of :data:`MIN_CHUNK`, between :data:`AUTO_MIN` and ``max_prefill_tokens``; and under ``auto`` only a prompt
longer than :data:`AUTO_WHOLE_CHUNKS` chunks is split: shorter ones are prefilled whole and grouped as with the budget
off (a burst of 128-token prompts arriving behind one that already decodes ran 0.79x as fast chunked, each chunk a
launch of its own, while one such prompt holds the streams for about what a few chunks do); a prompt once split
continues in chunks to its end. A number given for ``prefill_chunk_tokens`` bounds every prompt. Under ``auto`` the
chunk of each step is sized by ``itl_budget`` (``max_itl_ratio``) while sequences decode.
"""

from __future__ import annotations

import math
from typing import Any

from ..contract import PREFILL_CHUNK_AUTO

MIN_CHUNK = 16  # tokens: a chunk shorter than this is not launched (a launch's fixed cost for a few tokens)
AUTO_MIN, AUTO_MAX = 64, 512  # tokens: the range "auto" chooses in (also bounded by max_prefill_tokens)
AUTO_WHOLE_CHUNKS = 4  # under "auto", a prompt of at most this many chunks is prefilled whole, grouped

__all__ = ["AUTO_MAX", "AUTO_MIN", "AUTO_WHOLE_CHUNKS", "MIN_CHUNK", "chunk_tokens", "over_budget", "whole_below"]


def chunk_tokens(setting: int | str, cost: Any, max_prefill_tokens: int) -> int:
    """The prompt tokens one step prefills (0: off, a prompt whole in one step) for ``prefill_chunk_tokens``."""
    if setting != PREFILL_CHUNK_AUTO:
        return max(0, int(setting))
    a, b, c = float(cost.a), float(cost.b), float(cost.c)
    # Solve b L + c L^2 = a for L: a chunk's own work about one launch's fixed cost.
    if c > 0:
        tokens = (-b + math.sqrt(b * b + 4 * c * a)) / (2 * c)
    elif b > 0:
        tokens = a / b
    else:
        tokens = AUTO_MAX
    tokens = int(tokens) // MIN_CHUNK * MIN_CHUNK
    return max(min(AUTO_MIN, max_prefill_tokens), min(tokens, AUTO_MAX, max_prefill_tokens))


def whole_below(setting: int | str, chunk: int) -> int:
    """The longest prompt (tokens still to prefill) admitted whole under the budget: ``auto`` splits only the long
    prompts that hold the streams still (:data:`AUTO_WHOLE_CHUNKS` chunks and more); a number given splits every
    prompt longer than what the step has left."""
    return AUTO_WHOLE_CHUNKS * chunk if setting == PREFILL_CHUNK_AUTO and chunk else 0


def over_budget(rest: int, left: int | None, whole_below: int) -> bool:
    """Whether a prompt of ``rest`` tokens to prefill waits for the next step: over ``whole_below`` (shorter ones go
    whole, outside the budget) with nothing of the step's ``left`` prompt tokens (None: no bound) left, or too little
    for a first chunk of :data:`MIN_CHUNK`."""
    return left is not None and rest > whole_below and (left <= 0 or (rest > left and left < MIN_CHUNK))
