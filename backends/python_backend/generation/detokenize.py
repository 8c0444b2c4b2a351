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
