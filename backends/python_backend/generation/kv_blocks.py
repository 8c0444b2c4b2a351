"""Paged admission's guard: each running sequence takes the block its next step writes into, or the budget acts.

With ``kv_admission = "paged"`` (contract, the default) a sequence is admitted for the blocks it holds now and the
token its first decode writes (``KVSlots.admission_tokens``: its context and one token, in blocks of the prefix cache's
:data:`~.prefix_cache.BLOCK_TOKENS`), with one block per running sequence left free (``KVSlots.headroom_bytes``), not
for ``prompt + max_tokens``: a client's ``max_tokens`` is a bound, most sequences end well before it, and reserving it
up front kept memory idle that other sequences could run in. Before each step :func:`take_next_blocks` gives every
decoding sequence the block its next token falls into (``KVSlots.grow``); when the budget has none left the seed's
formula still guards it: kept prefixes are dropped (least recently used first, of those whose dropping frees memory:
in a pool of blocks, one whose blocks running sequences share frees nothing), then a running sequence is preempted,
its memory freed, and it waits at the head of the queue to resume as a preempted sequence does (its prompt and what it
had generated prefilled again, its own sampler: its output unchanged). Nothing is launched that the cache cannot hold:
a sequence decodes only once its block is reserved, and a sequence alone in the cache always finishes
(``Scheduler.submit`` refuses one whose ``prompt + max_tokens`` could never fit).

The victim (:func:`choose_victim`, the scheduler's preemption for a waiting request too) is, of the running
sequences whose release frees memory (``KVSlots.freed_by_release``: in slots every one, its whole reservation; in a
pool of blocks the blocks no other slot or kept prefix holds), the one with the most tokens left (the youngest of
equals): a sequence whose every block is shared (with another sequence, or a kept prefix) would lose its work and free
nothing. Here one that frees nothing is taken only when none frees anything: the sequence needing the block cannot
decode without it, and each preemption lets go of references (a co-holder, or a kept prefix, then frees them), so the
loop ends, at worst with that sequence preempted itself. Under today's admission no victim here frees nothing in
practice: every running sequence holds a block of its own (the one its last written or next token lies in: a partly
filled block is copied, never shared, and admission reserves the token after the context); one whose blocks are all
full and shared is what a sharing of decoded blocks would bring.

With ``kv_admission = "reserve"`` each sequence reserves ``prompt + max_tokens`` at admission (the account's whole
reservations, ``KVSlots`` without ``block_tokens``): it never needs more memory, and :func:`take_next_blocks` only
records what each holds (the fragmentation metric's numerator).
"""

from __future__ import annotations

from typing import Any, Callable

from ..contract import KV_ADMISSION, KV_ADMISSION_PAGED
from .prefix_cache import BLOCK_TOKENS

__all__ = ["KV_ADMISSION", "block_tokens", "choose_victim", "take_next_blocks"]


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
            victim = _victim(sched.running, slots)
            sched.preempt(victim)
            preempted += 1
            if victim is gen:
                break
    return preempted


def choose_victim(candidates: list[Any], slots: Any, key: Callable[[Any], Any], last_resort: bool = True) -> Any:
    """The running sequence to preempt of ``candidates``: the first by ``key`` (the greatest) of those whose release
    frees memory (``KVSlots.freed_by_release``); of the others, only when none frees anything and ``last_resort``
    (None when there is none to take)."""
    freeing = [g for g in candidates if slots.freed_by_release(g.slot) > 0]
    chosen = freeing or (list(candidates) if last_resort else [])
    return max(chosen, key=key) if chosen else None


def _victim(running: list[Any], slots: Any) -> Any:
    """The running sequence to preempt for a block: of those whose release frees memory (any, as a last resort), the
    one that would hold its memory longest: the most tokens left, the youngest of equals."""
    live = [g for g in running if g.finish_reason is None] or running
    return choose_victim(live, slots, key=lambda g: (g.params.max_tokens - len(g.generated), g.arrival, g.id))
