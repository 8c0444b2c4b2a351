"""The structured-output interface: what a request asks (:class:`GuidedSpec`), the engine's compiled grammars
cached per tokenizer (:class:`Grammars`), a matcher per sequence, and the masks of one step (:class:`StepMasks`).

A request asks for a grammar in ``sampling_parameters`` (the generate, gRPC and OpenAI paths alike)::

    "guided": {"json": {...schema...}}       a JSON Schema (an object, or its JSON text)
    "guided": {"json_object": true}          any JSON object
    "guided": {"regex": "[0-9]{3}-[a-z]+"}   the whole output matches the regex
    "guided": {"choice": ["yes", "no"]}      exactly one of the strings
    "guided": {"grammar": "start: ..."}      a Lark grammar (llguidance's dialect; GBNF is converted)

or under vLLM's Triton backend's names, ``guided_decoding`` / ``structured_outputs`` (the same object, or its JSON
text, with vLLM's ``backend`` taken and not used): :func:`guided_parameters`.

:func:`parse_guided` checks the object (a :class:`~..sampling.SamplingError` naming the bad part) and makes its
canonical source (a schema's JSON with sorted keys), the key the compiled grammars are cached by. JSON is generated
compact (no whitespace between tokens): flexible whitespace lets a model pad without end.

The engine contract (one module per engine): ``compile(spec)`` returns an object whose ``matcher()`` makes a fresh
:class:`Matcher`, or raises :class:`GrammarError` naming what the engine cannot compile; ``vocab_size`` is the
logits' width, which the masks cover whole (ids past the tokenizer's own tokens are never allowed).
"""

from __future__ import annotations

import collections
import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Protocol

import numpy as np

from ..sampling import SamplingError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SOURCE = 1 << 20  # a grammar's text, at most 1 MiB
MAX_CHOICES = 1024
CACHE_SIZE = 256  # compiled grammars kept per model instance
# The sampling_parameters names that carry a grammar: ours, then vLLM's Triton backend's (older and newer).
GUIDED_NAMES = ("guided", "guided_decoding", "structured_outputs")


class GrammarError(SamplingError):
    """A grammar the engine cannot compile (the message names the construct): INVALID_ARG, a 400."""


@dataclass(frozen=True)
class GuidedSpec:
    """One request's grammar: its ``kind`` (one of :data:`KINDS`) and canonical ``source`` (JSON text for ``json``
    and ``choice``, the text itself for ``regex`` and ``grammar``, empty for ``json_object``)."""

    kind: str
    source: str

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.source}"

    def as_json(self) -> dict[str, Any]:
        """The ``sampling_parameters`` ``guided`` object that asks for this grammar again."""
        if self.kind == "json_object":
            return {"json_object": True}
        if self.kind in ("json", "choice"):
            return {self.kind: json.loads(self.source)}
        return {self.kind: self.source}


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalItems", "not", "contains", "propertyNames", "then", "else", "if")


def closed_objects(schema: Any, _inside_all_of: bool = False) -> Any:
    """``schema`` with every object schema that does not say ``additionalProperties`` closed (``false``), as the
    output is generated: JSON Schema leaves such an object open, and a model under an open object may write keys
    without end (Gemma 3 270M, given a pydantic model's schema, added ``population_per_household_income_per...``
    until ``max_tokens``). Each answer stays valid against the schema as sent; only keys it does not name are not
    generated. ``additionalProperties: true`` (or a schema), ``patternProperties`` and ``unevaluatedProperties`` keep an
    object open; the branches of an ``allOf`` are left as they are (closing each would refuse the others' keys)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {k: closed_objects(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(v) for v in out[key]]
    for key in _SUBSCHEMA_ONE:
        if key in out:
            out[key] = closed_objects(out[key])
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_objects(v, _inside_all_of=True) for v in out["allOf"]]
    if isinstance(out.get("additionalProperties"), Mapping):
        out["additionalProperties"] = closed_objects(out["additionalProperties"])
    is_object = out.get("type") == "object" or "properties" in out
    if (is_object and not _inside_all_of and "allOf" not in out
            and not any(k in out for k in ("additionalProperties", "patternProperties", "unevaluatedProperties"))):
        out["additionalProperties"] = False
    return out


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def guided_parameters(given: Mapping[str, Any]) -> GuidedSpec | None:
    """The grammar a ``sampling_parameters`` object asks for, under any of the names its clients send: ours,
    ``guided``; vLLM's Triton backend's, ``guided_decoding`` (an object or its JSON text; its ``backend`` taken and
    not used: llguidance serves every request) and ``structured_outputs`` (the same, vLLM's newer name). One of
    them a request; the object inside is :func:`parse_guided`'s, its errors named under the name sent."""
    sent = [name for name in GUIDED_NAMES if given.get(name) is not None]
    if len(sent) > 1:
        raise SamplingError(f"sampling_parameters names {' and '.join(sent)}: give one grammar")
    if not sent:
        return None
    name, value = sent[0], given[sent[0]]
    if name == "guided":
        return parse_guided(value)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise SamplingError(f"{name} is not JSON: {exc}") from None
    if not isinstance(value, Mapping):
        raise SamplingError(f"{name} must be an object with one of " + ", ".join(KINDS))
    value = {k: v for k, v in value.items() if k != "backend" and v not in (None, False)}
    try:
        return parse_guided(value)
    except SamplingError as exc:
        raise SamplingError(str(exc).replace("guided", name, 1)) from None


def parse_guided(value: Any) -> GuidedSpec | None:
    """``sampling_parameters``' ``guided`` object, checked, as a :class:`GuidedSpec` (None: not asked)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise SamplingError("guided must be an object with one of " + ", ".join(KINDS))
    asked = [k for k in value if value[k] is not None]
    unknown = sorted(set(asked) - set(KINDS))
    if unknown:
        raise SamplingError(f"guided has unknown names {unknown}: use one of {', '.join(KINDS)}")
    if len(asked) != 1:
        raise SamplingError(f"guided must name exactly one of {', '.join(KINDS)}, got {sorted(asked) or 'none'}")
    kind = asked[0]
    raw = value[kind]
    if kind == "json":
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except ValueError as exc:
                raise SamplingError(f"guided.json is not JSON: {exc}") from None
        if not isinstance(raw, (Mapping, bool)):
            raise SamplingError("guided.json must be a JSON Schema (an object)")
        source = _canonical(raw)
    elif kind == "json_object":
        if raw is not True:
            raise SamplingError("guided.json_object must be true")
        source = ""
    elif kind == "choice":
        if not isinstance(raw, list) or not raw or not all(isinstance(c, str) and c for c in raw):
            raise SamplingError("guided.choice must be a non-empty list of non-empty strings")
        if len(raw) > MAX_CHOICES:
            raise SamplingError(f"guided.choice holds {len(raw)} strings: at most {MAX_CHOICES}")
        source = _canonical(list(raw))
    else:
        if not isinstance(raw, str) or not raw.strip():
            raise SamplingError(f"guided.{kind} must be a non-empty string")
        source = raw
    if len(source) > MAX_SOURCE:
        raise SamplingError(f"guided.{kind} is {len(source)} characters long: at most {MAX_SOURCE}")
    return GuidedSpec(kind, source)


class Matcher(Protocol):
    """One sequence's place in its grammar."""

    vocab_size: int  # the logits' width its masks cover

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into ``row`` (int32, one bit a token, ``ceil(vocab / 32)`` words)."""

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False if the grammar does not allow it (the matcher is then in error)."""

    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (its end: only eos was allowed, or it was taken)."""

    def error(self) -> str:
        """Why the matcher is in error ("" when it is not)."""


def mask_words(vocab_size: int) -> int:
    return (int(vocab_size) + 31) // 32


def allowed_tokens(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """A bitmask row as one boolean a token (``vocab_size`` of them)."""
    bits = np.unpackbits(np.ascontiguousarray(row, dtype="<i4").view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)


class Grammars:
    """The compiled grammars of one engine and tokenizer, cached by their canonical source (LRU, thread-safe:
    ``execute()`` compiles; the engine loop only makes matchers' masks)."""

    def __init__(self, engine: Any, size: int = CACHE_SIZE) -> None:
        self.engine = engine
        self.vocab_size = int(engine.vocab_size)
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._size = int(size)
        self._lock = threading.Lock()
        self.compiled = 0  # compilations done (the cache's misses)

    def compile(self, spec: GuidedSpec) -> Any:
        """The compiled grammar of ``spec`` (compiled once; a :class:`GrammarError` naming what fails)."""
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                return hit
        compiled = self.engine.compile(spec)  # outside the lock: another request's hit does not wait for it
        with self._lock:
            self.compiled += 1
            self._cache[spec.key] = compiled
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return compiled


# A step's masks go to the worker thread from this many mask entries (rows x vocabulary) on: below it they are made
# in place. Handing them over cost about 3.5 ms a step (the queue's wake-up and the GIL's hand-back, cProfile of
# bench_structured at 1 stream, 6k vocabulary, 2 shared cores) where one mask took 0.02 ms: 16 rows of a 262k
# vocabulary (0.2 ms each, mean) are where overlapping them with the launch pays.
WORKER_FROM = 1 << 22


class StepMasks:
    """The masks of one step's guided rows, computed on a worker thread while the batched step runs (the engines
    release the GIL while they compute) when there is enough of them to pay the hand-over (``WORKER_FROM``), else
    made in place as each row is sampled."""

    def __init__(self, worker_from: int = WORKER_FROM) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[int, Future] = {}
        self.worker_from = int(worker_from)

    def start(self, gens: Iterable[Any]) -> None:
        """Begin the masks of ``gens`` that have a matcher (``gen.matcher``), before their logits are computed."""
        rows = [g for g in gens if getattr(g, "matcher", None) is not None and g.finish_reason is None]
        if not rows or len(rows) * rows[0].matcher.vocab_size < self.worker_from:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="mf-grammar")
        for gen in rows:
            self._pending[id(gen)] = self._pool.submit(_mask_of, gen.matcher)

    def allowed(self, gen: Any) -> np.ndarray | None:
        """``gen``'s allowed tokens for the logits just computed (None without a grammar)."""
        if getattr(gen, "matcher", None) is None:
            return None
        pending = self._pending.pop(id(gen), None)
        return pending.result() if pending is not None else _mask_of(gen.matcher)

    def clear(self) -> None:
        for pending in self._pending.values():
            pending.cancel()
        self._pending.clear()


def _mask_of(matcher: Matcher) -> np.ndarray:
    row = np.zeros(mask_words(matcher.vocab_size), dtype=np.int32)
    matcher.fill_mask(row)
    return allowed_tokens(row, matcher.vocab_size)


class LazyGrammars:
    """The model's :class:`Grammars`, made at the first request that asks for one (building the engine's view of
    a 262k vocabulary takes seconds: no model pays it at load unless a grammar is asked); thread-safe."""

    def __init__(self, make_engine: Callable[[], Any]) -> None:
        self._make = make_engine
        self._grammars: Grammars | None = None
        self._lock = threading.Lock()

    def get(self) -> Grammars:
        with self._lock:
            if self._grammars is None:
                self._grammars = Grammars(self._make())
            return self._grammars
