"""Drafting by a second graph: the next tokens proposed greedily by a cheaper precision of the same model.

With ``speculative = "draft"`` and ``speculative_draft`` a precision packaged in the same version folder (its graph
signed and verified with the served one, the same tokenizer and vocabulary: e.g. ``int4`` drafting for ``fp32``),
:class:`DraftModel` proposes a drafting sequence's next ``k`` tokens: the draft graph's greedy continuation of the
sequence's context, from the draft's own KV cache. :class:`~.speculative.Speculator` verifies them in one launch of
the served graph exactly as it verifies prompt lookup's drafts (``Speculator.verify``: the served model's sampler
chooses every token, so the output is plain decoding's, greedy and seeded sampling alike); what changes is where the
drafts come from and what they cost: one launch of the draft for the tokens its cache has not seen, then ``k - 1``
one-row decode launches.

The draft's cache. The draft holds one slot per drafting sequence (``speculative_max_sequences`` of them, host memory
in zero pages, a slot's pages given back when its sequence is gone), each with the token ids whose keys and values
it holds. Before drafting, the slot is brought to the sequence's context: the longest common prefix of what it holds
and the context is kept, the rest runs as one launch: a decode where one token is new (a draft was rejected: the
served model's own token), a continued prompt otherwise (all drafts accepted: the last draft and the served model's
token; a sequence new to the slot: its whole context, once). Keys and
values past the kept prefix are written over, never read (each launch's mask stops at the row's length), as in the
served graph's slots. Under chunked prefill (:attr:`DraftModel.chunk_tokens`, the scheduler's chunk), a catch-up of
more than the scheduler prefills whole (``whole_below``) runs ``chunk_tokens`` tokens a step and drafts nothing until
the last chunk: the sequence decodes plainly meanwhile, and no step holds the streams for a long prompt's whole
prefill on the draft graph any more than on the served one.

Where it pays: where the draft's launch is much cheaper than the served one's and agrees with it on most tokens
(a quantized draft of the same model: docs/generation.md, "Speculative decoding"). Its cost is judged like prompt
lookup's (``Speculator``'s back-off, by the clock: the proposals' launches with the verifications'), less
:attr:`DraftModel.catch_up_seconds`: the launch bringing a slot to a context more than two tokens ahead of it (a
sequence new to the draft, its whole prompt; one back from a pause) is the cost of starting to draft, paid once,
not of drafting on. Drafting runs only while at most ``speculative_max_sequences`` sequences decode.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .kv_slots import HostKVBuffers

__all__ = ["DraftModel", "load_draft"]


@dataclass
class _Held:
    """One slot of the draft's cache: the sequence drafting there, the token ids whose keys and values it holds, and
    when it last drafted (the least recently used slot goes to a sequence new to the cache)."""

    gen: Any = None
    tokens: list[int] = field(default_factory=list)
    used: int = 0


class DraftModel:
    """The draft graph (a ``causal_lm.CausalLM``) with its own KV slots; :meth:`propose` is the speculator's source of
    drafts (``Speculator(draft=...)``)."""

    def __init__(self, model: Any, spec: Any, slots: int, max_context: int) -> None:
        self.model = model
        self.spec = spec
        self.max_context = int(max_context)
        self.storage = HostKVBuffers(spec, max(1, int(slots)), self.max_context)
        self._held = [_Held() for _ in range(self.storage.slots)]
        # The last proposal's catch-up launch (more than two tokens new to its slot), in seconds; 0.0 when it had none.
        self.catch_up_seconds = 0.0
        # Chunked prefill's bounds (the scheduler's chunk_tokens and whole_below; 0: a catch-up runs whole).
        self.chunk_tokens = self.whole_below = 0
        self._clock = 0

    def propose(self, gen: Any, k: int) -> list[int]:
        """The draft's greedy continuation of ``gen``'s context, ``k`` tokens (fewer where the context would pass the
        draft's cache); empty for ``k`` < 1, and while a chunked catch-up is not done."""
        context = list(gen.context())
        k = min(int(k), self.max_context - len(context))
        if k < 1 or not context:
            return []
        slot = self._slot_for(gen)
        held = self._held[slot]
        views = self.storage.views(slot, 1)
        # Keep what the slot holds of the context (the last token is always run: its logits draft the first token).
        keep = _common_prefix(held.tokens, context, len(context) - 1)
        began = time.perf_counter()
        new = len(context) - keep
        if self.chunk_tokens and new > max(self.chunk_tokens, self.whole_below):  # a chunk of the catch-up this step
            self.model.prefill([context[keep:keep + self.chunk_tokens]], views, past=[keep] if keep else None)
            held.tokens = context[:keep + self.chunk_tokens]
            self.catch_up_seconds = time.perf_counter() - began
            return []
        if keep == len(context) - 1 and keep:  # one token new (a draft rejected): a decode launch, the cheaper one
            logits = self.model.decode([context[-1]], [keep], views)
        else:
            logits = self.model.prefill([context[keep:]], views, past=[keep] if keep else None)
        # Two tokens new is drafting's own step (every draft taken: the last one and the served model's token).
        self.catch_up_seconds = time.perf_counter() - began if new > 2 else 0.0
        drafts = [int(np.argmax(logits[0]))]
        for i in range(1, k):
            logits = self.model.decode([drafts[-1]], [len(context) + i - 1], views)
            drafts.append(int(np.argmax(logits[0])))
        held.tokens = context + drafts[:-1]  # the last draft was chosen, never run: its keys are not in the slot
        return drafts

    def _slot_for(self, gen: Any) -> int:
        self._clock += 1
        for i, held in enumerate(self._held):
            if held.gen is gen:
                held.used = self._clock
                return i
        # A slot whose sequence ended, else the least recently used.
        free = [i for i, h in enumerate(self._held) if h.gen is None or h.gen.finish_reason is not None]
        i = free[0] if free else min(range(len(self._held)), key=lambda j: self._held[j].used)
        if self._held[i].tokens:
            self.storage.give_back(i)
        self._held[i] = _Held(gen, [], self._clock)
        return i

    def forget(self, live: Sequence[Any]) -> None:
        """Let go of the slots of sequences no longer in ``live`` (their pages given back)."""
        ids = {id(g) for g in live}
        for i, held in enumerate(self._held):
            if held.gen is not None and id(held.gen) not in ids:
                if held.tokens:
                    self.storage.give_back(i)
                self._held[i] = _Held()

    def close(self) -> None:
        self.storage.close()
        self.model.close()


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """The length of the longest common prefix of ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b), limit)
    if n <= 0:
        return 0
    x, y = np.asarray(a[:n], dtype=np.int64), np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


def load_draft(version_dir: Path, digests: Any, s: Any, spec_file: str, threads: int, max_context: int,
               gpu: int | None) -> DraftModel | None:
    """With ``speculative = "draft"`` (``s``: the model's ``settings.Settings``): the ``speculative_draft`` precision's graph of this version folder (its bytes
    checked against the verified digests as the served graph's are) with its own KV slots; else None."""
    if s.speculative != "draft":
        return None
    from ..settings import SettingsError

    if gpu is not None:
        raise SettingsError("speculative = \"draft\" drafts on a CPU instance only here: use prompt_lookup or off "
                            "on a GPU instance")
    from ..contract import GenerationSpec, onnx_file
    from ..engines.loading import load_verified_onnx
    from ..integrity import read_checked
    from .causal_lm import CausalLM, attention_kernel

    name = onnx_file(s.speculative_draft)
    if not (version_dir / name).is_file():
        raise SettingsError(f"speculative_draft = {s.speculative_draft}, and {version_dir.name}/{name} is not in the "
                            "version folder: package the model with that precision built")
    spec = GenerationSpec.from_json(read_checked(version_dir.parent, spec_file, digests).decode()).for_precision(
        s.speculative_draft)
    # Its threads never spin: between its launches the served graph's launches run on the same cores, and a second
    # session's spinning threads took them from it (Gemma 3 270M, int4 drafting for fp32: 1.01x spinning, 1.08x not).
    model = load_verified_onnx(version_dir, name, digests,
                               lambda src: CausalLM(src, threads=threads, spinning=False,
                                                    pad_token_id=spec.pad_token_id or 0,
                                                    int8_attention=attention_kernel(s.int8_attention, spec.kv_dtype),
                                                    int8_matmul=s.int8_matmul))
    return DraftModel(model, spec, s.speculative_max_sequences, max_context)

