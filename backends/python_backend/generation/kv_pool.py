"""The KV cache as a pool of blocks with a block table per sequence (``kv_layout = "blocks"``, contract).

Each layer's keys and values are one pool ``[num_blocks, kv_heads, block_tokens, head_dim]`` that the rows share,
read and written by the factory's INT8-cache kernel through a block table (``int8_attention.rewrite(model,
block_size=...)``; ``kernels/int8_kv_attention.cc``): slot s's token at position p lives in block ``table[s][p //
block_tokens]``. :class:`BlockKVBuffers` is a storage of ``kv_slots.KVSlots`` beside ``HostKVBuffers``: the account
(slots, reservations, the budget) is unchanged; what differs is what a slot is, a row of the table, and what its
storage calls do:

- a slot holds the blocks its reservation covers (:meth:`BlockKVBuffers.claim` at admission, again as it grows),
  taken from a free list lowest first, so a sequence admitted into a fresh pool holds its blocks in order (which the
  kernel reads as one run);
- :meth:`~BlockKVBuffers.move` (compaction, a kept prefix moved aside, ``KVSlots.copy``: a prefix-cache hit from
  another slot, a request's sibling choices) gives the destination the source's full blocks, shared and reference
  counted, and a copy of its last, partly filled one (whose free rows the source may still write): a shared prefix
  is one copy in memory, the slot layout's second copy gone;
- :meth:`~BlockKVBuffers.give_back` drops the slot's references; a block no slot holds returns to the free list and
  its whole pages to the system.

The pool has as many blocks as the slots at full context (address space, zero pages until written, as the slots'
buffers are), so a block is always there for what the account admits; the account still counts a shared block once
per holder (it admits no more for the sharing yet: docs/generation.md). A step's view is every layer's whole pool and
the table's rows of the launched slots (``BLOCK_TABLE``), bound by pointer like the slots' views.
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

    granule_bytes = _PAGE  # the account counts a sequence's tokens in pages, as the slots' (an upper bound here)

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
        it held before is let go first; True: its blocks stay (a reservation growing, a kept prefix taken over in
        place) and only the missing ones are added. ``private``: each kept block another slot shares is replaced by a
        copy of its own first (a kept prefix taken over in place is written from the hit on, and no shared block may
        be written)."""
        held = list(self._held[slot]) if keep else []
        if not keep:
            for block in self._held[slot]:
                self._drop(block)
        if private:
            for i, block in enumerate(held):
                if self._refs[block] > 1:
                    copy = self._take()
                    for buf in self.buffers.values():
                        buf[copy] = buf[block]
                    self._refs[block] -= 1
                    held[i] = copy
        want = -(-int(tokens) // self.block_tokens)
        if want > self.max_blocks:
            raise ValueError(f"{tokens} tokens are more than a slot's {self.max_context}")
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
        those tokens are let go, those past them kept."""
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
        if part:
            copy = self._take()
            for buf in self.buffers.values():
                buf[copy] = buf[source[full]]
            held.append(copy)
        held += old[covered:]
        for block in old[:covered]:
            self._drop(block)
        self._set(dst, held)

    def relocate(self, dst: int, src: int, length: int = 0) -> None:
        """Compaction: slot ``src``'s blocks become slot ``dst``'s (what ``dst`` held let go), ``src`` holds none
        (``length``, the tokens a slot layout would copy, is not needed: the blocks move whole)."""
        self.give_back(dst)
        held, self._held[src] = self._held[src], []
        self.table[src, :] = 0
        self._set(dst, held)

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
