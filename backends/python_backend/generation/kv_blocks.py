"""Paged admission's guard: each running sequence takes the block its next step writes into, or the budget acts.

With ``kv_admission = "paged"`` (contract, the default) a sequence is admitted for the blocks it holds now and the
token its first decode writes (``KVSlots.admission_tokens``: its context and one token, in blocks of the prefix cache's
:data:`~.prefix_cache.BLOCK_TOKENS`), with one block per running sequence left free (``KVSlots.headroom_bytes``), not
for ``prompt + max_tokens``: a client's ``max_tokens`` is a bound, most sequences end well before it, and reserving it
up front kept memory idle that other sequences could run in. Before each step :func:`take_next_blocks` gives every
decoding sequence the block its next token falls into (``KVSlots.grow``); when the budget has none left the seed's
formula still guards it: kept prefixes are dropped (least recently used first, of those whose dropping frees memory:
in a pool of blocks, one whose blocks running sequences share frees nothing), then the running sequence with the
most tokens left (the youngest of equals) is preempted, its memory freed, and it waits at the head of the queue to
resume as a preempted sequence does (its prompt and what it had generated prefilled again, its own sampler: its output
unchanged). Nothing is launched that the cache cannot hold: a sequence decodes only once its block is reserved, and a
sequence alone in the cache always finishes (``Scheduler.submit`` refuses one whose ``prompt + max_tokens`` could
never fit).

With ``kv_admission = "reserve"`` each sequence reserves ``prompt + max_tokens`` at admission (the account's whole
reservations, ``KVSlots`` without ``block_tokens``): it never needs more memory, and :func:`take_next_blocks` only
records what each holds (the fragmentation metric's numerator).
"""

from __future__ import annotations

from typing import Any

from ..contract import KV_ADMISSION, KV_ADMISSION_PAGED
from .prefix_cache import BLOCK_TOKENS

__all__ = ["KV_ADMISSION", "block_tokens", "take_next_blocks"]


def block_tokens(setting: str) -> int:
    """``KVSlots``'s ``block_tokens`` for ``kv_admission``: the prefix cache's block when paged, 0 (whole
    reservations) otherwise."""
    return BLOCK_TOKENS if setting == KV_ADMISSION_PAGED else 0


def take_next_blocks(sched: Any) -> int:
    """Reserve, for each running sequence that decodes this step (oldest first), what it holds after the step; when
    the budget refuses one, drop a kept prefix or preempt (see the module docstring). Returns the preemptions."""
    slots, preempted = sched.slots, 0
    for gen in sorted(sched.running, key=lambda g: (g.arrival, g.id)):
        if gen.slot is None or gen.prefilling or gen.finish_reason is not None:
            continue  # preempted by this loop, or its prompt's blocks were reserved at admission
        while not slots.grow(gen.slot, gen.cached + 1):
            if not slots.block_tokens:
                break  # a whole reservation covers every token the sequence writes: never reached
            cache = sched.prefix_cache  # a kept prefix whose dropping frees memory (kv_slots.KVSlots.freed_by_drop)
            kept = cache.least_recent(where=lambda e: slots.freed_by_drop(e) > 0) if cache is not None else None
            if kept is not None:
                sched._drop_kept(kept)
                continue
            victim = _victim(sched.running)
            sched.preempt(victim)
            preempted += 1
            if victim is gen:
                break
    return preempted


def _victim(running: list[Any]) -> Any:
    """The running sequence that would hold its memory longest: the most tokens left, the youngest of equals."""
    live = [g for g in running if g.finish_reason is None] or running
    return max(live, key=lambda g: (g.params.max_tokens - len(g.generated), g.arrival, g.id))
