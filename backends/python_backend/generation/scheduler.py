"""Continuous batching of generate requests: admission by KV memory, grouped prefill, one batched decode.

One :meth:`Scheduler.step` is one iteration of the engine loop:

1. sequences whose client went away (``is_cancelled()``, asked at most every ``cancel_check_s``: each call is
   a round trip to the Triton process) are dropped and their slots freed;
2. each decoding sequence takes the block its next token falls into, a sequence being preempted when the budget has
   none (``kv_blocks.take_next_blocks``: paged admission; reserving whole, nothing to take);
   waiting sequences are admitted in arrival order while their KV reservation fits
   (``kv_slots.KVSlots.can_admit``: ``budget - weights >= kv bytes`` of every running sequence's reservation and the
   new one's: paged, the blocks of its context and next token and a block of room per sequence; otherwise
   ``prompt + max_tokens``; in a pool of blocks, ``KVSlots.held_bytes``, a block several sequences share counted
   once, and neither a prefix-cache hit's shared blocks nor a sibling choice's share of its leader's full prompt
   blocks counted again); the first that does not fit waits, and nothing overtakes it. With
   ``max_tokens_grouping_s`` set, the waiting are taken grouped by ``max_tokens`` instead (power-of-two
   buckets, the smallest first, arrival order within one) until one has waited that long: those go first;
3. the admitted prompts are prefilled in groups of similar length, split by the cost model the encoders use
   (``grouping.plan_groups``: a launch costs ``a + b n L + c n L^2``), each group in one launch on contiguous
   slots; each new sequence gets its first token. The sibling sequences of a request with ``n`` choices
   (``Generation.leader``: choice 0) share their prompt's prefill: admitted in the same group as their leader (the
   groups are planned over the launched prompts), they take the slots after the group's launched rows, the
   leader's keys and values are copied into them (``KVSlots.copy``), and each samples its first token from the
   leader's logits row with its own sampler. In a pool of blocks each is admitted from its leader's slot
   (``KVSlots.admit(source=...)``): it holds the leader's full prompt blocks, shared, from admission and reserves
   only its own (the copied partly filled last block, its next token's), so the prompt is counted once. A sibling
   admitted apart from its leader (the budget split them) prefills its prompt itself, counted whole (``siblings``);
4. every sequence that was already running decodes one token, all in one launch, each at its own length. The
   token masks of the rows with a grammar (``Generation.grammar``: structured outputs) are computed on a worker
   thread while that launch runs when there are many, in place when few (``structured.grammar.StepMasks``), and
   applied to their logits before sampling; each matcher advances with its sequence's token, and a sequence whose
   grammar is complete ends (``stop``).

New requests therefore join the running batch at the next step. The waiting queue is bounded: past it
:meth:`Scheduler.submit` raises :class:`QueueFull` (the frontends answer 503 with Retry-After), so the
cache never holds more than it can, and nothing runs out of memory. With ``preemption_wait_s`` set, a
request that waited longer than that for memory preempts the running sequence with the most tokens left of those
whose release frees memory (``kv_blocks.choose_victim``: in a pool of blocks, what no other slot holds), each at most
once; its slot freed, its tokens kept: it resumes behind the request it made room for by prefilling its prompt and
what it had generated, with its own sampler, so its output does not change.

With ``chunk_tokens`` (``chunked_prefill``: chunked prefill), a step prefills at most that many prompt tokens beside
the decode launch: sequences mid-prefill continue first, a prompt longer than what is left is split over steps, and a
sequence mid-prefill sits in the decode launch as a placeholder row until its last chunk gives its first token.
With an ``itl_budget`` (``itl_budget.ItlBudget``: ``auto`` with ``max_itl_ratio``), that budget is sized each step
from the timed decode launches and the cost model, so the step stays within the ratio of a decode-only step.

With a ``prefix_cache`` (``prefix_cache.PrefixCache``), a waiting sequence whose context starts with whole blocks a
running sequence's slot or a kept slot holds gets its slot at once, those tokens' keys and values copied in (or, a
kept slot at the end of the active prefix, taken over in place; in a pool of blocks, shared), and prefills only the
rest, alone in its launch (ONNX Runtime's rule for a continued prompt). A finished sequence's slot is kept for its
prefix; kept slots are dropped least recently used first when a waiting sequence needs their memory (only those
whose dropping frees some) or their slot, before any preemption. A waiting sequence sharing at least a whole block
with a prompt admitted earlier in the same step (not prefilled yet, so no holder), more than its own hit, is held
back a step, once, and admission stops there (``prefix_cache.PendingBlocks``; not a sibling choice): next step its
lookup finds that prompt's blocks, so a burst on a new document prefills it once (behind a prompt split in chunks it
waits anyway, that group being the step's last, and its lookup then takes what the chunks wrote).

With a ``speculator`` (``speculative.Speculator``), a drafting row is a placeholder in the decode launch (timed for
it) and verified in a launch of its own, its agreeing drafts and the model's next token taken by ``_accept``.

Pure Python and numpy, no Triton: the Triton model (``generate_model``) feeds it and sends what it emits.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from .detokenize import IncrementalDetokenizer, StopMatcher
from ..batching.grouping import CostModel, plan_groups
from .kv_blocks import choose_victim, take_next_blocks
from .kv_slots import AdmissionError, KVSlots
from .chunked_prefill import MIN_CHUNK, over_budget
from .prefix_cache import Hit, PrefixCache
from .sampling import Sampler, SamplingError
from .siblings import admission_source, placeholder_at, shares_prefill, sharing_last, take_over
from .structured.grammar import StepMasks
from .sequence import Generation, NullMetrics, QueueFull, TokenEvent, _adapters, _count

JITTER_WINDOW = 10  # token intervals per jitter sample (000 §4.1)
FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED, FINISH_ERROR = "stop", "length", "cancelled", "error"


class Scheduler:
    """Admits, prefills and decodes generate requests, one step at a time (see the module docstring)."""

    _ids = itertools.count(1)

    def __init__(self, model: Any, slots: KVSlots, tokenizer: Any, eos_token_ids: Sequence[int], *,
                 max_waiting: int = 64, cost: CostModel | None = None, max_prefill_tokens: int = 2048,
                 max_prefill_batch: int = 16, preemption_wait_s: float = 0.0, max_tokens_grouping_s: float = 0.0,
                 retry_after_s: float = 1.0, metrics: Any = None, clock: Callable[[], float] = time.perf_counter,
                 log_error: Callable[[str], None] = lambda _m: None, cancel_check_s: float = 0.05,
                 prefix_cache: PrefixCache | None = None, chunk_tokens: int = 0, whole_below: int = 0,
                 itl_budget: Any = None) -> None:
        self.model, self.slots, self.tokenizer = model, slots, tokenizer
        self.eos = tuple(int(e) for e in eos_token_ids)
        self.max_waiting = int(max_waiting)
        self.cost = cost or CostModel(1e-3, 1e-5, 0.0)
        self.max_prefill_tokens = int(max_prefill_tokens)
        self.max_prefill_batch = max(1, int(max_prefill_batch))
        self.preemption_wait_s = float(preemption_wait_s)
        self.max_tokens_grouping_s = float(max_tokens_grouping_s)
        self.retry_after_s = float(retry_after_s)
        self.metrics, self.clock, self.log_error = metrics or NullMetrics(), clock, log_error
        # is_cancelled() is a round trip to the Triton process per sequence: asked at most this often.
        self.cancel_check_s = float(cancel_check_s)
        self.prefix_cache = prefix_cache
        self.chunk_tokens = max(0, int(chunk_tokens))  # prompt tokens a step prefills (0: whole prompts)
        self.whole_below = max(0, int(whole_below))  # prompts this short are prefilled whole, outside the budget
        self._chunks = 0  # chunk launches this step (counted on /metrics)
        self.itl = itl_budget  # itl_budget.ItlBudget: the chunk sized to the ITL target (None: chunk_tokens fixed)
        self._seconds: float | None = None  # what the step's chunks may still take (the ITL budget)
        self._chunk_tokens, self._predicted = 0, 0.0  # this step's chunked prompt tokens, its predicted seconds
        self.loras: Any = None  # lora.AdapterTable where the model serves adapters (their metrics reported)
        self.speculator: Any = None  # speculative.Speculator where prompt-lookup drafting is on
        self._last_cancel_check = float("-inf")
        self.running: list[Generation] = []  # running[i].slot == i
        self.waiting: collections.deque[Generation] = collections.deque()
        self._arrivals: list[Generation] = []
        self._lock = threading.Lock()
        self.wake = threading.Event()  # set when work arrives (the engine loop sleeps on it when idle)
        self.masks = StepMasks()  # grammar rows' token masks, computed beside the batched step

    # ------------------------------------------------------------------ from execute()

    def submit(self, gen: Generation) -> Generation:
        """Queue a sequence for the next step; :class:`QueueFull` past the waiting bound, a
        :class:`SamplingError` for one that could never fit the cache."""
        return self.submit_all([gen])[0]

    def submit_all(self, gens: Sequence[Generation]) -> list[Generation]:
        """Queue the sequences of one request (its ``n`` choices) together: all of them, or none (QueueFull,
        or a SamplingError when they could never be queued at once)."""
        for gen in gens:
            if not self.slots.fits_ever(gen.reserved_tokens):
                raise SamplingError(f"the prompt ({len(gen.prompt)} tokens) and max_tokens ({gen.params.max_tokens}) "
                                    f"need {self.slots.bytes_for(gen.reserved_tokens)} bytes of KV cache, more than "
                                    f"its budget of {self.slots.budget_bytes}: lower max_tokens or shorten the prompt")
        if len(gens) > self.slots.slots + self.max_waiting:
            raise SamplingError(f"n={len(gens)} sequences cannot be queued together: this model runs "
                                f"{self.slots.slots} at once and queues {self.max_waiting} more")
        with self._lock:
            # Queued sequences beyond the free slots are the ones that will wait: max_waiting bounds those (the
            # engine thread changes `running`; a stale count errs by a step, and nothing overflows the cache:
            # admission checks the budget).
            queued = len(self.waiting) + len(self._arrivals)
            free = max(0, self.slots.slots - len(self.running))
            if queued + len(gens) - free > self.max_waiting:
                self.metrics.refused()
                raise QueueFull(max(0, queued - free), self.retry_after_s)
            for gen in gens:
                gen.id = next(self._ids)
                gen.arrival = self.clock()
                gen.sampler = Sampler(gen.params, self.eos, gen.prompt)
                gen.detok = IncrementalDetokenizer(self.tokenizer, gen.prompt) if self.tokenizer is not None else None
                gen.stopper = StopMatcher(gen.params.stop)
                gen.matcher = gen.grammar.matcher() if gen.grammar is not None else None
                self._arrivals.append(gen)
        self.wake.set()
        return list(gens)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self.running or self.waiting or self._arrivals)

    # ------------------------------------------------------------------ the engine loop

    def step(self) -> None:
        """One iteration: drop cancelled sequences, admit, prefill the admitted, decode the others."""
        with self._lock:
            self.waiting.extend(self._arrivals)
            self._arrivals.clear()
        self._drop_cancelled()
        take_next_blocks(self)  # paged admission: each decoding sequence's next block, or a preemption (kv_blocks)
        continuing, left = self._plan_chunks()
        admitted = self._admit(left)  # may preempt: count the sequences already running after it
        old = len(self.running) - sum(len(group) for group in admitted)
        self._chunks, self._chunk_tokens, self._predicted = 0, 0, 0.0
        began = self.clock()
        try:
            if old:
                self._decode(old)
            for gen, take in continuing:
                if gen.slot is not None and gen.finish_reason is None:  # not preempted nor cancelled meanwhile
                    self._prefill([[gen] + self._waiting_on(gen)], take)
            if admitted:
                self._prefill(admitted, left)
        except Exception as exc:  # noqa: BLE001 - an engine failure ends the sequences it ran, not the server
            self.log_error(f"model-factory backend: a generation step failed: {type(exc).__name__}: {exc}")
            self.masks.clear()
            for gen in list(self.running):
                self._finish(gen, FINISH_ERROR, error=f"the engine failed: {exc}")
        took = self.clock() - began
        self._release_finished()
        if self._chunks:
            self.metrics.prefill_chunks(self._chunks)
            self.metrics.chunked_step(self._chunk_tokens, self._predicted if self.itl is not None else 0.0, took)
        cache = self.prefix_cache
        self.metrics.state(len(self.running), len(self.waiting), self.slots.usage(),
                           cached_blocks=cache.blocks() if cache is not None else 0)
        if self.loras is not None:  # vLLM's lora_requests_info: the adapters of the running and waiting sequences
            self.metrics.adapters(_count(self.running), _count(self.waiting), self.loras.max_loras,
                                  loaded=len(self.loras.loaded()))

    def _drop_cancelled(self) -> None:
        now = self.clock()
        if now - self._last_cancel_check < self.cancel_check_s:
            return
        self._last_cancel_check = now
        for gen in list(self.running):
            if gen.is_cancelled():
                self._finish(gen, FINISH_CANCELLED)
        kept = collections.deque()
        for gen in self.waiting:
            if gen.is_cancelled():
                self._finish(gen, FINISH_CANCELLED)
            else:
                kept.append(gen)
        self.waiting = kept
        self._release_finished()

    def _admission_key(self, now: float) -> Callable[[Generation], tuple]:
        """The order waiting sequences are taken in when grouping by ``max_tokens``: those that waited past the
        bound first (by arrival), then by power-of-two bucket of ``max_tokens``, by arrival within a bucket."""
        bound = self.max_tokens_grouping_s

        def key(gen: Generation) -> tuple:
            if now - gen.arrival >= bound:
                return (0, 0, gen.arrival)
            return (1, int(gen.params.max_tokens).bit_length(), gen.arrival)
        return key

    def _admit(self, left: int | None = None) -> list[list[Generation]]:
        """Waiting sequences that fit now, in arrival order (or grouped by ``max_tokens``), slots assigned by
        prefill group. ``left``: the prompt tokens this step may still prefill (chunked prefill; None: no bound):
        whole prompts while they fit, then one split (its group last, with the siblings that share its prefill)."""
        if self.max_tokens_grouping_s > 0 and len(self.waiting) > 1:
            self.waiting = collections.deque(sorted(self.waiting, key=self._admission_key(self.clock())))
        chosen: list[Generation] = []
        hits: list[list[Generation]] = []  # admitted at once, each its own launch
        split: Generation | None = None  # the one whose prompt does not fit what is left: its first chunk now
        split_hit: list[list[Generation]] = []  # the same, for one admitted with a prefix-cache hit
        pending = 0  # bytes the chosen (not yet in the slots) will reserve
        coming = self.prefix_cache.pending() if self.prefix_cache is not None else None  # what this step will hold
        while self.waiting and len(chosen) + len(hits) + len(split_hit) < self.max_prefill_batch:
            if self.slots.slots - self.slots.active - len(chosen) < 1:
                break  # no slot, even with every kept prefix dropped
            head = self.waiting[0]
            # A sibling choice whose leader this step prefills shares its prefill, and in a pool its full blocks.
            sharing = shares_prefill(head, chosen)
            shared = len(head.leader.context()) if sharing else 0
            hit = self.prefix_cache.lookup(head.context()) if self.prefix_cache is not None and not sharing else None
            rest = len(head.context()) - (hit.tokens if hit is not None else 0)
            budget = left if rest > self.whole_below else None  # a short prompt: whole, outside the budget
            if split is not None and not (sharing and head.leader is split):
                break  # the split prompt's group is the step's last
            if not sharing and over_budget(rest, left, self.whole_below):
                break  # this step's prefill budget is spent: it waits, holding no memory
            if coming is not None and not sharing and coming.hold_back(head, hit):
                self.metrics.prefix_held_back()
                break  # a prompt admitted before it writes their shared prefix now: it waits, and nothing overtakes it
            room = self.slots.headroom_bytes(len(self.running) + len(chosen) + 1)  # paged: the next blocks' room
            fits, hit = self._make_room(head, pending + room, len(chosen) + 1, hit, shared)
            if not fits:
                # A sequence admitted with a hit already holds a slot: no preemption may move it this step.
                if not hits and not split_hit and self._preempt_for(head):
                    continue
                break
            self.waiting.popleft()
            hit_taken = hit is not None and not sharing and self._admit_hit(head, hit)
            # Its hit gone (the holder dropped for room) or refused: the whole prompt, against what is left.
            if not (sharing or hit_taken) and over_budget(len(head.context()), left, self.whole_below):
                self.waiting.appendleft(head)  # it waits (a first chunk of nothing is no launch)
                break
            if self.prefix_cache is not None:
                self.metrics.prefix_lookup(len(head.context()), head.cached if hit_taken else 0)
            # Admitted whole (no hit): every block its own, but a sharing sibling's of its leader's prompt (a pool).
            need = self.slots.admission_bytes(self._held(head), shared)
            if sharing:
                chosen.append(head)
                pending += need
            elif hit_taken:
                rest = len(head.context()) - head.cached
                if coming is not None:
                    coming.add(head.context(), head.cached + (rest if budget is None else min(rest, budget)))
                if budget is not None and rest > budget:
                    split_hit.append([head])  # its first chunk after the whole prompts' launches
                else:
                    hits.append([head])
                if budget is not None:
                    left = budget - min(budget, rest)
            else:
                chosen.append(head)
                pending += need
                rest = written = len(head.context())
                if left is not None and rest > self.whole_below:
                    if rest > left:
                        split, written = head, left  # its first chunk this step
                    left -= min(left, rest)
                if coming is not None:
                    coming.add(head.context(), written)
        if not chosen:
            return hits + split_hit
        whole = chosen[:chosen.index(split)] if split is not None else chosen
        ordered = self._place(whole, chosen)
        if split is not None and sum(map(len, ordered)) == len(whole):
            # The split prompt (and the siblings sharing its prefill): a group of its own, after the whole ones.
            ordered += self._place_group(chosen[len(whole):], ordered, chosen)
        return hits + ordered + split_hit

    def _place(self, whole: list[Generation], chosen: list[Generation]) -> list[list[Generation]]:
        """Slots for the ``whole`` prompts (of ``chosen``), by prefill group (the cost model's), each group
        contiguous; stops short (the rest of ``chosen`` back in the queue) when the slots refuse one."""
        if not whole:
            return []
        # The launched rows planned; each sibling sharing a leader's prefill placed in its leader's group.
        sharing = [g for g in whole if shares_prefill(g, whole)]
        launched = [g for g in whole if not any(g is s for s in sharing)]
        lengths = [len(g.context()) for g in launched]
        groups = plan_groups(lengths, self.cost, max_batch=len(launched),
                             max_tokens=max(self.max_prefill_tokens, max(lengths)))
        ordered: list[list[Generation]] = []
        for group in groups:
            members = [launched[i] for i in group]
            group = members + [g for g in sharing if any(g.leader is m for m in members)]
            got = self._place_group(group, ordered, chosen)
            ordered += got
            if sum(map(len, got)) < len(group):
                break
        return ordered

    def _place_group(self, group: list[Generation], ordered: list[list[Generation]],
                     chosen: list[Generation]) -> list[list[Generation]]:
        """Slots for one prefill group (the siblings sharing a prefill last: in a pool of blocks each admitted with
        its leader's full prompt blocks shared, ``KVSlots.admit(source=...)``, so only its own blocks count; their
        keys and values are the leader's once its prefill writes them); when the slots refuse one (not expected: the
        choice kept within the budget) what was placed, and every sequence of ``chosen`` not placed back at the head
        of the queue: nothing is lost."""
        members: list[Generation] = []
        for gen in sharing_last(group):
            try:
                gen.slot = self.slots.admit(self._held(gen), source=admission_source(gen, self.slots))
            except AdmissionError as exc:
                self.log_error(f"model-factory backend: admission stopped short ({exc}); the sequences not "
                               "admitted wait again at the head of the queue")
                placed = {id(g) for g in members} | {id(g) for grp in ordered for g in grp}
                self.waiting.extendleft(reversed([g for g in chosen if id(g) not in placed]))
                return [members] if members else []
            self.running.append(gen)
            members.append(gen)
        return [members]

    # ------------------------------------------------------------------ the prefix cache

    def _make_room(self, head: Generation, extra: int, slots_needed: int,
                   hit: Hit | None, shared: int = 0) -> tuple[bool, Hit | None]:
        """Drop kept prefixes, least recently used first (``hit``'s last), until ``head`` (with ``hit``'s blocks, or
        the blocks of its first ``shared`` tokens (a sibling sharing its leader's prompt), shared where the storage
        shares them: ``KVSlots.admission_bytes``), ``extra`` more bytes and ``slots_needed`` more slots fit; for the
        memory only a prefix whose dropping frees some is dropped (in a pool, one whose blocks running sequences share
        frees nothing). Returns whether they fit, and the hit (None when its prefix was dropped)."""
        cache = self.prefix_cache
        while True:
            need = self.slots.admission_bytes(self._held(head), hit.tokens if hit is not None else shared) + extra
            short = self.slots.held_bytes() + need > self.budget
            if not short and self.slots.free >= slots_needed:
                return True, hit
            if cache is None:
                return False, hit
            keep = [hit.holder] if hit is not None and hit.kept else []
            frees = (lambda e: self.slots.freed_by_drop(e) > 0) if short else None
            victim = cache.least_recent(exclude=keep, where=frees) or next(
                (k for k in keep if frees is None or frees(k)), None)
            if victim is None:  # nothing kept that helps: what the running sequences reserve decides
                return False, hit
            if hit is not None and victim is hit.holder:
                hit = None
            self._drop_kept(victim)

    @property
    def budget(self) -> int:
        return self.slots.budget_bytes

    def _held(self, gen: Generation) -> int:
        """The tokens ``gen`` reserves at admission (``KVSlots.admission_tokens``: paged or whole)."""
        return self.slots.admission_tokens(gen.reserved_tokens, len(gen.context()))

    def _drop_kept(self, entry: Any) -> None:
        self.prefix_cache.forget(entry)
        self.slots.drop(entry)

    def _admit_hit(self, gen: Generation, hit: Hit) -> bool:
        """Give ``gen`` its slot now, with the hit's keys and values in it: in slots, a kept slot at the end of the
        active prefix is taken over in place when the hit is at least half of it, anything else copied; in a pool,
        the hit's blocks shared (the kept prefix stays kept, for the prompts after it). False (nothing done) when the
        slots refuse it."""
        holder, n = hit.holder, hit.tokens
        take = holder if (hit.kept and holder.slot == self.slots.active and 2 * n >= holder.tokens
                          and not self.slots.shares_blocks) else None
        try:
            gen.slot = self.slots.admit(self._held(gen), take=take, source=None if take else (holder.slot, n))
        except AdmissionError:
            return False
        if take is not None:
            self.prefix_cache.forget(take)
        gen.cached = gen.prefix_hit = n
        gen.prefill_from = None
        self.running.append(gen)
        return True

    def _preempt_for(self, head: Generation) -> bool:
        """Preempt a running sequence for ``head`` when it waited past the bound: of those whose release frees memory
        (``kv_blocks.choose_victim``; in a pool one whose blocks are all shared frees none), the one that would hold it
        longest (most tokens left), each preempted at most once. None freeing any, none is: ``head`` waits for the
        running sequences to end (they take their blocks or are preempted for them: nothing deadlocks)."""
        if self.preemption_wait_s <= 0 or not self.running or self.clock() - head.arrival < self.preemption_wait_s:
            return False
        candidates = [g for g in self.running if not g.preemptions and g.finish_reason is None]
        victim = choose_victim(candidates, self.slots, last_resort=False,
                               key=lambda g: (g.params.max_tokens - len(g.generated), g.arrival))
        if victim is None:
            return False
        self.preempt(victim, at=1)  # right behind the request it made room for
        return True

    def preempt(self, victim: Generation, at: int = 0) -> None:
        """Free ``victim``'s slot and memory; it waits at ``at`` in the queue and resumes by prefilling its context."""
        self._release(victim, keep=False)
        victim.cached, victim.slot, victim.prefilling = 0, None, False
        victim.preemptions += 1
        self.metrics.preempted()
        self.waiting.insert(at, victim)

    def _plan_chunks(self) -> tuple[list[tuple[Generation, int]], int | None]:
        """The sequences mid-prefill that continue this step (oldest first) and their chunks' tokens, and the prompt
        tokens left for new prompts (None: no bound, when chunked prefill is off or no sequence decodes: there is no
        stream to keep level, and whole prompts waste no launch). When a leader stops before its last chunk
        (cancelled, preempted), the first of its siblings waiting on it prefills the prompt in its place and the
        others wait on that one (``siblings.take_over``)."""
        prefilling = [g for g in self.running if g.prefilling]
        if not self.chunk_tokens and not prefilling:
            return [], None
        decoding = len(prefilling) < len(self.running)
        left = self.chunk_tokens if decoding and self.chunk_tokens else None
        # The ITL budget: seconds beside the decode launch (its rows: up to the last decoding one), each chunk fitted.
        rows = max((i + 1 for i, g in enumerate(self.running) if not g.prefilling), default=0)
        self._seconds = self.itl.allowance(rows) if self.itl is not None and left is not None else None
        plan: list[tuple[Generation, int]] = []
        heirs: dict[int, Generation] = {}  # a stopped leader -> the sibling prefilling in its place
        for gen in sorted(prefilling, key=lambda g: g.id):
            take_over(gen, heirs, self.slots)
            if gen.prefill_from is not None:
                continue  # its leader's last chunk fills its slot
            rest = len(gen.context()) - gen.cached
            if self._seconds is not None:
                left = self.itl.fit(self._seconds, gen.cached, first=not plan)
            take = rest if left is None else min(rest, left)
            if take < min(rest, MIN_CHUNK):
                break
            plan.append((gen, take))
            if self._seconds is not None:
                self._seconds -= self.itl.chunk_seconds(take, gen.cached)
            elif left is not None:
                left -= take
        if self._seconds is not None:  # what a new prompt's first chunk may take (the floor when none continued)
            left = self.itl.fit(self._seconds, 0, first=not plan)
        return plan, left

    def _waiting_on(self, leader: Generation) -> list[Generation]:
        """The siblings mid-prefill that share ``leader``'s prefill."""
        return [g for g in self.running if g.prefilling and g.prefill_from is leader]

    def _prefill(self, groups: list[list[Generation]], left: int | None = None) -> None:
        """Launch each group's prefill; ``left``: the prompt tokens this step may prefill (None: every prompt
        whole). A group with one launched row and a cached prefix, or a prompt over what is left, is that row's
        next chunk: alone in its launch, from its cached tokens."""
        for members in groups:
            start = members[0].slot
            launched = [g for g in members if g.prefill_from is None]
            contexts = [g.context() for g in launched]
            gen = launched[0]
            rest = len(contexts[0]) - gen.cached
            # A short prompt: whole, outside the budget; the rest of one already split stays in it (its tail whole
            # would be a launch of up to whole_below tokens beside the streams).
            bounded = left is not None and (rest > self.whole_below or gen.prefilling)
            if gen.cached or (bounded and rest > left):  # one row, continued or split (chunked prefill)
                take = min(rest, left) if bounded else rest
                past = gen.cached
                piece = contexts[0][past:past + take]
                began = self.clock()
                logits = self.model.prefill([piece], self.slots.views(gen.slot, 1), past=[past] if past else None,
                                            **_adapters([gen]))
                chunk = gen.prefilling or take < rest
                self._chunks += chunk
                if chunk:
                    self._chunk_tokens += take
                    if self.itl is not None:
                        self._predicted += self.itl.chunk_seconds(take, past)
                        self.itl.observe_chunk(take, past, self.clock() - began)
                if bounded:
                    left -= take
                gen.cached = past + take
                if take < rest:  # more chunks to come: its siblings wait for its last one
                    for g in members:
                        g.prefilling = True
                    if self.prefix_cache is not None:
                        self.prefix_cache.running(gen)
                    continue
            else:
                logits = self.model.prefill(contexts, self.slots.views(start, len(launched)), **_adapters(launched))
                if left is not None:
                    left -= sum(len(c) for c in contexts if len(c) > self.whole_below)
            rows = {}
            for gen, ctx, row in zip(launched, contexts, logits):
                gen.cached = len(ctx)
                gen.prefilling = False
                rows[id(gen)] = row
                if not gen.preemptions:
                    self.metrics.tokens(len(gen.prompt), 0)
                if self.prefix_cache is not None:
                    self.prefix_cache.running(gen)
            # Siblings sharing their leader's prefill: its keys and values copied into their slots (before any
            # slot is released: that happens after the step), the first token sampled from its row.
            for gen in members[len(launched):]:
                leader = gen.prefill_from
                self.slots.copy(gen.slot, leader.slot, leader.cached)
                gen.cached = leader.cached
                gen.prefilling = False
                rows[id(gen)] = rows[id(leader)]
            for gen in members:
                self._accept(gen, rows[id(gen)])

    def _decode(self, count: int) -> None:
        """One token for each of the first ``count`` running sequences, in one launch. A sequence mid-prefill
        among them is a placeholder row (its next prompt token at its cached length, written again by its next
        chunk; nothing sampled); rows after the last decoding one are left out. Rows drafting tokens (``speculator``:
        speculative decoding) are placeholders too, each verified after it in a launch of its own."""
        active = self.running[:count]
        # Rows drafting tokens (speculative.py) are verified in launches of their own: placeholders here.
        drafting = self.speculator.plan(active) if self.speculator is not None else {}
        # Paged admission took each row's next block (kv_blocks); a draft writes up to its length more: it runs only
        # where the budget gives those blocks too, else the row decodes one token as planned.
        drafting = {k: (g, d) for k, (g, d) in drafting.items() if self.slots.grow(g.slot, g.cached + 1 + len(d))}
        while active and (active[-1].prefilling or id(active[-1]) in drafting):
            active.pop()
        if active:
            self.masks.start(g for g in active if not g.prefilling)  # grammar masks, on a worker while it runs
            began = self.clock()
            at = [placeholder_at(g, self.slots) for g in active]
            tokens = [(c := g.context())[min(p, len(c) - 1)] for g, p in zip(active, at)]  # one list a row
            logits = self.model.decode(tokens, at, self.slots.views(0, len(active)), **_adapters(active))
            if self.speculator is not None and not all(g.prefilling for g in active):
                self.speculator.observe_decode(len(active), self.clock() - began)  # verifications are judged by it
            if self.itl is not None:  # the decode launch the ITL budget measures chunks against
                self._predicted += self.itl.decode_seconds(len(active)) or 0.0
                self.itl.observe_decode(len(active), self.clock() - began)
            for gen, row in zip(active, logits):
                if not gen.prefilling and id(gen) not in drafting:
                    gen.cached += 1
                    self._accept(gen, row)
        for gen, drafts in drafting.values():
            self.speculator.verify(gen, drafts, self.model, self.slots.views(gen.slot, 1), self._accept,
                                   _adapters([gen]))

    # ------------------------------------------------------------------ tokens out

    def _accept(self, gen: Generation, logits: np.ndarray) -> None:
        if gen.finish_reason is not None:
            return
        allowed = self.masks.allowed(gen)
        if allowed is not None and not allowed.any():
            self._finish(gen, FINISH_ERROR, error="the grammar allows no next token: " + gen.matcher.error())
            return
        token = gen.sampler.choose(logits, len(gen.generated), allowed)
        logprobs = gen.sampler.last
        gen.generated.append(token)
        grammar_done = gen.matcher is not None and (not gen.matcher.accept(token) or gen.matcher.finished())
        now = self.clock()
        if gen.last_token_time is None:
            self.metrics.first_token(now - gen.arrival)
        else:
            interval = now - gen.last_token_time
            self.metrics.token_interval(interval)
            gen.intervals.append(interval)
            if len(gen.intervals) == JITTER_WINDOW:
                self.metrics.jitter(float(np.std(gen.intervals)))
                gen.intervals.clear()
        gen.last_token_time = now
        self.metrics.tokens(0, 1)
        p = gen.params
        stop_token = token in p.stop_token_ids  # ends the sequence; its own text is not output
        text = gen.detok.add(token) if gen.detok is not None and not stop_token else ""
        text = gen.stopper.feed(text)
        reason = None
        if token in self.eos and not p.ignore_eos or stop_token:
            reason = FINISH_STOP
        elif gen.stopper.stopped or grammar_done:  # a complete grammar ends the sequence as its eos would
            reason = FINISH_STOP
        elif len(gen.generated) >= p.max_tokens:
            reason = FINISH_LENGTH
        if reason is not None:
            if not gen.stopper.stopped:
                tail = gen.detok.flush() if gen.detok is not None else ""
                text += gen.stopper.feed(tail) + gen.stopper.flush()
            gen.finish_reason = reason
            self.metrics.finished(reason)
        gen.emit(gen, TokenEvent(token, text, reason, logprobs=logprobs))

    def _finish(self, gen: Generation, reason: str, error: str | None = None) -> None:
        if gen.finish_reason is not None:
            return
        gen.finish_reason = reason
        self.metrics.finished(reason)
        try:
            gen.emit(gen, TokenEvent(None, "", reason, error))
        except Exception:  # noqa: BLE001 - a client gone while being told it is gone
            pass

    def _release(self, gen: Generation, keep: bool = True) -> None:
        """Free ``gen``'s slot (the last running sequence moves into it); with the prefix cache its valid tokens are
        kept (``keep``: not for a preempted sequence, whose memory is what was asked for, nor after an engine error)."""
        slot, cache = gen.slot, self.prefix_cache
        entry = None
        if cache is not None:
            if keep and gen.finish_reason != FINISH_ERROR:
                entry = cache.keep(gen)
            cache.stopped(gen)
            if entry is not None and slot != self.slots.active - 1 and self.slots.free < 1:
                oldest = cache.least_recent()  # every slot taken: the newest prefix replaces the oldest
                if oldest is not None:
                    self._drop_kept(oldest)
        moved = self.slots.release(slot, keep=entry)
        if entry is not None and entry.slot is not None:
            for extended in cache.kept(entry):
                self._drop_kept(extended)
        last = self.running.pop()
        if moved is not None:
            self.running[slot] = last
            last.slot = slot
        gen.slot = None

    def _release_finished(self) -> None:
        for gen in sorted((g for g in self.running if g.finish_reason is not None), key=lambda g: -g.slot):
            self._release(gen)
