"""A request's sibling choices sharing their leader's prefill (``n`` > 1; ``Generation.leader``: choice 0).

Siblings admitted in the same step as their leader, both fresh (nothing generated, never preempted), share its
prefill (:func:`shares_prefill`): the scheduler plans its prefill groups over the launched prompts and places each
sibling in its leader's group, behind the launched rows (:func:`sharing_last` sets ``Generation.prefill_from``); once
the leader's prompt is prefilled its keys and values are copied into their slots (``KVSlots.copy``) and each samples
its first token from the leader's logits row with its own sampler.

What a sibling holds depends on the layout. In slots a copy is a second copy: each sibling is admitted for its whole
reservation. In a pool of blocks (``kv_layout = "blocks"``) a sibling is admitted from its leader's slot right after
the leader, before the prompt is written (:func:`admission_source`, ``KVSlots.admit(source=...)``): it holds the
leader's full prompt blocks, shared, from then on, and reserves only the blocks of its own (the prompt's partly filled
last one, copied again once written, and its next token's), so the budget counts the prompt once.

A shared block has one writer. A sibling waiting on its leader's chunks (chunked prefill) runs in the decode launch
as a placeholder row that writes past the shared blocks (:func:`placeholder_at`), and when the leader stops before its
last chunk (cancelled, preempted) the first of its waiting siblings prefills the prompt in its place, from the tokens
the leader wrote in the blocks they share (from the start after a preemption, or in slots), and the others wait on
that one (:func:`take_over`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["admission_source", "placeholder_at", "shares_prefill", "sharing_last", "take_over"]


def shares_prefill(gen: Any, among: list[Any]) -> bool:
    """Whether ``gen`` is a sibling choice that shares its leader's prefill, its leader ``among`` the sequences
    admitted with it: both fresh (nothing generated, never preempted)."""
    leader = gen.leader
    return (leader is not None and not gen.generated and not gen.preemptions and not leader.generated
            and not leader.preemptions and any(g is leader for g in among))


def sharing_last(group: list[Any]) -> list[Any]:
    """The group with the siblings that will share a leader's prefill (``prefill_from`` set) after the rest: the
    launch binds the group's first slots, the sharing ones take the slots behind them."""
    own, sharing = [], []
    for gen in group:
        share = shares_prefill(gen, group)
        gen.prefill_from = gen.leader if share else None
        (sharing if share else own).append(gen)
    return own + sharing


def admission_source(gen: Any, slots: Any) -> tuple[int, int] | None:
    """``KVSlots.admit``'s ``source`` for ``gen``: its leader's slot and prompt where it shares its leader's prefill in
    a pool of blocks (their full blocks shared from admission), None otherwise (slots: copied after the prefill)."""
    leader = gen.prefill_from
    return (leader.slot, len(leader.context())) if leader is not None and slots.shares_blocks else None


def placeholder_at(gen: Any, slots: Any) -> int:
    """Where ``gen``, a placeholder row of the decode launch, writes: a sibling waiting on its leader's prefill past
    the leader's full prompt blocks a pool shares with it (the leader writes those; its copy replaces what is written
    here), the start of its slot in slots; any other sequence mid-prefill at its cached length (its next chunk
    writes it again)."""
    if gen.prefilling and gen.prefill_from is not None:
        return slots.shared_tokens(len(gen.context()))
    return gen.cached


def take_over(gen: Any, heirs: dict[int, Any], slots: Any) -> None:
    """``gen`` waits on a leader's prefill: where that leader stopped (cancelled; preempted, even if admitted again
    since: it prefills for itself, in other blocks), the first such sibling (``heirs``: a stopped leader's id to the
    sibling in its place) prefills the prompt from the tokens the leader wrote in the blocks they share, and the
    others wait on it."""
    leader = gen.prefill_from
    if leader is None or not (leader.slot is None or leader.finish_reason is not None or leader.preemptions):
        return
    heir = heirs.get(id(leader))
    if heir is None:
        heirs[id(leader)] = gen
        written = 0 if leader.preemptions else leader.cached  # a preempted one's count is gone
        gen.cached = min(written, slots.shared_tokens(len(gen.context())))
    gen.prefill_from = heir
