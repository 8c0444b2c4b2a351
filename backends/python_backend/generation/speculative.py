"""Speculative decoding by prompt lookup: the next tokens drafted from the sequence's own context, verified in one launch.

Extractive answers (a document's sentences quoted, code edited in place, a form filled from the prompt) repeat spans of
their context. Prompt lookup (vLLM's ``ngram`` method, ``prompt_lookup_max`` / ``_min``) drafts them for free: the
sequence's last ``n`` tokens (``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``) are looked up earlier in
its context (the prompt and what it generated; the latest occurrence wins) and the ``num_speculative_tokens`` tokens
that followed it there are the draft (:func:`propose`; near the context's end the repetition is continued with its
period). No draft model, nothing learned.

Verification (:meth:`Speculator.verify`) is one launch: the sequence's last token and its ``k`` drafted tokens as a
continued prompt on its slot (``CausalLM.continued_logits``: the attention mask covers the cached tokens, as a
prefix-cache hit's or a chunk's continued prompt), the logits of all ``k + 1`` positions. The scheduler's own
``_accept`` then takes them one position at a time, exactly as ``k + 1`` decode steps would: the sequence's sampler
chooses the token at each position (greedy argmax, or its seeded generator: one draw per token, as in plain
decoding), which is accepted; while it equals the drafted token, the next position's logits are conditioned on
exactly the tokens plain decoding would have had, so the next position is taken too. The first disagreement (or the
last position) ends it: the tokens out are the agreeing drafts plus the model's own next token, at most ``k + 1``. The
keys and values written for the rejected drafts stay in the slot past ``Generation.cached`` (the cache length is set
back over them), never read (every launch's mask stops at its row's length) and written over by the next launch.

Because every token is chosen by the same sampler from the logits of the same context, the output equals plain
decoding's, greedy and seeded sampling alike (a draft is a point proposal: sampling the model's token and keeping the
draft only where they agree is speculative sampling's acceptance rule for a draft distribution that is one token, so
the distribution is preserved and, with the same generator state, so is each draw); stop strings, eos, ``min_tokens``,
the penalties, ``max_tokens`` and log-probabilities are the per-token ``_accept``'s, unchanged. Not drafted for: rows
with a grammar (their mask would have to be checked per drafted token), rows mid-prefill, and sequences with fewer
than two tokens left (the model's own token would be the last anyway).

Where it pays. ONNX Runtime's CPU ``GroupQueryAttention`` refuses a batched continued prompt, so each verification is a
launch of its own. While one sequence decodes, the verification replaces the decode launch (it costs about one decode
launch, more with ``k``); with more sequences decoding, the batched decode launch still runs for the others (the
speculating row a placeholder in it, as a row mid-prefill is) and each verification is a launch added to the step, which
every other stream waits for. So drafting is on while at most ``max_sequences`` sequences decode
(``speculative_max_sequences``, default 1: measured, docs/generation.md), and per sequence it backs off where the
drafts are rejected: every :data:`WINDOW` verifications the sequence's accepted tokens per verification are checked,
and below :data:`MIN_ACCEPTED` it stops drafting for :data:`PAUSE_STEPS` steps (then tries again: an answer can turn
from free text to a quotation). Judged per verification, not per drafted token: a rejected draft of 8 costs what one
of 4 does (the launch is bound by reading the weights), so what decides is the tokens a launch gains.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

PROMPT_LOOKUP = "prompt_lookup"  # contract.SPECULATIVE's method
WINDOW = 4  # verifications over which a sequence's acceptance is judged
PAUSE_STEPS = 32  # steps a sequence drafts nothing after its acceptance fell below the bound
# Accepted tokens per verification below which a sequence pauses: a verification costs a decode launch and about half
# of one more on Gemma 3 270M (docs/generation.md, "Speculative decoding"), so fewer than half a token gained loses.
MIN_ACCEPTED = 0.5

__all__ = ["MIN_ACCEPTED", "PAUSE_STEPS", "PROMPT_LOOKUP", "WINDOW", "SpeculativeConfig", "Speculator", "propose"]


def propose(context: Sequence[int], k: int, n_max: int, n_min: int) -> list[int]:
    """The ``k`` tokens that followed the latest earlier occurrence of ``context``'s last ``n`` tokens, for the
    longest ``n`` from ``n_max`` down to ``n_min`` that occurs; empty when none does. Where fewer than ``k`` tokens
    follow it before the context's end, the repetition continues with the same period (a loop of one token, ``a a a``,
    drafts ``k`` of them, not the one token left before the end)."""
    size = len(context)
    if k < 1 or size < n_min + 1:
        return []
    arr = np.asarray(context, dtype=np.int64)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        # Windows of n tokens starting before the last n: the suffix itself is not a match of itself.
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == arr[size - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            period = size - start  # the match repeats the text `period` tokens back: continue that repetition
            follow = arr[start:].tolist()
            return [follow[j % period] for j in range(k)]
    return []


@dataclass(frozen=True)
class SpeculativeConfig:
    """The serving settings (contract: ``speculative``, ``num_speculative_tokens``, ``prompt_lookup_max`` / ``_min``,
    ``speculative_max_sequences``)."""

    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    max_sequences: int = 1  # drafting only while at most this many sequences decode
    min_accepted: float = MIN_ACCEPTED  # accepted tokens per verification, judged over WINDOW verifications


@dataclass
class _Track:
    """One sequence's recent drafts: verifications and tokens accepted since the last judgement, steps left paused."""

    verified: int = 0
    accepted: int = 0
    paused: int = 0


@dataclass
class Speculator:
    """Plans which rows of a decode step draft (:meth:`plan`) and verifies each in one launch (:meth:`verify`)."""

    config: SpeculativeConfig
    metrics: Any = None
    draft: Any = None  # draft_model.DraftModel: drafts from a second graph instead of prompt lookup
    _tracks: dict[int, tuple[Any, _Track]] = field(default_factory=dict)  # id(gen) -> (gen, its track)

    def plan(self, active: Sequence[Any]) -> dict[int, tuple[Any, list[int]]]:
        """``{id(gen): (gen, drafted tokens)}`` for the rows of this decode step that draft."""
        decoding = [g for g in active if not g.prefilling and g.finish_reason is None]
        live = {id(g) for g in decoding}
        for key in [k for k in self._tracks if k not in live]:  # sequences gone: their tracks too
            del self._tracks[key]
        if self.draft is not None:  # and their slots of the draft's cache
            self.draft.forget(active)
        if not decoding or len(decoding) > self.config.max_sequences:
            return {}
        c = self.config
        out: dict[int, tuple[Any, list[int]]] = {}
        for gen in decoding:
            track = self._track(gen)
            if track.paused:
                track.paused -= 1
                continue
            if gen.matcher is not None:  # a grammar's mask per drafted token: not done
                continue
            k = min(c.num_speculative_tokens, gen.params.max_tokens - len(gen.generated) - 1)
            if k < 1:
                drafts = []
            elif self.draft is not None:
                drafts = self.draft.propose(gen, k)
            else:
                drafts = propose(gen.context(), k, c.prompt_lookup_max, c.prompt_lookup_min)
            if drafts:
                out[id(gen)] = (gen, drafts)
        return out

    def verify(self, gen: Any, drafts: list[int], model: Any, views: dict[str, Any],
               accept: Callable[[Any, np.ndarray], None], adapters: dict[str, list[int]]) -> int:
        """Run ``gen``'s last token and ``drafts`` in one launch on its slot and hand the positions' logits to
        ``accept`` (the scheduler's per-token acceptance) while the drafts agree; returns the drafts accepted."""
        past = gen.cached
        logits = model.continued_logits([gen.context()[past]] + list(drafts), past, views, **adapters)
        agreed = 0
        for i, row in enumerate(logits):
            gen.cached += 1  # the token at this position is now in the slot: its keys and values are the model's
            accept(gen, row)
            if gen.finish_reason is not None or i == len(drafts) or gen.generated[-1] != drafts[i]:
                break
            agreed += 1
        self._judge(gen, len(drafts), agreed)
        return agreed

    def _judge(self, gen: Any, drafted: int, accepted: int) -> None:
        if self.metrics is not None:
            self.metrics.speculated(drafted, accepted)
        track = self._track(gen)
        track.verified += 1
        track.accepted += accepted
        if track.verified >= WINDOW:
            if track.accepted < self.config.min_accepted * track.verified:
                track.paused = PAUSE_STEPS
            track.verified = track.accepted = 0

    def _track(self, gen: Any) -> _Track:
        """``gen``'s track (a new one where its id was another sequence's: ids are reused once an object is gone)."""
        entry = self._tracks.get(id(gen))
        if entry is None or entry[0] is not gen:
            entry = self._tracks[id(gen)] = (gen, _Track())
        return entry[1]
