"""What one ``execute()`` decided, as events (``events.EventLog``): the window's requests, refusals, long texts,
the grouping and its splits. Kept apart from ``model.py`` so the entry point only says when; this says what.

Each request of the window is a :class:`Seen`: its id (client, header or generated) and a way to hash its
inputs, called only for an event that is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from .events import EventLog, input_hash

MAX_IDS = 64  # request ids listed in one window event (the count is always given)


@dataclass
class Seen:
    """One request of the window, as events name it."""

    id: str
    id_source: str  # client | header | generated
    inputs: Callable[[], Sequence[Any]]  # the raw inputs, for the hash only

    def hash(self) -> str:
        try:
            return input_hash(self.inputs())
        except Exception:  # noqa: BLE001 - a hash that fails names itself, never fails the request
            return "unhashable"


def refused(events: EventLog, seen: Seen, reason: str) -> None:
    events.emit("input_refused", lambda: {"request_id": seen.id, "id_source": seen.id_source, "reason": reason,
                                          "input_hash": seen.hash()})


def failed(events: EventLog, seen: Seen, error: BaseException) -> None:
    events.emit("request_failed", lambda: {"request_id": seen.id, "id_source": seen.id_source,
                                           "error": f"{type(error).__name__}: {error}", "input_hash": seen.hash()})


def long_input(events: EventLog, seen: Seen, enc: Any, limit: int) -> None:
    """A text over the limit that was truncated or chunked (refusals are :func:`refused`)."""
    action = "chunked" if enc.chunked_rows else "truncated"
    events.emit("long_input", lambda: {
        "request_id": seen.id, "action": action, "limit": limit,
        "rows": [r for r, (n, d, s) in enumerate(zip(enc.lengths, enc.dropped, enc.spans)) if d or s > 1],
        "lengths": list(enc.lengths), "dropped_tokens": list(enc.dropped), "windows": list(enc.spans),
        "input_hash": seen.hash()})


def window(events: EventLog, seen: Sequence[Seen], stats: Any, seconds: float, mode: str) -> None:
    """The window's grouping, when there was one to make (two sequences or more), and its splits."""
    ids = [s.id for s in seen]
    listed = {"request_ids": ids[:MAX_IDS], "requests": len(ids)}
    if stats.sequences > 1:
        events.emit("window_grouped", lambda: {
            **listed, "mode": mode, "sequences": stats.sequences, "groups": list(stats.groups),
            "real_tokens": stats.real_tokens, "computed_tokens": stats.computed_tokens,
            "padding_ratio": round(stats.padding_ratio, 4), "execute_seconds": round(seconds, 6),
            "explored": bool(stats.explorations)})
    if stats.memory_splits:
        events.emit("split_for_memory", {**listed, "splits": stats.memory_splits})
    if stats.retries:
        events.emit("group_retried", {**listed, "retries": stats.retries,
                                      "why": "a group failed (out of memory included): split in halves and run again"})


def engine_choices(events: EventLog, engine_info: Mapping[str, Any]) -> None:
    """At load: each engine skipped on the way (with its reason) and a GPU instance serving on the CPU."""
    for key, why in engine_info.items():
        if key.startswith("fallback_from_"):
            events.emit("engine_fallback", {"skipped": key[len("fallback_from_"):], "why": str(why),
                                            "serving": engine_info.get("flavour")})
    if "cpu_fallback" in engine_info:
        events.emit("engine_fallback", {"skipped": "gpu", "why": str(engine_info["cpu_fallback"]),
                                        "serving": "onnxruntime-cpu"})


def degrade_ready(events: EventLog, policy: Any, gate: Any, info: Mapping[str, Any]) -> None:
    """At load: the instance degrades to ``policy.precision`` (degrade.py), with the gate result that allows it."""
    events.emit("degrade_ready", {"precision": policy.precision, "backlog": policy.backlog, "file": info.get("file"),
                                  "gate_metric": gate.metric, "gate_score": gate.score,
                                  "min_accuracy": gate.min_accuracy})


def degraded(events: EventLog, seen: Sequence[Seen], precision: str, backlog: int, gate: Any) -> None:
    """A window answered by the degrade precision instead of the served one (its backlog reached ``backlog``)."""
    ids = [s.id for s in seen]
    events.emit("degraded", lambda: {"request_ids": ids[:MAX_IDS], "requests": len(ids), "precision": precision,
                                     "backlog": backlog, "gate_score": gate.score})
