"""Prefix caching over the KV slots: a finished sequence's keys and values kept, and reused by later prompts.

The slots stay as they are (``kv_slots``: one contiguous slot per sequence, which the graph reads whole): what is
cached is a slot's first tokens. Token ids are hashed in blocks of :data:`BLOCK_TOKENS`, each block's hash chained
over the one before it and seeded with what changes the keys and values (:func:`identity`: the graph's digest, its
precision, the KV element type, the attention kernel), so two chains agree on a block only where every token before
it agrees too.

Holders of a prefix are of two kinds:

* a running sequence, from its prefill on: its slot holds its prompt's keys and values (``Generation.cached``
  tokens of its context), and a new prompt sharing them copies them into its own slot;
* a kept slot (:class:`CachedPrefix`, a ``kv_slots.KeptKV``): when a sequence ends, its slot's valid tokens are kept
  (``KVSlots.release(slot, keep=...)``) outside the active prefix, counted in the budget, and dropped least recently
  used first when admission needs the memory or the slot (``Scheduler``). A kept prefix that another kept prefix
  extends is dropped at once (a conversation's next turn holds the one before it).

:meth:`PrefixCache.lookup` returns the longest holder of whole blocks of a prompt, at most its length less one (the
last token is always run: its logits give the first new token), its tokens compared as well as its hashes. The new
sequence then prefills only the rest, from that position (``CausalLM.prefill`` with ``past``): its keys and values
equal what a whole prefill writes, so its tokens are the same (``tests/backend/test_prefix_cache.py``).

A prompt admitted in a step is no holder until that step prefills it, so a burst of prompts on a document nobody holds
yet would each prefill it. :class:`PendingBlocks` (``PrefixCache.pending``: one per admission) holds the block hashes
the step's admitted prompts will have written once the step is done (a prompt split in chunks: its first chunk); a
waiting prompt sharing at least one whole block with them, more than its own hit, is held back a step by the
scheduler (:meth:`PendingBlocks.hold_back`: once, and never a sibling choice), and next step its lookup finds them.
A running holder mid-prefill (chunked prefill) gives what it has written, ``context()[:cached]``, and no more.

Exactness: the slot layout keeps every position of every layer, sliding-window layers included (the build writes
no window-sized ring: ``build_engines/attention_config.py``), so a cached prefix is what the graph itself wrote.
Where a precision's outputs depend on the batch (dynamic INT8: one activation scale per launch), a prefix computed
in another launch is not what this one would compute: ``prefix_caching = "auto"`` leaves the cache off there.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..contract import PREFIX_CACHING
from .kv_slots import KeptKV

BLOCK_TOKENS = 16
__all__ = ["BLOCK_TOKENS", "PREFIX_CACHING", "CachedPrefix", "Hit", "PendingBlocks", "PrefixCache", "chain", "enabled",
           "identity"]


def identity(**fields: Any) -> bytes:
    """The chain's seed: a digest of what makes keys and values differ for the same tokens."""
    text = json.dumps({k: str(v) for k, v in fields.items()}, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def enabled(setting: str, precision: str, batch_dependent: Sequence[str]) -> bool:
    """Whether ``prefix_caching`` (contract) turns the cache on for ``precision``: ``auto`` where reuse is exact."""
    return setting == "on" or (setting == "auto" and precision not in batch_dependent)


def chain(tokens: Sequence[int], seed: bytes, block: int = BLOCK_TOKENS, blocks: int | None = None,
          start: Sequence[bytes] = ()) -> list[bytes]:
    """The chained hashes of ``tokens``' whole blocks (the first ``blocks`` of them), extending ``start``."""
    count = len(tokens) // block if blocks is None else min(int(blocks), len(tokens) // block)
    out = list(start[:count])
    previous = out[-1] if out else seed
    data = np.asarray(tokens[:count * block], dtype=np.int64)
    for i in range(len(out), count):
        previous = hashlib.blake2b(previous + data[i * block:(i + 1) * block].tobytes(), digest_size=16).digest()
        out.append(previous)
    return out


@dataclass(eq=False)
class CachedPrefix(KeptKV):
    """A kept slot's prefix: its token ids and their block hashes (the table's order says which was used last)."""

    ids: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class Hit:
    """Where a prompt's first ``tokens`` tokens are: a running sequence's slot or a kept one (``holder.slot``)."""

    holder: Any
    tokens: int

    @property
    def kept(self) -> bool:
        return isinstance(self.holder, CachedPrefix)


class PendingBlocks:
    """The block hashes the prompts admitted in one step will hold once it is done (admitted, not prefilled yet: a
    lookup finds nothing of theirs). The hashes are chained, so a prompt shares ``d`` whole blocks with one of them
    exactly when its ``d``-th hash is here."""

    def __init__(self, seed: bytes, block: int) -> None:
        self.seed, self.block = seed, int(block)
        self._hashes: set[bytes] = set()

    def add(self, tokens: Sequence[int], written: int) -> None:
        """A prompt admitted this step whose first ``written`` tokens this step writes (all but a split one's)."""
        self._hashes.update(chain(tokens, self.seed, self.block, blocks=written // self.block))

    def shared(self, tokens: Sequence[int]) -> int:
        """Tokens of ``tokens``' whole blocks (its last token left to run, as :meth:`PrefixCache.lookup` leaves it)
        that one of the step's prompts will hold."""
        if not self._hashes:
            return 0
        depth = 0
        for h in chain(tokens, self.seed, self.block, blocks=(len(tokens) - 1) // self.block):
            if h not in self._hashes:
                break
            depth += 1
        return depth * self.block

    def hold_back(self, gen: Any, hit: Hit | None) -> bool:
        """Whether ``gen`` waits a step for this step's prompts to write the prefix it shares with them: at least a
        whole block, more than its own ``hit``; never a sibling choice (``Generation.leader``: it shares its leader's
        prefill or prefills alone) nor one held back before (``Generation.held_back``, set here: once, so nothing
        starves)."""
        if gen.leader is not None or gen.held_back or self.shared(gen.context()) <= (hit.tokens if hit else 0):
            return False
        gen.held_back = True
        return True


class PrefixCache:
    """The block-hash table of the prefixes held by running sequences and kept slots (see the module docstring)."""

    def __init__(self, seed: bytes, block: int = BLOCK_TOKENS) -> None:
        self.seed, self.block = seed, int(block)
        self._index: dict[bytes, dict[int, Any]] = {}  # block hash -> holders (by id) whose chain has it
        self._chains: dict[int, tuple[Any, list[bytes]]] = {}  # holder id -> (holder, its hashes)
        self.entries: OrderedDict[int, CachedPrefix] = OrderedDict()  # kept prefixes, least recently used first

    # ------------------------------------------------------------------ holders

    def _add(self, holder: Any, hashes: list[bytes]) -> None:
        self._remove(holder)
        self._chains[id(holder)] = (holder, hashes)
        for h in hashes:
            self._index.setdefault(h, {})[id(holder)] = holder

    def _remove(self, holder: Any) -> None:
        got = self._chains.pop(id(holder), None)
        if got is None:
            return
        for h in got[1]:
            holders = self._index.get(h)
            if holders is not None:
                holders.pop(id(holder), None)
                if not holders:
                    del self._index[h]

    def running(self, gen: Any) -> None:
        """A sequence just prefilled: the whole blocks of its cached context are in its slot."""
        tokens = gen.context()[:gen.cached]
        if len(tokens) >= self.block:
            self._add(gen, chain(tokens, self.seed, self.block))

    def stopped(self, gen: Any) -> None:
        """A sequence leaves its slot (finished, preempted): its slot no longer holds anything for the table."""
        self._remove(gen)

    def keep(self, gen: Any) -> CachedPrefix | None:
        """The entry to keep a finishing sequence's slot as (its cached tokens), or None when under one block."""
        tokens = gen.context()[:gen.cached]
        if len(tokens) < self.block:
            return None
        hashes = self._chains.get(id(gen), (None, []))[1]
        return CachedPrefix(tokens=len(tokens), ids=list(tokens), hashes=chain(tokens, self.seed, self.block,
                                                                                 start=hashes))

    def kept(self, entry: CachedPrefix) -> list[CachedPrefix]:
        """Record ``entry`` (its slot kept); returns the entries it extends, which the caller drops."""
        self.entries[id(entry)] = entry
        self._add(entry, entry.hashes)
        return [e for e in self.entries.values()
                if e is not entry and e.tokens <= entry.tokens and entry.ids[:e.tokens] == e.ids]

    def forget(self, entry: CachedPrefix) -> None:
        """An entry dropped (evicted, extended) or taken over by a new sequence."""
        self.entries.pop(id(entry), None)
        self._remove(entry)

    def least_recent(self, exclude: Sequence[Any] = (), where: Callable[[CachedPrefix], bool] | None = None
                     ) -> CachedPrefix | None:
        """The kept prefix used longest ago, not one of ``exclude``, and one ``where`` accepts (e.g. whose dropping
        frees memory: ``KVSlots.freed_by_drop``)."""
        skip = {id(e) for e in exclude}
        return next((e for e in self.entries.values() if id(e) not in skip and (where is None or where(e))), None)

    def blocks(self) -> int:
        """Whole blocks the kept slots hold."""
        return sum(len(e.hashes) for e in self.entries.values())

    # ------------------------------------------------------------------ lookup

    def pending(self) -> PendingBlocks:
        """An empty table of what one step's admitted prompts will hold (the scheduler's admission fills it)."""
        return PendingBlocks(self.seed, self.block)

    def lookup(self, tokens: Sequence[int]) -> Hit | None:
        """The longest run of ``tokens``' whole blocks a holder has (its last token always left to run), a kept
        slot preferred over a running sequence; None under one block."""
        blocks = (len(tokens) - 1) // self.block
        if blocks < 1 or not self._index:
            return None
        hashes = chain(tokens, self.seed, self.block, blocks=blocks)
        depth = 0
        while depth < len(hashes) and hashes[depth] in self._index:
            depth += 1
        while depth > 0:
            n = depth * self.block
            holders = sorted(self._index.get(hashes[depth - 1], {}).values(),
                             key=lambda h: not isinstance(h, CachedPrefix))
            for holder in holders:
                held = holder.ids if isinstance(holder, CachedPrefix) else holder.context()[:holder.cached]
                if holder.slot is not None and len(held) >= n and list(held[:n]) == list(tokens[:n]):
                    if isinstance(holder, CachedPrefix):
                        self.entries.move_to_end(id(holder))
                    return Hit(holder, n)
            depth -= 1
        return None

