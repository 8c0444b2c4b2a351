"""One sequence of the continuous batch and what the scheduler emits and reports for it.

:class:`Generation` is a sequence's state (prompt, parameters, slot, what it generated); :class:`TokenEvent` is what one
step produced for it; :class:`QueueFull` is the refusal past the waiting bound; :class:`NullMetrics` names the calls the
scheduler reports (``metrics.GenerationMetrics`` keeps them). The scheduler (``scheduler.Scheduler``) moves these.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .sampling import SamplingParams, TokenLogprobs


class QueueFull(RuntimeError):
    """The waiting queue is at its bound: the request is refused now, to be retried after ``retry_after_s``."""

    def __init__(self, waiting: int, retry_after_s: float) -> None:
        super().__init__(f"server busy: {waiting} requests already wait for KV cache memory; retry after "
                         f"{retry_after_s:.0f} s")
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class TokenEvent:
    """What one step produced for one sequence: its new token, the text it completed, and whether it ended."""

    token: int | None
    text: str
    finish_reason: str | None = None
    error: str | None = None
    logprobs: TokenLogprobs | None = None  # when the request asked for them


@dataclass(eq=False)
class Generation:
    """One sequence being generated: its prompt, parameters, state, and where its events go."""

    prompt: list[int]
    params: SamplingParams
    emit: Callable[["Generation", TokenEvent], None]
    is_cancelled: Callable[[], bool] = lambda: False
    arrival: float = field(default_factory=time.perf_counter)
    id: int = 0
    generated: list[int] = field(default_factory=list)
    slot: int | None = None
    cached: int = 0  # tokens whose keys and values are in its slot
    finish_reason: str | None = None
    last_token_time: float | None = None
    intervals: list[float] = field(default_factory=list)
    preemptions: int = 0
    sampler: Any = None
    detok: Any = None
    stopper: Any = None
    index: int = 0  # the choice this sequence is, of a request with n choices
    leader: "Generation | None" = None  # choice 0 of the same request, whose prefill this one may share
    prefill_from: "Generation | None" = None  # set at admission when it shares its leader's prefill
    grammar: Any = None  # a compiled grammar (structured outputs): the sequence's matcher is made from it at submit
    matcher: Any = None
    prefix_hit: int = 0  # tokens of its context found in the prefix cache at its (last) admission
    held_back: bool = False  # waited a step for a prompt admitted before it to write their shared prefix (once)
    prefilling: bool = False  # admitted, its prefill split over steps and not yet done (chunked prefill)
    adapter: int = 0  # its LoRA adapter's slot (lora.AdapterTable; 0: the base alone)
    adapter_name: str = ""

    @property
    def reserved_tokens(self) -> int:
        return len(self.prompt) + self.params.max_tokens

    def context(self) -> list[int]:
        """The tokens a prefill runs: the prompt, and what was generated before a preemption."""
        return self.prompt + self.generated


def _adapters(gens: Sequence[Generation]) -> dict[str, list[int]]:
    """The launch's ``adapters`` argument: each row's adapter slot, when any row has one."""
    return {"adapters": [g.adapter for g in gens]} if any(g.adapter for g in gens) else {}


def _count(gens: Sequence[Generation]) -> dict[str, int]:
    """The sequences of each adapter (by name) among ``gens``."""
    return dict(collections.Counter(g.adapter_name for g in gens if g.adapter_name))


class NullMetrics:
    """What the scheduler reports, dropped (the metrics module's GenerationMetrics keeps it)."""

    def first_token(self, seconds: float) -> None: ...
    def token_interval(self, seconds: float) -> None: ...
    def jitter(self, seconds: float) -> None: ...
    def tokens(self, prompt: int, generated: int) -> None: ...
    def preempted(self) -> None: ...
    def finished(self, reason: str) -> None: ...
    def refused(self) -> None: ...
    def state(self, running: int, waiting: int, usage: Any, cached_blocks: int = 0) -> None: ...
    def prefix_lookup(self, queried: int, hit: int) -> None: ...
    def prefix_held_back(self) -> None: ...
    def prefill_chunks(self, chunks: int) -> None: ...
    def chunked_step(self, tokens: int, predicted_s: float, measured_s: float) -> None: ...
    def speculated(self, drafted: int, accepted: int) -> None: ...
    def adapters(self, running: Any, waiting: Any, max_adapters: int, loaded: int = 0) -> None: ...
