"""Which grammar engine serves structured outputs: one module per engine behind ``grammar``'s interface."""

from __future__ import annotations

from typing import Any, Sequence

from ..sampling import SamplingError

ENGINES = ("llguidance",)


def load_engine(tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                name: str = "llguidance") -> Any:
    """The grammar engine ``name`` for this tokenizer (its JSON text) and logits width; a
    :class:`~..sampling.SamplingError` naming the extra to install when the engine's package is missing."""
    if name not in ENGINES:
        raise SamplingError(f"unknown grammar engine {name!r}: use one of {', '.join(ENGINES)}")
    from .llguidance_engine import LLGuidanceEngine

    return LLGuidanceEngine(tokenizer_json, vocab_size, eos_token_ids)
