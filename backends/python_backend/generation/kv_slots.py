"""The KV cache of a generative model: one preallocated buffer per layer and kind, a slot per sequence.

Each layer's keys and values live in a buffer ``[slots, kv_heads, max_context, head_dim]`` allocated once
at load (the graph's "shared-slots" layout, ``contract``): the graph writes each new token's keys and values
in place, at its row's own length, so nothing is reallocated per token. The active sequences always hold a
contiguous prefix of the slots, ``[0, active)``: a batched step binds one contiguous slice of every buffer
(a pointer, no copy). When a sequence ends, the last active slot's rows are moved into its place
(:meth:`KVSlots.release` says which sequence moved), so the prefix stays contiguous.

Admission is by memory, the seed's formula: a sequence needing ``prompt + max_tokens`` tokens is admitted
while ``budget - weights >= kv bytes of the tokens reserved by the running sequences and it``. The buffers
are zero pages until written (``numpy.zeros`` maps them lazily): memory is committed as tokens are written,
and a freed slot's pages are given back to the system (``madvise(MADV_DONTNEED)``) so what is resident stays
within the reservations. A token's bytes are counted in whole pages per head row, as they are committed.

Paged admission (``block_tokens`` > 0; ``kv_admission = "paged"``, contract; the account's policy in ``kv_blocks``): a
sequence reserves whole blocks of ``block_tokens`` tokens (the prefix cache's block) for what it holds now and what its
next step writes (its context and one token at admission), and takes one more block each time its next token
crosses into one (:meth:`KVSlots.grow`); the budget stays the guard (``kv_blocks.take_next_blocks`` preempts when a
block cannot be had). The slot layout stays (ONNX Runtime's attention reads a contiguous ``max_context`` row): only the
account is paged, and on the CPU the memory committed follows it, the pages of a slot being committed as written.

A finished sequence's slot may be kept instead of freed (:class:`KeptKV`, prefix caching: ``prefix_cache``): its first
tokens' keys and values stay valid, in a slot outside the active prefix that no sequence holds, counted in the budget
(``KVUsage.cached_bytes``) until the scheduler drops it (least recently used first) for the memory or the slot.

What the cache holds is one definition, :meth:`KVSlots.held_bytes`, which admission, growth and the dropping of kept
prefixes all compare with the budget. In slots, each reservation and each kept prefix in the pages its tokens commit
(a prefix a slot copies from another is a second copy, counted again). Where the storage shares blocks
(``kv_pool.BlockKVBuffers``, ``kv_layout = "blocks"``: what the slots copy, a prefix-cache hit or a kept prefix, is
the same blocks, reference counted), the pool's blocks in use, a block several slots hold counted once: a sequence
admitted with a hit, or a request's sibling choice admitted from its leader's slot before its prompt is prefilled
(``admit(source=...)``), adds only the blocks past the full ones it shares (:meth:`KVSlots.admission_bytes`,
:meth:`KVSlots.shared_tokens`), and dropping a kept prefix, or releasing a running sequence's slot, frees only the
blocks no other slot holds (:meth:`KVSlots.freed_by_drop`, :meth:`KVSlots.freed_by_release`: a preemption's victim is
chosen among those whose release frees memory). Either way nothing is held past the budget: the pool takes the lowest
free block first, so its memory never reaches past the most blocks ever held at once, and its budget is the
configured one less the page a buffer's last blocks may share with free ones.

Where the buffers live is the storage's business (:class:`HostKVBuffers` here, numpy in host memory;
``kv_device.DeviceKVBuffers`` on a GPU, from the instance's pool; ``kv_pool.BlockKVBuffers``, ``kv_layout =
"blocks"``: a pool of blocks and a block table; each a :class:`SlotStorage`, whose ``claim`` (a slot's blocks for its
reservation) and ``relocate`` (compaction: blocks handed over, or tokens copied) the account calls too): :class:`KVSlots` keeps the account (slots,
reservations, the budget) and asks its storage for views, moves and the return of freed memory.
"""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..contract import KV_DTYPES, past_name

_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
_VIEWS_KEPT = 256
_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8}


class AdmissionError(RuntimeError):
    """A sequence that can never fit the cache (its tokens alone exceed the budget)."""


@dataclass(frozen=True)
class KVUsage:
    """Where the cache stands: slots in use, tokens and bytes reserved, and the budget."""

    active: int
    slots: int
    reserved_tokens: int
    reserved_bytes: int
    budget_bytes: int
    cached_slots: int = 0  # slots kept for their prefix (no sequence holds them)
    cached_tokens: int = 0
    cached_bytes: int = 0
    written_tokens: int = 0  # of the reserved tokens, those the running sequences' keys and values fill
    block_tokens: int = 0  # paged admission's block (0: whole reservations)
    block_bytes: int = 0  # one block's keys and values, every layer (0: whole reservations in slots)
    blocks_used: int = 0  # blocks the running sequences and kept prefixes hold (a shared one once in a pool)

    @property
    def ratio(self) -> float:
        return self.reserved_bytes / self.budget_bytes if self.budget_bytes else 0.0

    @property
    def blocks_free(self) -> int:
        """Blocks the budget has left (paged admission or a pool; 0 otherwise): its bytes not held, in blocks."""
        left = self.budget_bytes - self.reserved_bytes - self.cached_bytes
        return max(0, left // self.block_bytes) if self.block_bytes else 0

    @property
    def fragmentation(self) -> float:
        """The share of the running sequences' reservation no key or value fills: the unwritten tail of each last
        block when paged, each sequence's ``max_tokens`` not generated yet when reserved whole."""
        return 1.0 - self.written_tokens / self.reserved_tokens if self.reserved_tokens else 0.0


def _libc_madvise() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
        fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError):  # not Linux: freed slots keep their pages until reused
        return None


@dataclass(eq=False)
class KeptKV:
    """A finished sequence's keys and values kept in a slot no sequence holds: its first ``tokens`` tokens are valid.
    ``slot`` is where they are now (the account moves them when the active prefix needs that slot), None once
    dropped."""

    tokens: int
    slot: int | None = None


class SlotStorage:
    """What :class:`KVSlots` asks of a storage beyond its views and moves, with a slot layout's answers: a slot
    holds its whole context from the start (nothing to claim), compaction copies a sequence's tokens, and a copy is a
    second copy in memory (``shares_blocks`` False: the account counts every slot's tokens). ``kv_pool.BlockKVBuffers``
    answers otherwise (blocks claimed as a slot grows, handed over when it moves, shared when copied: the account then
    counts its blocks in use, through ``blocks_in_use``, ``block_bytes``, ``block_tokens``, ``unshared`` and
    ``distinct``)."""

    shares_blocks = False
    overhead_bytes = 0  # memory the storage may commit beyond what the account counts (taken off the budget)

    def claim(self, slot: int, tokens: int, keep: bool = False, private: bool = False) -> None:
        """Slot ``slot`` holds ``tokens`` tokens from now on (``keep``: it keeps what it holds of them, and lets go of
        what lies past them; ``private``: none of it shared)."""

    def relocate(self, dst: int, src: int, length: int) -> None:
        """Slot ``src``'s first ``length`` tokens made slot ``dst``'s, ``src`` left free."""
        self.move(dst, src, length)


class HostKVBuffers(SlotStorage):
    """The KV buffers in host memory: numpy arrays of zero pages, a freed slot's pages given back to the system."""

    granule_bytes = _PAGE  # memory is committed a page at a time

    def __init__(self, spec: Any, slots: int, max_context: int) -> None:
        self.spec, self.slots, self.max_context = spec, int(slots), int(max_context)
        self.dtype = _NUMPY_DTYPES[spec.kv_dtype]
        self.names = tuple(past_name(layer, kind) for layer in range(spec.num_layers) for kind in ("key", "value"))
        shape = spec.kv_shape(self.slots, self.max_context)
        self.buffers = {name: np.zeros(shape, dtype=self.dtype) for name in self.names}
        self._views: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        self._madvise = _libc_madvise()

    def views(self, start: int, count: int) -> dict[str, np.ndarray]:
        """Every buffer's rows ``[start, start + count)``: contiguous views to bind by pointer. The same slice
        returns the same object (the last 256 kept), so the engine keeps its binding of it (causal_lm)."""
        key = (int(start), int(count))
        got = self._views.get(key)
        if got is None:
            got = self._views[key] = {name: buf[start:start + count] for name, buf in self.buffers.items()}
            while len(self._views) > _VIEWS_KEPT:
                self._views.pop(next(iter(self._views)))
        return got

    def move(self, dst: int, src: int, length: int) -> None:
        """Slot ``src``'s first ``length`` tokens (every buffer, every head) into slot ``dst``."""
        for buf in self.buffers.values():
            buf[dst, :, :length] = buf[src, :, :length]

    def give_back(self, slot: int) -> None:
        """Return a freed slot's pages to the system (they read as zeros when touched again)."""
        if self._madvise is None:
            return
        for buf in self.buffers.values():
            start = buf[slot].ctypes.data
            end = start + buf[slot].nbytes
            first = -(-start // _PAGE) * _PAGE
            last = end // _PAGE * _PAGE
            if last > first:
                self._madvise(ctypes.c_void_p(first), last - first, _MADV_DONTNEED)

    def close(self) -> None:
        self._views.clear()


class KVSlots:
    """Per-layer KV buffers, slot allocation with compaction, and admission by memory."""

    def __init__(self, spec: Any, slots: int, budget_bytes: int, max_context: int | None = None,
                 storage: Any = None, block_tokens: int = 0) -> None:
        """``spec``: the model's ``contract.GenerationSpec``; ``budget_bytes``: what the cache may hold
        (the configured budget less the weights); ``storage``: where the buffers live (default: host memory,
        :class:`HostKVBuffers`; on a GPU ``kv_device.DeviceKVBuffers`` of the same slots and context);
        ``block_tokens``: paged admission's block (0: a sequence reserves ``prompt + max_tokens`` at admission).
        A storage that shares blocks (a pool) is counted in its blocks, and its ``overhead_bytes`` (the pages its
        buffers' last blocks in use may share with free ones) come off the budget, so the budget bounds its memory."""
        if slots < 1:
            raise ValueError(f"slots={slots} must be at least 1")
        self.spec = spec
        self.slots = int(slots)
        self.max_context = int(max_context or spec.max_context)
        self.budget_bytes = int(budget_bytes)
        if storage is None:
            storage = HostKVBuffers(spec, self.slots, self.max_context)
        elif (storage.slots, storage.max_context) != (self.slots, self.max_context):
            raise ValueError(f"the storage holds {storage.slots} slots of {storage.max_context} tokens, not "
                             f"{self.slots} of {self.max_context}")
        self.storage = storage
        self.names = storage.names
        self.buffers = storage.buffers  # name -> numpy array (host) or device pointer
        self._granule = int(storage.granule_bytes)
        self.block_tokens = max(0, int(block_tokens))
        # A storage sharing blocks: the account counts its blocks in use, a block several slots hold once.
        self._pool = storage if storage.shares_blocks else None
        if self._pool is not None:
            self.budget_bytes -= int(storage.overhead_bytes)
            self._pool_block_bytes = len(self.names) * int(storage.block_bytes)
        self._reserved: list[int] = []  # tokens reserved by the sequence in each active slot
        self._written: list[int] = []  # tokens whose keys and values it holds (after its next step)
        self._kept: dict[int, KeptKV] = {}  # slot -> the prefix kept there (outside the active prefix)
        if self.bytes_for(1) > self.budget_bytes:
            raise AdmissionError(f"the KV budget of {self.budget_bytes} bytes cannot hold one token "
                                 f"({self.bytes_for(1)} bytes): raise kv_budget_mib")

    # ------------------------------------------------------------------ sizes

    def bytes_for(self, tokens: int) -> int:
        """Bytes ``tokens`` tokens of one sequence commit, held alone: whole granules (host: pages) per head row, every
        layer, K and V; in a pool, the blocks that hold them."""
        if self._pool is not None:
            return -(-int(tokens) // self._pool.block_tokens) * self._pool_block_bytes
        per_token = self.spec.head_dim * KV_DTYPES[self.spec.kv_dtype]
        granules = -(-int(tokens) * per_token // self._granule)
        return len(self.names) * self.spec.num_kv_heads * granules * self._granule

    def held(self, tokens: int) -> int:
        """The tokens a reservation covering ``tokens`` holds: whole blocks when paged, ``tokens`` otherwise."""
        block = self.block_tokens
        return -(-int(tokens) // block) * block if block else int(tokens)

    def admission_tokens(self, reserved: int, context: int) -> int:
        """What a sequence reserves at admission: paged, its ``context`` and the token its first decode writes (in
        whole blocks, at most ``reserved``'s); otherwise ``reserved`` (``prompt + max_tokens``)."""
        return min(self.held(int(context) + 1), self.held(reserved)) if self.block_tokens else int(reserved)

    def headroom_bytes(self, sequences: int) -> int:
        """Paged: one block for each of ``sequences`` (the running ones and those a step admits, the new one
        included), kept free at admission so the next blocks they take seldom need a preemption; 0 for a sequence
        alone (it always finishes: its ``prompt + max_tokens`` fits the budget) and when reserving whole."""
        return int(sequences) * self._block_bytes() if sequences > 1 else 0

    def _block_bytes(self) -> int:
        """One block's keys and values, every layer and head, as written (the pages they commit are counted apart)."""
        return (len(self.names) * self.spec.num_kv_heads * self.block_tokens * self.spec.head_dim
                * KV_DTYPES[self.spec.kv_dtype])

    @property
    def active(self) -> int:
        return len(self._reserved)

    @property
    def shares_blocks(self) -> bool:
        """Whether what a slot copies from another is the same memory (a pool's blocks), counted once."""
        return self._pool is not None

    def held_bytes(self) -> int:
        """What the running sequences' reservations and the kept prefixes hold: the one figure admission, growth and
        the dropping of kept prefixes compare with the budget. In a pool its blocks in use (a block several slots hold
        once); in slots each reservation and kept prefix in its pages."""
        if self._pool is not None:
            return self._pool.blocks_in_use * self._pool_block_bytes
        return (sum(self.bytes_for(t) for t in self._reserved)
                + sum(self.bytes_for(self.held(k.tokens)) for k in self._kept.values()))

    def shared_tokens(self, length: int) -> int:
        """Of another slot's first ``length`` tokens given to a slot (:meth:`copy`, ``admit(source=...)``), those it
        shares rather than holds: in a pool the tokens of their full blocks (the last, partly filled one is copied
        into a block of its own); in slots none (a copy is a second copy)."""
        if self._pool is None:
            return 0
        return int(length) // self._pool.block_tokens * self._pool.block_tokens

    def admission_bytes(self, tokens: int, shared: int = 0) -> int:
        """What admitting a sequence that reserves ``tokens`` adds to :meth:`held_bytes`, its first ``shared`` tokens
        another slot's (a prefix-cache hit, or a sibling choice's prompt its leader prefills): a pool shares their
        full blocks (:meth:`shared_tokens`), so only the blocks past them count; the slots copy them, so every token
        counts."""
        if self._pool is not None:
            block = self._pool.block_tokens
            blocks = -(-self.held(tokens) // block) - self.shared_tokens(shared) // block
            return max(0, blocks) * self._pool_block_bytes
        return self.bytes_for(self.held(tokens))

    def freed_by_drop(self, kept: KeptKV) -> int:
        """What dropping ``kept`` frees: in a pool only the blocks no other slot holds (a prefix a running sequence
        shares frees nothing of it), in slots all it holds."""
        if kept.slot is None or self._kept.get(kept.slot) is not kept:
            return 0
        if self._pool is not None:
            return self._pool.unshared(kept.slot) * self._pool_block_bytes
        return self.bytes_for(self.held(kept.tokens))

    def freed_by_release(self, slot: int) -> int:
        """What releasing active ``slot`` (its sequence preempted or ended, nothing kept) frees: in a pool only the
        blocks no other slot or kept prefix holds (a sequence whose blocks others share frees only its own, possibly
        none), in slots its whole reservation. A preemption's victim is chosen by it (``kv_blocks.choose_victim``)."""
        if not 0 <= slot < self.active:
            raise IndexError(f"slot {slot} is not active (active: {self.active})")
        if self._pool is not None:
            return self._pool.unshared(slot) * self._pool_block_bytes
        return self.bytes_for(self._reserved[slot])

    def usage(self) -> KVUsage:
        kept = [self.held(k.tokens) for k in self._kept.values()]
        block = self.block_tokens
        if self._pool is not None:  # the blocks the running sequences hold, and those only kept prefixes hold
            held = self.held_bytes()
            reserved_bytes = self._pool.distinct(range(self.active)) * self._pool_block_bytes
            cached_bytes, block_bytes, used = held - reserved_bytes, self._pool_block_bytes, self._pool.blocks_in_use
        else:
            reserved_bytes = sum(self.bytes_for(t) for t in self._reserved)
            cached_bytes = sum(self.bytes_for(t) for t in kept)
            block_bytes = self._block_bytes()
            used = (sum(self._reserved) + sum(kept)) // block if block else 0
        return KVUsage(self.active, self.slots, sum(self._reserved), reserved_bytes, self.budget_bytes,
                       len(kept), sum(kept), cached_bytes, written_tokens=sum(self._written), block_tokens=block,
                       block_bytes=block_bytes, blocks_used=used)

    @property
    def kept(self) -> list[KeptKV]:
        """The prefixes kept in slots no sequence holds."""
        return list(self._kept.values())

    @property
    def free(self) -> int:
        """Slots neither active nor kept."""
        return self.slots - self.active - len(self._kept)

    def fits_ever(self, tokens: int) -> bool:
        """Whether a sequence of ``tokens`` could be admitted into an empty cache."""
        return tokens <= self.max_context and self.bytes_for(self.held(tokens)) <= self.budget_bytes

    def can_admit(self, tokens: int, shared: int = 0) -> bool:
        """Whether a sequence reserving ``tokens`` fits now, its first ``shared`` tokens another slot's
        (:meth:`admission_bytes`): a free slot and the budget (kept prefixes included: drop them first to make room)."""
        if self.free < 1 or tokens > self.max_context:
            return False
        return self.held_bytes() + self.admission_bytes(tokens, shared) <= self.budget_bytes

    def grow(self, slot: int, tokens: int) -> bool:
        """Make active ``slot``'s reservation cover ``tokens`` (what it holds after its next step), a block at a time
        when paged; False (nothing changed) when the budget cannot give the blocks. Reserved whole, the reservation
        already covers every token the sequence may write: only what it holds is recorded."""
        if not 0 <= slot < self.active:
            raise IndexError(f"slot {slot} is not active (active: {self.active})")
        tokens = int(tokens)
        want = self.held(tokens)
        have = self._reserved[slot]
        if want > have:
            if not self.block_tokens or tokens > self.max_context:
                return False
            more = self.bytes_for(want) - self.bytes_for(have)  # blocks of its own: a pool's new ones are unshared
            if self.held_bytes() + more > self.budget_bytes:
                return False
            self._reserved[slot] = want
            self.storage.claim(slot, want, keep=True)
        self._written[slot] = min(tokens, self._reserved[slot])
        return True

    # ------------------------------------------------------------------ slots

    def admit(self, tokens: int, take: KeptKV | None = None, source: tuple[int, int] | None = None) -> int:
        """Reserve the next slot (the end of the active prefix) for ``tokens``; returns its index. A prefix kept in
        that slot moves to a free one, unless it is ``take``: then the new sequence takes it over in place (its
        keys and values are the sequence's first tokens; the prefix is no longer kept). ``source`` ``(slot,
        length)``: the new sequence's first ``length`` tokens are that active or kept slot's (a prefix-cache hit; a
        sibling choice's prompt, its leader's, not written yet: its :meth:`copy` after the prefill brings the partly
        filled last block), shared in a pool (only the blocks past the full ones counted against the budget), copied
        in slots."""
        slot = self.active
        if source is not None:
            src, length = int(source[0]), int(source[1])
            if not (0 <= src < self.active or src in self._kept) or take is not None:
                raise IndexError(f"admit from slot {src}: it must be active or kept (active: {self.active}), and "
                                 "not with a prefix taken over")
        taken = take is not None and take.slot == slot and self._kept.get(slot) is take
        if taken:
            del self._kept[slot]
            take.slot = None
        if self._pool is not None and taken:  # its blocks held already: the missing ones and private copies count
            more = self._pool.claim_blocks(slot, self.held(tokens), private=True) * self._pool_block_bytes
        else:
            more = self.admission_bytes(tokens, length if source is not None else 0)
        if self.free < 1 or tokens > self.max_context or self.held_bytes() + more > self.budget_bytes:
            if taken:
                self._kept[slot], take.slot = take, slot
            raise AdmissionError(f"no room for {tokens} tokens ({self.usage()})")
        there = self._kept.pop(slot, None)
        if there is not None:  # a kept prefix in the way: to the highest free slot
            dst = self._highest_free(exclude=slot)
            self._relocate(dst, slot, there.tokens)
            there.slot = dst
            self._kept[dst] = there
            if source is not None and src == slot:
                src = dst
        self._reserved.append(self.held(tokens))
        self._written.append(0)
        if source is not None:  # a pool: the source's full blocks shared (its partly filled last one copied)
            self.storage.move(slot, src, length)
        self.storage.claim(slot, self._reserved[-1], keep=taken or source is not None, private=taken)
        return slot

    def _relocate(self, dst: int, src: int, length: int) -> None:
        """Slot ``src``'s sequence (or kept prefix, ``length`` tokens) moved to slot ``dst``, ``src`` left free: a
        block pool hands the blocks over, the slots' buffers copy the tokens."""
        self.storage.relocate(dst, src, length)

    def _highest_free(self, exclude: int | None = None) -> int:
        for slot in range(self.slots - 1, self.active - 1, -1):
            if slot not in self._kept and slot != exclude:
                return slot
        raise AdmissionError(f"no free slot ({self.usage()})")

    def release(self, slot: int, keep: KeptKV | None = None) -> int | None:
        """Free ``slot``. The last active slot's rows move into it to keep the prefix contiguous: returns the
        index it moved from (its sequence now lives at ``slot``), or None when nothing moved. With ``keep``, the
        slot's first ``keep.tokens`` tokens are kept (``keep.slot`` says where; None when no slot was free)."""
        last = self.active - 1
        if not 0 <= slot <= last:
            raise IndexError(f"slot {slot} is not active (active: {self.active})")
        kept_at = None
        if keep is not None and keep.tokens > 0:
            if slot == last:
                kept_at = slot  # in place: it is outside the active prefix once released
                self.storage.claim(slot, keep.tokens, keep=True)  # a pool: the blocks past the kept tokens let go
            elif self.free > 0:
                kept_at = self._highest_free()
                self._relocate(kept_at, slot, keep.tokens)  # a pool: its blocks handed over, none copied
        moved = None
        if slot != last:
            self._relocate(slot, last, self._reserved[last])
            self._reserved[slot] = self._reserved[last]
            self._written[slot] = self._written[last]
            moved = last
        self._reserved.pop()
        self._written.pop()
        if kept_at is not None:
            keep.slot = kept_at
            self._kept[kept_at] = keep
        if kept_at != last:
            self.storage.give_back(last)
        return moved

    def drop(self, kept: KeptKV) -> None:
        """Forget a kept prefix: its slot is free, its pages given back."""
        slot = kept.slot
        if slot is None or self._kept.get(slot) is not kept:
            return
        del self._kept[slot]
        kept.slot = None
        self.storage.give_back(slot)

    def copy(self, dst: int, src: int, length: int) -> None:
        """Slot ``src``'s first ``length`` tokens into slot ``dst`` (``dst`` active, ``src`` active or kept): a
        prompt prefilled once, shared by the sibling sequences of a request with ``n`` choices, or a cached prefix."""
        if not (0 <= dst < self.active and (0 <= src < self.active or src in self._kept)) or dst == src:
            raise IndexError(f"copy {src} -> {dst}: both must be distinct active (or kept) slots "
                             f"(active: {self.active})")
        self.storage.move(dst, src, int(length))

    def views(self, start: int, count: int) -> dict[str, Any]:
        """Every buffer's slots ``[start, start + count)``, contiguous, to bind by pointer (the same object for the
        same slice: the engine keeps its binding of it)."""
        return self.storage.views(start, count)

    def clear(self) -> None:
        """Free every slot (warm-up runs write into the buffers before any sequence is admitted)."""
        while self._reserved:
            self.release(self.active - 1)
        for kept in list(self._kept.values()):
            self.drop(kept)
        for slot in range(self.slots):
            self.storage.give_back(slot)

    def close(self) -> None:
        """Give the buffers back (a device storage returns them to its pool)."""
        self.storage.close()
