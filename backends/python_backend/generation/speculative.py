"""Speculative decoding by prompt lookup: the next tokens drafted from the sequence's own context, verified in one launch.

Extractive answers (a document's sentences quoted, code edited in place, a form filled from the prompt) repeat spans of
their context. Prompt lookup (vLLM's ``ngram`` method, ``prompt_lookup_max`` / ``_min``) drafts them for free: the
earlier place in the sequence's context (the prompt and what it generated) whose tokens before it match the
sequence's last tokens longest (``n`` of them, from ``prompt_lookup_min`` up to ``prompt_lookup_max``; the latest such
place wins) is where it drafts from: the ``n + 1`` tokens that followed it there, ``num_speculative_tokens`` at most
(:func:`propose`; near the context's end the repetition is continued with its period). A longer match is likelier to
go on, and a short one costs little when it does not: a draft's length follows its match (measured on Gemma 3 270M,
docs/generation.md: more tokens from fewer launches than drafting ``num_speculative_tokens`` after every match). No
draft model, nothing learned.

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
(``speculative_max_sequences``, default 1: measured, docs/generation.md), and per sequence it backs off where it does
not pay, judged by time: every :data:`WINDOW` verifications the seconds they took (their launches, and their drafts'
proposals less a draft graph's catch-up, ``DraftModel.catch_up_seconds``) are set against what plain decoding would
have taken for the tokens they gave (a sequence gets one token a decode launch: the launch's time each, of as many
rows as there are decoding sequences; :meth:`Speculator.observe_decode`, the scheduler's launches timed); where they
took longer the sequence stops drafting for :data:`PAUSE_STEPS` steps, then tries again (an answer can turn from free
text to a quotation). Until a decode launch of that many rows has been timed nothing drafts: the first step with
as many sequences decoding is a plain one. Judged in seconds, not accepted tokens: what a rejected draft costs
depends on its length, the model and the machine (a verification of one token costs a decode launch; on Gemma 3 270M
FP32 each more token about 6 % of one), so no fixed acceptance bound fits them all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..contract import SPECULATIVE_TOKENS
from .itl_budget import observe_launch

PROMPT_LOOKUP = "prompt_lookup"  # contract.SPECULATIVE's method
WINDOW = 8  # verifications over which a sequence's drafting is judged
PAUSE_STEPS = 8  # steps a sequence drafts nothing after its verifications took longer than plain decoding
DECODE_SMOOTHING = 0.2  # weight of the newest decode launch in the time verifications are judged against

__all__ = ["PAUSE_STEPS", "PROMPT_LOOKUP", "WINDOW", "SpeculativeConfig", "Speculator", "propose"]


def propose(context: Sequence[int], k: int, n_max: int, n_min: int) -> list[int]:
    """The tokens that followed the earlier place in ``context`` whose preceding tokens match ``context``'s last ones
    longest (``n`` of them, ``n_min`` <= ``n`` <= ``n_max``; the latest place among the longest): ``n + 1`` of them,
    ``k`` at most; empty where not even ``n_min`` tokens match. Where fewer follow it before the context's end, the
    repetition continues with the same period (a loop of one token, ``a a a``, drafts ``k`` of them, not the one
    token left before the end)."""
    size = len(context)
    if k < 1 or size < n_min + 1:
        return []
    arr = np.asarray(context, dtype=np.int64)
    # ends: the places (exclusive ends of earlier spans) whose last token is the context's last: a match of 1.
    ends = np.flatnonzero(arr[:-1] == arr[-1]) + 1
    n = 1
    while ends.size and n < n_max:  # lengthen the match a token at a time while some place still matches
        longer = ends[ends > n]
        longer = longer[arr[longer - n - 1] == arr[size - n - 1]]
        if not longer.size:
            break
        ends, n = longer, n + 1
    if not ends.size or n < n_min:
        return []
    start = int(ends[-1])
    period = size - start  # the match repeats the text `period` tokens back: continue that repetition
    follow = arr[start:].tolist()
    return [follow[j % period] for j in range(min(k, n + 1))]


@dataclass(frozen=True)
class SpeculativeConfig:
    """The serving settings (contract: ``speculative``, ``num_speculative_tokens``, ``prompt_lookup_max`` / ``_min``,
    ``speculative_max_sequences``)."""

    num_speculative_tokens: int = SPECULATIVE_TOKENS[PROMPT_LOOKUP]  # at most (prompt lookup: its match's length + 1)
    prompt_lookup_max: int = 8
    prompt_lookup_min: int = 1
    max_sequences: int = 1  # drafting only while at most this many sequences decode


@dataclass
class _Track:
    """One sequence's recent drafts since the last judgement: verifications, the tokens they gave and the seconds they
    took (proposals included); steps left paused."""

    verified: int = 0
    tokens: int = 0
    seconds: float = 0.0
    paused: int = 0


@dataclass
class Speculator:
    """Plans which rows of a decode step draft (:meth:`plan`) and verifies each in one launch (:meth:`verify`)."""

    config: SpeculativeConfig
    metrics: Any = None
    draft: Any = None  # draft_model.DraftModel: drafts from a second graph instead of prompt lookup
    clock: Callable[[], float] = time.perf_counter
    decode_seconds: dict[int, float] = field(default_factory=dict)  # rows -> a decode launch of them, smoothed
    _tracks: dict[int, tuple[Any, _Track]] = field(default_factory=dict)  # id(gen) -> (gen, its track)
    _rows: int = 1  # the sequences decoding when the last plan was made (whose launch the verifications replace)

    def plan(self, active: Sequence[Any]) -> dict[int, tuple[Any, list[int]]]:
        """``{id(gen): (gen, drafted tokens)}`` for the rows of this decode step that draft."""
        decoding = [g for g in active if not g.prefilling and g.finish_reason is None]
        live = {id(g) for g in decoding}
        for key in [k for k in self._tracks if k not in live]:  # sequences gone: their tracks too
            del self._tracks[key]
        if self.draft is not None:  # and their slots of the draft's cache
            self.draft.forget(active)
        if not decoding or len(decoding) > self.config.max_sequences or len(decoding) not in self.decode_seconds:
            return {}  # (a launch of as many rows not timed yet: this step's is)
        self._rows = len(decoding)
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
                continue
            began = self.clock()
            if self.draft is not None:
                drafts = self.draft.propose(gen, k)
                began += self.draft.catch_up_seconds  # starting to draft (its whole prompt once): not judged
            else:
                drafts = propose(gen.context(), k, c.prompt_lookup_max, c.prompt_lookup_min)
            track.seconds += max(0.0, self.clock() - began)
            if drafts:
                out[id(gen)] = (gen, drafts)
        return out

    def verify(self, gen: Any, drafts: list[int], model: Any, views: dict[str, Any],
               accept: Callable[[Any, np.ndarray], None], adapters: dict[str, list[int]]) -> int:
        """Run ``gen``'s last token and ``drafts`` in one launch on its slot and hand the positions' logits to
        ``accept`` (the scheduler's per-token acceptance) while the drafts agree; returns the drafts accepted."""
        past = gen.cached
        began = self.clock()
        logits = model.continued_logits([gen.context()[past]] + list(drafts), past, views, **adapters)
        # The launch alone is judged, as the decode launch it is set against: taking each token (sampling, stop
        # strings, sending it) costs the same either way.
        seconds = self.clock() - began
        agreed = 0
        for i, row in enumerate(logits):
            gen.cached += 1  # the token at this position is now in the slot: its keys and values are the model's
            accept(gen, row)
            if gen.finish_reason is not None or i == len(drafts) or gen.generated[-1] != drafts[i]:
                break
            agreed += 1
        self._judge(gen, len(drafts), agreed, seconds)
        return agreed

    def observe_decode(self, rows: int, seconds: float) -> None:
        """A decode launch of ``rows`` rows took ``seconds`` (the scheduler's, timed; one token for each row): what
        the verifications of as many decoding sequences are judged against."""
        observe_launch(self.decode_seconds, int(rows), float(seconds), DECODE_SMOOTHING)

    def _judge(self, gen: Any, drafted: int, accepted: int, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.speculated(drafted, accepted)
        track = self._track(gen)
        track.verified += 1
        track.tokens += accepted + 1  # the agreeing drafts and the model's own token (at most: a stop ends it early)
        track.seconds += seconds
        if track.verified >= WINDOW:
            if track.seconds > track.tokens * self.decode_seconds.get(self._rows, 0.0):  # plain decoding was faster
                track.paused = PAUSE_STEPS
            track.verified = track.tokens = 0
            track.seconds = 0.0

    def _track(self, gen: Any) -> _Track:
        """``gen``'s track (a new one where its id was another sequence's: ids are reused once an object is gone)."""
        entry = self._tracks.get(id(gen))
        if entry is None or entry[0] is not gen:
            entry = self._tracks[id(gen)] = (gen, _Track())
        return entry[1]
