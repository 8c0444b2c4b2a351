"""One run header for every benchmark, from real readings of the machine (never a fixed sentence)."""

from __future__ import annotations

import datetime as _dt
import os
import platform
from dataclasses import dataclass
from pathlib import Path

# The flags that decide which kernels run: integer dot products (INT8) and wide vectors.
FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "amx_bf16", "asimddp", "i8mm")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or what platform says elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_flags() -> tuple[str, ...]:
    """The flags of :data:`FLAGS_OF_INTEREST` this CPU has, in that order (read as the backend reads them)."""
    from model_factory.backend.engines.cpu_features import cpu_flags as backend_cpu_flags

    have = backend_cpu_flags()
    return tuple(f for f in FLAGS_OF_INTEREST if f in have)


@dataclass(frozen=True)
class LoadReading:
    """Load averages (1, 5 min) read at the start and at the end of a run."""

    start: tuple[float, float]
    end: tuple[float, float]

    @classmethod
    def begin(cls) -> "LoadReading":
        return cls(os.getloadavg()[:2], os.getloadavg()[:2])

    def finish(self) -> "LoadReading":
        return LoadReading(self.start, os.getloadavg()[:2])


def load_sentence(load: LoadReading, own_processes: int = 1) -> str:
    """Whether other work shared the cores, said from the load averages (above the run's own processes)."""
    cores = os.cpu_count() or 1
    worst = max(load.start[1], load.end[1], load.start[0], load.end[0])
    figures = (f"load average (1 / 5 min) {load.start[0]:.1f} / {load.start[1]:.1f} at the start, "
               f"{load.end[0]:.1f} / {load.end[1]:.1f} at the end")
    if worst > cores + own_processes:
        return f"{figures}: other work shared the cores, compare only figures from this one run"
    return f"{figures}: no sign of other work on the cores"


def run_header(script: str, load: LoadReading, own_processes: int = 1) -> str:
    """``Run <UTC time>, `<script>`: <CPU>, N cores (flags); <load sentence>.``"""
    flags = ", ".join(cpu_flags()) or "none of " + "/".join(FLAGS_OF_INTEREST[:3])
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"Run {when}, `{script}`: {cpu_model()}, {os.cpu_count()} cores (CPU flags: {flags}), "
            f"Python {platform.python_version()}; {load_sentence(load, own_processes)}.")
