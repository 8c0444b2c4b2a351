"""Degrade before shedding: under overload, answer from a cheaper precision that passed its gate.

A model packaged with ``degrade_to`` (recipe ``[repository] degrade_to = "int8"``) carries that precision's
engine beside the served one, and the quantize stage's gate report (``accuracy.json``). At load the backend
reads the report (:func:`read_gate`): a precision that failed its gate, or a report without a gate, is never
loaded (:class:`DegradeRefused`, one line). Otherwise it loads the second engine with the same loader
(``loading.load_engine``, bytes checked against the verified digests; on a CPU without VNNI the 7-bit INT8
form) and a second grouped executor with its own cost model.

The decision is per window (:func:`decide`). Triton's dynamic batcher (``max_queue_delay_us = 0``) hands a
free instance everything queued, up to ``max_batch_size``: the window's request count *is* the backlog the
instance sees. A window of ``degrade_backlog`` requests or more (0: half of the largest preferred batch size,
else of ``max_batch_size``) runs on the
cheaper engine, which drains it faster (MiniLM's 7-bit INT8 ran about 2x FP32 at 8-64 in flight on an AVX2
CPU); a smaller one runs on the served precision. So at light load every answer is the served precision's,
and only the windows a backlog built are degraded. Triton's queue bound is raised by
``contract.DEGRADE_QUEUE_FACTOR`` for such a model (``serve`` and packaging), so the requests that would have
been shed reach the backend; past that larger bound Triton still sheds (503).

What it says: each response's ``precision`` output (declared only for such a model), the counter
``model_factory_degraded_requests_total{precision=...}`` and a ``degraded`` decision event per degraded window
(rate-limited like every event).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

# The gate check is the contract's: packaging (build side) makes the same check before it writes the package.
from ..accuracy_gate import DegradeRefused, Gate, read_gate  # noqa: F401
from ..contract import PRECISIONS, Files, onnx_file, plan_file


@dataclass(frozen=True)
class DegradePolicy:
    """When a window runs on the cheaper engine."""

    precision: str
    backlog: int  # requests in a window from which it degrades

    @classmethod
    def of(cls, precision: str, backlog: int, max_batch_size: int, preferred: tuple[int, ...] = ()) -> "DegradePolicy":
        """``backlog`` 0 means half of the largest window a backlog builds: the largest preferred batch size, else
        ``max_batch_size`` (Triton's batcher stops a window at a preferred size); at least 2, since a lone
        request is no backlog."""
        if precision not in PRECISIONS:
            raise DegradeRefused(f"degrade_to={precision!r}: use one of {', '.join(PRECISIONS)}")
        if backlog > 0:
            return cls(precision, int(backlog))
        largest = max([int(x) for x in preferred if int(x) > 0] or [int(max_batch_size)])
        return cls(precision, max(2, largest // 2))


def decide(policy: DegradePolicy | None, window_requests: int) -> bool:
    """Whether this window runs on the degrade engine: its backlog (requests) reached the policy's."""
    return policy is not None and int(window_requests) >= policy.backlog


def degrade_settings(settings: Any, precision: str) -> Any:
    """The backend settings of the degrade engine: the same model, its precision's files."""
    return replace(settings, precision=precision, onnx_file=onnx_file(precision), plan_file=plan_file(precision))


def report_text(model_dir: Any, version: str, digests: Mapping[str, str] | None) -> bytes | None:
    """``accuracy.json``'s verified bytes (None when the version has none)."""
    from ..integrity import read_checked

    relpath = f"{version}/{Files.ACCURACY}"
    if digests is not None and relpath not in digests:
        return None
    if digests is None and not (model_dir / relpath).is_file():
        return None
    return read_checked(model_dir, relpath, digests)


def load_degrade_engine(version_dir: Any, settings: Any, instance_kind: str, device_id: int,
                        digests: Any, server_instance: bool = False) -> tuple[Any, dict, Gate]:
    """``(engine, info, gate)`` of the degrade precision, or :class:`DegradeRefused` (gate first, then files)."""
    from pathlib import Path

    from ..engines.loading import load_engine
    from ..requests.samples import warm_up
    from ..batching.grouping import profile_for_length

    version_dir = Path(version_dir)
    precision = settings.degrade_to
    if precision == settings.precision:
        raise DegradeRefused(f"degrade_to={precision!r} is the precision served: nothing cheaper to degrade to")
    gate = read_gate(report_text(version_dir.parent, version_dir.name, digests), precision)
    cheap = degrade_settings(settings, precision)
    engine, info = load_engine(version_dir, cheap, instance_kind, device_id, digests, server_instance)
    try:
        warm_up(engine, cheap, profile_for_length)
    except BaseException:
        engine.close()
        raise
    return engine, info, gate


@dataclass
class Degrader:
    """The instance's degrade engine and executor, its gate result and the policy (built by ``model.py``)."""

    policy: DegradePolicy
    engine: Any
    executor: Any  # a GroupedExecutor on ``engine``
    gate: Gate
    info: dict

    def choose(self, primary: Any, served: str, window_requests: int) -> tuple[Any, str]:
        """``(executor, precision)`` for a window of ``window_requests`` requests."""
        if decide(self.policy, window_requests):
            return self.executor, self.policy.precision
        return primary, served

    def close(self) -> None:
        self.engine.close()


def precision_column(precision: str, rows: int) -> Any:
    """The ``precision`` output of one response: ``rows`` x 1 BYTES, each the precision that answered."""
    import numpy as np

    out = np.empty((max(1, int(rows)), 1), dtype=object)
    out[:] = precision.encode()
    return out


def build_degrader(settings: Any, version_dir: Any, args: Mapping[str, Any], seq_inputs: frozenset, buckets: Any,
                   fill: Any, events: Any, log: Any) -> Degrader:
    """The instance's :class:`Degrader` (called by ``model.py``'s ``initialize()`` for a model with ``degrade_to``):
    the gate checked, the engine loaded and warmed up, its own cost model (the same warm-up as the served one's,
    not cached) and grouped executor. A degrade precision it may not use refuses the model's load (SettingsError)."""
    from pathlib import Path

    from . import decisions
    from ..batching.cost_learning import start_cost_model
    from ..batching.executor import GroupedExecutor
    from ..batching.grouping import profile_for_length
    from ..integrity import verified_digests
    from ..memory.guard import guard_for
    from ..requests.samples import sample_feeds
    from ..settings import SettingsError

    s, version_dir = settings, Path(version_dir)
    try:
        policy = DegradePolicy.of(s.degrade_to, s.degrade_backlog, s.max_batch_size, s.preferred_batch_sizes)
        engine, info, gate = load_degrade_engine(
            version_dir, s, args.get("model_instance_kind", "CPU"), int(args.get("model_instance_device_id", 0) or 0),
            verified_digests(version_dir.parent.name, version_dir.name))
    except DegradeRefused as exc:
        raise SettingsError(str(exc)) from None
    cheap = degrade_settings(s, s.degrade_to)
    fixed = None if s.sequence_inputs else s.sequence_buckets[0]

    def run(n: int, length: int) -> None:
        engine.run(sample_feeds(cheap, engine.input_names, n, fixed or length),
                   profile_for_length(length, s.sequence_buckets))

    try:
        start = start_cost_model(run=run, buckets=buckets, max_batch=s.max_batch_size, max_tokens=s.max_group_tokens,
                                 per_profile=False, given=s.cost_model, online=s.cost_model_online,
                                 warmup=s.cost_model_warmup, repeats=s.cost_model_repeats, cache_file=None)
    except BaseException:
        engine.close()
        raise
    executor = GroupedExecutor(
        engine, start.cost, max_batch=s.max_batch_size, buckets=s.sequence_buckets, seq_inputs=seq_inputs,
        seq_outputs=s.sequence_outputs, mode=s.grouping, max_tokens=s.max_group_tokens, fill=fill,
        pad_sequences=s.pad_sequences, memory_guard=guard_for(engine))
    decisions.degrade_ready(events, policy, gate, info)
    log(f"model-factory backend: {s.model_name} degrades to {policy.precision} ({info['file']}, {gate.metric} "
        f"{gate.score:.6g} >= gate {gate.min_accuracy:g}) at a backlog of {policy.backlog} requests")
    return Degrader(policy, engine, executor, gate, info)
