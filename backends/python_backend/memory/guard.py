"""Memory-aware groups on a GPU: a group whose activations would not fit is split before it is launched.

Without this, a group that runs out of device memory fails, is split in halves and retried
(``executor``): a failed launch on a GPU can cost as much as the launch, and an allocator that
failed may leave the context fragmented. Before each launch the executor asks :class:`MemoryGuard`
whether the group's activation memory fits what is free *now*: memory the driver reports free
(``cudaMemGetInfo``) plus what the instance's own pool holds unused (its cached blocks serve the
next allocation first). The activation memory of a group of ``n`` sequences padded to ``length`` comes
from the engine (``activation_bytes(n, length, profile)``): for TensorRT the group's input and output
buffers (each profile's activation memory is held by its context from load on), for torch its peak
allocation per token measured on the groups it has run. Until the engine can say, every group launches (and the split-and-retry
stays the safety net).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# Share of the free memory a launch may plan to use: the rest is headroom for what the estimate misses
# (workspace, fragmentation, another instance allocating at the same moment).
DEFAULT_HEADROOM = 0.9


@dataclass
class MemoryGuard:
    """Says whether a group fits the device memory free now (see the module docstring).

    ``free_bytes()``: memory free for this instance now (None: unknown, launch).
    ``activation_bytes(n, length, profile)``: the group's activation memory (None: unknown, launch).
    """

    free_bytes: Callable[[], int | None]
    activation_bytes: Callable[[int, int, int], int | None]
    headroom: float = DEFAULT_HEADROOM

    def fits(self, n: int, length: int, profile: int = 0) -> bool:
        """Whether a group of ``n`` sequences padded to ``length`` fits; True when either side is unknown."""
        need = self.activation_bytes(n, length, profile)
        if need is None:
            return True
        free = self.free_bytes()
        if free is None:
            return True
        return need <= self.headroom * free


def guard_for(engine: object, headroom: float = DEFAULT_HEADROOM) -> MemoryGuard | None:
    """A guard for ``engine`` when it can tell both its free memory and a group's activations, else None (a CPU
    engine, or one without the estimates)."""
    free = getattr(engine, "free_device_bytes", None)
    need = getattr(engine, "activation_bytes", None)
    if not callable(free) or not callable(need):
        return None
    return MemoryGuard(free, need, headroom)
