"""The llguidance engine (``pip install llguidance``, in the ``serve`` extra): Microsoft's Rust grammar engine, a
wheel with no Python dependency, numpy bitmasks, the GIL released while it computes a mask.

The tokenizer is the version's ``tokenizer.json`` (llguidance reads it with the same Rust ``tokenizers`` library
the backend uses), the masks as wide as the model's logits (``n_vocab``: ids past the tokenizer's own tokens are
never allowed), the model's eos ids its end. Compiling a grammar builds one matcher at its start (what the engine
cannot compile leaves it in error, with llguidance's message naming the construct, e.g. a schema keyword it does
not implement: refused before anything runs); each sequence's matcher is a ``deep_copy`` of it (microseconds,
where building one again costs the compile: about 0.5 ms for bench_structured's schema).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from ..sampling import SamplingError
from .grammar import GrammarError, GuidedSpec, closed_objects

_JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: a model cannot pad between tokens without end


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise SamplingError("structured outputs need the llguidance package on the server: "
                            "pip install 'model-factory[serve]'") from None
    return llguidance


class LLGuidanceMatcher:
    """One sequence's llguidance matcher (see :class:`~.grammar.Matcher`)."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size

    def fill_mask(self, row: np.ndarray) -> None:
        if self._m.is_error():  # a broken matcher allows nothing: the scheduler ends the sequence
            row[:] = 0
            return
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.size * row.itemsize)

    def accept(self, token: int) -> bool:
        return bool(self._m.consume_token(int(token)))

    def finished(self) -> bool:
        return bool(self._m.is_stopped())

    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""


class LLGuidanceEngine:
    """Compiles :class:`~.grammar.GuidedSpec` grammars against one tokenizer."""

    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        llg = self._llg = _llguidance()
        self.vocab_size = int(vocab_size)
        eos = [int(e) for e in eos_token_ids] or None
        self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=self.vocab_size, eos_token=eos)

    def grammar_text(self, spec: GuidedSpec) -> str:
        """llguidance's grammar definition for ``spec`` (not yet checked)."""
        llg, M = self._llg, self._llg.LLMatcher
        try:
            if spec.kind == "json":
                schema = json.dumps(closed_objects(json.loads(spec.source)))
                return M.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
            if spec.kind == "json_object":
                return M.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
            if spec.kind == "regex":
                return M.grammar_from_regex(spec.source)
            if spec.kind == "choice":
                return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(spec.source)))
            return llg.grammar_from("grammar", spec.source)  # Lark, or GBNF converted to Lark
        except ValueError as exc:
            raise GrammarError(f"guided.{spec.kind} cannot be compiled: {exc}") from None

    def compile(self, spec: GuidedSpec) -> "LLGuidanceGrammar":
        start = self._llg.LLMatcher(self.tokenizer, self.grammar_text(spec), log_level=0)
        if start.is_error():
            raise GrammarError(f"guided.{spec.kind} cannot be compiled by llguidance: {start.get_error()}")
        return LLGuidanceGrammar(start, self.vocab_size)


class LLGuidanceGrammar:
    """A compiled grammar: its matcher at the start, copied for each sequence by :meth:`matcher`."""

    def __init__(self, start: Any, vocab_size: int) -> None:
        self._start, self.vocab_size = start, vocab_size

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._start.deep_copy(), self.vocab_size)
