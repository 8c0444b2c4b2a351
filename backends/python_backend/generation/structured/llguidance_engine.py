"""The llguidance engine (``pip install llguidance``, in the ``serve`` extra): Microsoft's Rust grammar engine, a
wheel with no Python dependency, numpy bitmasks, the GIL released while it computes a mask.

The tokenizer is the version's ``tokenizer.json`` (llguidance reads it with the same Rust ``tokenizers`` library
the backend uses), the masks as wide as the model's logits (``n_vocab``: ids past the tokenizer's own tokens are
never allowed), the model's eos ids its end. A grammar is checked when it is compiled (``validate_grammar``), so
what the engine cannot compile is refused with llguidance's message, which names the construct (e.g. a schema
keyword it does not implement), before anything runs.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from ..sampling import SamplingError
from .grammar import GrammarError, GuidedSpec

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
                return M.grammar_from_json_schema(spec.source, defaults=_JSON_OPTIONS)
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
        text = self.grammar_text(spec)
        is_error, messages = self._llg.LLMatcher.validate_grammar_with_warnings(text, self.tokenizer)
        if is_error:
            raise GrammarError(f"guided.{spec.kind} cannot be compiled by llguidance: {'; '.join(messages)}")
        return LLGuidanceGrammar(self, text)


class LLGuidanceGrammar:
    """A checked grammar: each :meth:`matcher` starts a sequence at its beginning."""

    def __init__(self, engine: LLGuidanceEngine, text: str) -> None:
        self.engine, self.text = engine, text

    def matcher(self) -> LLGuidanceMatcher:
        m = self.engine._llg.LLMatcher(self.engine.tokenizer, self.text, log_level=0)
        if m.is_error():
            raise GrammarError(f"the grammar cannot be started: {m.get_error()}")
        return LLGuidanceMatcher(m, self.engine.vocab_size)
