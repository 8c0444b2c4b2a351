"""The CPU time a served request costs: user + system seconds of a Triton server and its stubs.

On a shared machine other work stretches wall time (throughput halves when another process takes a core), but
it stretches much less what a request costs in CPU, so CPU per answered sequence, read around each run, is the
steadier reading of which configuration is cheaper; with the cores saturated, throughput on an idle machine
follows it.
"""

from __future__ import annotations

from typing import Any


def server_cpu_seconds(server: Any) -> float:
    """User + system CPU seconds so far of ``server`` (a started ``TritonServer``) and every process under it."""
    import psutil

    root = psutil.Process(server.process.pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total
