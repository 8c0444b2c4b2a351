"""Text of a sequence as it grows, token by token: incremental detokenization and stop strings.

:class:`IncrementalDetokenizer` returns, for each new token, the text it adds. A byte-level BPE token may
hold part of a UTF-8 character (an emoji split over two tokens): the decoded tail is then U+FFFD, and
nothing is emitted until the character is whole (the approach of vLLM and TGI: decode a short window,
``ids[prefix:read]`` and ``ids[prefix:]``, and emit the difference). A few prompt tokens are kept as
context, so decoders that treat a sequence's first token specially (a leading space) see the same
text as when the whole sequence is decoded.

:class:`StopMatcher` holds back text that may be the start of a stop string, and cuts the output where
one appears (the stop string itself is not output, as in the OpenAI API).
"""

from __future__ import annotations

from typing import Any, Sequence

REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Text deltas of one sequence's generated tokens (``tokenizer``: a ``tokenizers.Tokenizer``)."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        context = [int(t) for t in prompt_ids[-_CONTEXT_TOKENS:]]
        self._ids = list(context)
        self._prefix = 0
        self._read = len(context)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True) if ids else ""

    def add(self, token: int) -> str:
        """The text ``token`` completes ("" while a character is still split across tokens)."""
        self._ids.append(int(token))
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        full = self._decode(self._ids[self._prefix:])
        if len(full) > len(prefix_text) and not full.endswith(REPLACEMENT):
            self._prefix, self._read = self._read, len(self._ids)
            return full[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """What is left undecoded at the end (an incomplete character comes out as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        full = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return full[len(prefix_text):] if len(full) > len(prefix_text) else ""


class StopMatcher:
    """Cuts the text at the first stop string; holds back a tail that may begin one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._pending = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """The text safe to output now, given the next ``delta``; sets :attr:`stopped` at a stop string."""
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        text = self._pending + delta
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._pending = True, ""
            return text[:cut]
        hold = 0
        for stop in self.stops:  # the longest tail of text that is a proper prefix of a stop string
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        self._pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold]

    def flush(self) -> str:
        """The held-back tail, at the end of a sequence that did not stop on a string."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out


class TokenTexts:
    """Each token's own text and bytes, for log-probabilities (OpenAI's ``token`` and ``bytes``): the token
    decoded alone; a byte-level piece that holds part of a UTF-8 character gives its raw bytes (GPT-2's byte
    alphabet, or SentencePiece's ``<0xNN>`` fallback) and the text ``bytes:\\xNN...``, as OpenAI writes them.
    Cached per id (the vocabulary at most)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._unbyte = {c: b for b, c in _byte_alphabet().items()}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        got = self._cache.get(token)
        if got is None:
            got = self._cache[token] = self._text(int(token))
        return got

    def _text(self, token: int) -> tuple[str, list[int]]:
        if self._tok is None:
            return f"<{token}>", []
        text = self._tok.decode([token], skip_special_tokens=False)
        if REPLACEMENT not in text:
            return text, list(text.encode("utf-8"))
        piece = self._tok.id_to_token(token) or ""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            raw = bytes([int(piece[3:5], 16)])
        elif piece and all(c in self._unbyte for c in piece):
            raw = bytes(self._unbyte[c] for c in piece)
        else:
            raw = text.encode("utf-8")
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: each byte as the printable character its pieces spell it with."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars)}
