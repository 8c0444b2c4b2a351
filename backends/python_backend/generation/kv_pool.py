"""The KV cache as a pool of blocks with a block table per sequence (``kv_layout = "blocks"``, contract).

Each layer's keys and values are one pool ``[num_blocks, kv_heads, block_tokens, head_dim]`` that the rows share,
read and written by the factory's INT8-cache kernel through a block table (``int8_attention.rewrite(model,
block_size=...)``; ``kernels/int8_kv_attention.cc``): slot s's token at position p lives in block ``table[s][p //
block_tokens]``. :class:`BlockKVBuffers` is a storage of ``kv_slots.KVSlots`` beside ``HostKVBuffers``: the account
keeps its slots, reservations and budget, and counts what the pool holds in its blocks in use (``KVSlots.held_bytes``:
a block several slots hold, once); what differs is what a slot is, a row of the table, and what its storage calls do:

- a slot holds the blocks its reservation covers (:meth:`BlockKVBuffers.claim` at admission, again as it grows),
  taken from a free list lowest first, so a sequence admitted into a fresh pool holds its blocks in order (which the
  kernel reads as one run);
- :meth:`~BlockKVBuffers.move` (a prefix-cache hit admitted from another slot, or a request's sibling choice from its
  leader's before the prompt is written, ``KVSlots.admit(source=...)``; the sibling again after its leader's prefill,
  ``KVSlots.copy``, the same full blocks and the now written last one) gives the destination the source's full
  blocks, shared and reference counted, and a copy of its last, partly filled one (whose free rows the source may
  still write): a shared prefix is one copy in memory, the slot layout's second copy gone;
- :meth:`~BlockKVBuffers.relocate` (compaction, a finished sequence's prefix kept aside) hands a slot's blocks over;
- :meth:`~BlockKVBuffers.give_back` drops the slot's references; a block no slot holds returns to the free list and
  its whole pages to the system.

The pool has as many blocks as the slots at full context (address space, zero pages until written, as the slots'
buffers are), so a block is always there for what the account admits. Blocks are taken lowest first, so the pool's
memory never reaches past the most blocks held at once, which the budget bounds (less :attr:`overhead_bytes`, the
page a buffer's last blocks may share with free ones). A step's view is every layer's whole pool and the table's rows
of the launched slots (``BLOCK_TABLE``), bound by pointer like the slots' views.
"""

from __future__ import annotations

import ctypes
import heapq
import mmap
from typing import Any

import numpy as np

from ..contract import KV_DTYPES, KV_LAYOUT_BLOCKS, past_name
from .int8_attention import BLOCK_TABLE
from .prefix_cache import BLOCK_TOKENS
from .kv_slots import _MADV_DONTNEED, _NUMPY_DTYPES, _PAGE, _VIEWS_KEPT, SlotStorage, _libc_madvise


class BlockKVBuffers(SlotStorage):
    """Per-layer pools of KV blocks in host memory and a block table per slot (module docstring)."""

    granule_bytes = _PAGE  # memory is committed a page at a time (a block may be a part of one)
    shares_blocks = True  # the account counts the blocks in use, a shared one once

    def __init__(self, spec: Any, slots: int, max_context: int, block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens={block_tokens} must be at least 1")
        self.spec, self.slots, self.max_context = spec, int(slots), int(max_context)
        self.block_tokens = int(block_tokens)
        self.max_blocks = -(-self.max_context // self.block_tokens)
        self.num_blocks = self.slots * self.max_blocks
        self.dtype = _NUMPY_DTYPES[spec.kv_dtype]
        self.names = tuple(past_name(layer, kind) for layer in range(spec.num_layers) for kind in ("key", "value"))
        shape = (self.num_blocks, spec.num_kv_heads, self.block_tokens, spec.head_dim)
        self.block_bytes = spec.num_kv_heads * self.block_tokens * spec.head_dim * KV_DTYPES[spec.kv_dtype]
        # Page-aligned anonymous maps: zero pages until written, and a freed block's whole pages can be given back.
        size = max(1, self.num_blocks * self.block_bytes)
        self._maps = {name: mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) for name in self.names}
        self.buffers = {name: np.frombuffer(m, dtype=self.dtype, count=int(np.prod(shape))).reshape(shape)
                        for name, m in self._maps.items()}
        self.table = np.zeros((self.slots, self.max_blocks), dtype=np.int32)
        self._held: list[list[int]] = [[] for _ in range(self.slots)]
        self._refs = np.zeros(self.num_blocks, dtype=np.int32)
        self._free = list(range(self.num_blocks))  # a heap: the lowest free block first
        self._views: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        self._madvise = _libc_madvise()

    # ------------------------------------------------------------------ blocks

    def blocks(self, slot: int) -> tuple[int, ...]:
        """The blocks ``slot`` holds, in position order."""
        return tuple(self._held[slot])

    def references(self, block: int) -> int:
        """How many slots hold ``block``."""
        return int(self._refs[block])

    @property
    def blocks_in_use(self) -> int:
        """Blocks some slot holds (a shared one once)."""
        return self.num_blocks - len(self._free)

    @property
    def overhead_bytes(self) -> int:
        """What the pool may commit beyond its blocks in use: each buffer's last blocks share a page with free ones (the
        account takes it off the budget)."""
        return len(self.names) * (int(self.granule_bytes) - 1)

    def unshared(self, slot: int) -> int:
        """How many of ``slot``'s blocks no other slot holds (what letting it go frees)."""
        return sum(1 for block in self._held[slot] if self._refs[block] == 1)

    def distinct(self, slots: Any) -> int:
        """How many blocks the ``slots`` hold, a block several of them hold once."""
        return len({block for slot in slots for block in self._held[slot]})

    def claim_blocks(self, slot: int, tokens: int, private: bool = False) -> int:
        """The blocks ``claim(slot, tokens, keep=True, private=private)`` takes from the free list: the missing ones,
        and with ``private`` a copy of each kept one another slot shares."""
        want = -(-int(tokens) // self.block_tokens)
        held = self._held[slot]
        copies = sum(1 for block in held[:want] if self._refs[block] > 1) if private else 0
        return copies + max(0, want - len(held))

    def _take(self) -> int:
        if not self._free:  # the account admits no more than the slots at full context: never reached
            raise RuntimeError(f"the KV pool's {self.num_blocks} blocks are all held")
        block = heapq.heappop(self._free)
        self._refs[block] = 1
        return block

    def _drop(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            heapq.heappush(self._free, block)
            self._release_pages(block)

    def _set(self, slot: int, held: list[int]) -> None:
        self._held[slot] = held
        self.table[slot, :] = 0
        self.table[slot, :len(held)] = held

    def claim(self, slot: int, tokens: int, keep: bool = False, private: bool = False) -> None:
        """Make ``slot`` hold blocks for its first ``tokens`` tokens. ``keep`` False (a new sequence in the slot): what
        it held before is let go first; True: its blocks for those tokens stay (a reservation growing, a hit's shared
        blocks, a kept prefix taken over in place or kept where it is), those past them are let go, and only the
        missing ones are added. ``private``: each kept block another slot shares is replaced by a copy of its own
        first (a kept prefix taken over in place is written from the hit on, and no shared block may be written)."""
        want = -(-int(tokens) // self.block_tokens)
        if want > self.max_blocks:
            raise ValueError(f"{tokens} tokens are more than a slot's {self.max_context}")
        held = list(self._held[slot]) if keep else []
        for block in (held[want:] if keep else self._held[slot]):
            self._drop(block)
        held = held[:want]
        if private:
            for i, block in enumerate(held):
                if self._refs[block] > 1:
                    copy = self._take()
                    for buf in self.buffers.values():
                        buf[copy] = buf[block]
                    self._refs[block] -= 1
                    held[i] = copy
        while len(held) < want:
            held.append(self._take())
        self._set(slot, held)

    # ------------------------------------------------------------------ the storage calls of KVSlots

    def views(self, start: int, count: int) -> dict[str, np.ndarray]:
        """Every layer's pool and the table's rows ``[start, start + count)`` (:data:`BLOCK_TABLE`), to bind by
        pointer; the same object for the same rows (the last 256 kept), as ``HostKVBuffers.views``."""
        key = (int(start), int(count))
        got = self._views.get(key)
        if got is None:
            got = self._views[key] = {**self.buffers, BLOCK_TABLE: self.table[start:start + count]}
            while len(self._views) > _VIEWS_KEPT:
                self._views.pop(next(iter(self._views)))
        return got

    def move(self, dst: int, src: int, length: int) -> None:
        """Slot ``src``'s first ``length`` tokens into slot ``dst``: its full blocks shared, its last partly filled one
        copied into a block of ``dst``'s own (``src`` may still write its free rows); the blocks ``dst`` held for
        those tokens are let go first (so the pool never holds more than before and after), those past them kept."""
        length = int(length)
        full, part = divmod(length, self.block_tokens)
        covered = full + (1 if part else 0)
        source = self._held[src]
        if covered > len(source):
            raise ValueError(f"slot {src} holds {len(source)} blocks, not the {covered} of {length} tokens")
        old = self._held[dst]
        held = list(source[:full])
        for block in held:
            self._refs[block] += 1
        for block in old[:covered]:
            self._drop(block)
        if part:
            copy = self._take()
            for buf in self.buffers.values():
                buf[copy] = buf[source[full]]
            held.append(copy)
        held += old[covered:]
        self._set(dst, held)

    def relocate(self, dst: int, src: int, length: int) -> None:
        """Compaction, a prefix kept aside: slot ``src``'s blocks for its first ``length`` tokens become slot ``dst``'s
        (what ``dst`` held, and ``src``'s blocks past them, let go), ``src`` holds none; nothing copied."""
        self.give_back(dst)
        held, self._held[src] = self._held[src], []
        self.table[src, :] = 0
        want = -(-int(length) // self.block_tokens)
        for block in held[want:]:
            self._drop(block)
        self._set(dst, held[:want])

    def give_back(self, slot: int) -> None:
        """Let go of every block ``slot`` holds; a block no slot holds any more returns to the free list."""
        held, self._held[slot] = self._held[slot], []
        self.table[slot, :] = 0
        for block in held:
            self._drop(block)

    def _release_pages(self, block: int) -> None:
        """A freed block's whole pages back to the system (they read as zeros when written again)."""
        if self._madvise is None:
            return
        for buf in self.buffers.values():
            start = buf.ctypes.data + block * self.block_bytes
            first = -(-start // _PAGE) * _PAGE
            last = (start + self.block_bytes) // _PAGE * _PAGE
            if last > first:
                self._madvise(ctypes.c_void_p(first), last - first, _MADV_DONTNEED)

    def close(self) -> None:
        self._views.clear()


def layout_block_tokens(setting: str) -> int:
    """The block ``kv_layout`` asks the graph for (``CausalLM(kv_block_tokens=...)``): the prefix cache's block for
    ``blocks``, 0 (slots) otherwise."""
    return BLOCK_TOKENS if setting == KV_LAYOUT_BLOCKS else 0


def kv_storage(model: Any, spec: Any, slots: int) -> BlockKVBuffers | None:
    """``KVSlots``' storage for ``model``: a block pool where its graph reads blocks (``model.kv_block_tokens``),
    None (the slots' host buffers) otherwise."""
    block = int(getattr(model, "kv_block_tokens", 0) or 0)
    return BlockKVBuffers(spec, slots, spec.max_context, block) if block else None


def layout_note(setting: str, model: Any) -> str:
    """The load line's words on the KV layout: the pool in use, or why ``blocks`` was asked for and not used."""
    if getattr(model, "kv_block_tokens", 0):
        return f", KV cache in a pool of {model.kv_block_tokens}-token blocks with a block table per sequence"
    if setting == KV_LAYOUT_BLOCKS:
        return ("; KV cache in slots: kv_layout = \"blocks\" needs an INT8 cache whose attention runs on the "
                "factory's kernel on a CPU instance, and this one's does not")
    return ""
