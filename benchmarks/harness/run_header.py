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


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# Other processes' CPU, averaged over the run, above which the header says other work shared the cores.
OTHER_WORK_CORES = 0.10


@dataclass(frozen=True)
class CpuSnapshot:
    """The machine's busy CPU ticks (/proc/stat) and each process's: ``pid -> (ppid, start time, ticks, name)``, its
    ticks its own and those of the children it reaped."""

    busy: int
    processes: dict
    at: float

    @classmethod
    def take(cls) -> "CpuSnapshot | None":
        import time

        try:
            fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
            busy = sum(int(v) for i, v in enumerate(fields[:7]) if i not in (3, 4))  # user to softirq: not idle, iowait, steal
        except (OSError, ValueError, IndexError):
            return None
        procs = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                raw = Path(entry.path, "stat").read_text()
            except OSError:
                continue  # gone meanwhile
            name, rest = raw[raw.index("(") + 1:raw.rindex(")")], raw[raw.rindex(")") + 2:].split()
            # rest[1] ppid, rest[11:15] utime stime cutime cstime, rest[19] start time (fields 4, 14-17, 22 of stat)
            procs[int(entry.name)] = (int(rest[1]), int(rest[19]), sum(int(v) for v in rest[11:15]), name)
        return cls(busy, procs, time.monotonic())

    def descendants(self, root: int) -> set[int]:
        """``root`` and every process under it."""
        children: dict[int, list[int]] = {}
        for pid, (ppid, *_rest) in self.processes.items():
            children.setdefault(ppid, []).append(pid)
        out, todo = set(), [root]
        while todo:
            pid = todo.pop()
            if pid not in out:
                out.add(pid)
                todo.extend(children.get(pid, ()))
        return out


@dataclass(frozen=True)
class OtherWork:
    """The CPU the machine spent over a run outside the run's own processes (this one and every process under it):
    ``cores`` on average, and the busiest other processes alive at the end with theirs."""

    cores: float
    seconds: float
    busiest: tuple[tuple[str, float], ...]


def other_work(start: CpuSnapshot, end: CpuSnapshot, root: int | None = None) -> OtherWork:
    """What ran beside the run between ``start`` and ``end``: the machine's busy time less the run's processes' (a
    process of the run alive at the end counts its ticks since the start, or all of them if it started since; those
    that ended were reaped by one that is still there and are in its ticks)."""
    root = os.getpid() if root is None else root
    ours = end.descendants(root)

    def delta(pid: int) -> int:
        ppid, started, ticks, _ = end.processes[pid]
        before = start.processes.get(pid)
        return ticks - before[2] if before is not None and before[1] == started else ticks

    own = sum(delta(pid) for pid in ours if pid in end.processes)
    seconds = max(0.0, (end.busy - start.busy - own) / _TICK)
    wall = max(end.at - start.at, 1e-9)
    others = sorted(((end.processes[p][3], delta(p) / _TICK) for p in end.processes
                     if p not in ours and p in start.processes), key=lambda x: -x[1])
    busiest = tuple((name, secs / wall) for name, secs in others[:3] if secs / wall >= 0.02)
    return OtherWork(seconds / wall, seconds, busiest)


def adopt_orphans() -> bool:
    """Make this process the reaper of its descendants' orphans (Linux's ``PR_SET_CHILD_SUBREAPER``), so a server
    process whose parent exits first (vLLM's engine core when its API server stops) stays under the run, a zombie
    with its CPU time until this process exits, instead of going to init, whose reaped children's time would read
    as other work (a served LoRA run read 0.70 of a core "outside" that was its own vLLM). False where it cannot."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


@dataclass(frozen=True)
class LoadReading:
    """Load averages (1, 5 min) read at the start and at the end of a run, and the CPU the machine and its processes
    had spent at both (where /proc says: :class:`CpuSnapshot`), so the header can say what ran beside the run."""

    start: tuple[float, float]
    end: tuple[float, float]
    cpu_start: CpuSnapshot | None = None
    cpu_end: CpuSnapshot | None = None

    @classmethod
    def begin(cls) -> "LoadReading":
        if "PYTEST_CURRENT_TEST" not in os.environ:  # a benchmark's process; never a test runner's (its later tests'
            adopt_orphans()  # orphans, a killed server's stubs, would stay its zombies, never reaped)
        return cls(os.getloadavg()[:2], os.getloadavg()[:2], CpuSnapshot.take())

    def finish(self) -> "LoadReading":
        return LoadReading(self.start, os.getloadavg()[:2], self.cpu_start,
                           CpuSnapshot.take() if self.cpu_start is not None else None)


def load_sentence(load: LoadReading, own_processes: int = 1) -> str:
    """Whether other work shared the cores: from the CPU spent outside the run's own processes where both snapshots
    were taken (more than :data:`OTHER_WORK_CORES` of a core on average: other work), else from the load averages
    (above the run's own processes). The load averages count the run's own processes too, so alone they cannot tell."""
    cores = os.cpu_count() or 1
    worst = max(load.start[1], load.end[1], load.start[0], load.end[0])
    figures = (f"load average (1 / 5 min) {load.start[0]:.1f} / {load.start[1]:.1f} at the start, "
               f"{load.end[0]:.1f} / {load.end[1]:.1f} at the end")
    if load.cpu_start is not None and load.cpu_end is not None:
        other = other_work(load.cpu_start, load.cpu_end)
        named = ", ".join(f"{name} {share:.2f}" for name, share in other.busiest)
        said = (f"{figures}; CPU outside this run's processes {other.cores:.2f} of a core on average "
                f"({other.seconds:.0f} core-seconds{'; ' + named if named else ''})")
        if other.cores > OTHER_WORK_CORES:
            return f"{said}: other work shared the cores, compare only figures from this one run"
        return f"{said}: no sign of other work on the cores"
    if worst > cores + own_processes:
        return f"{figures}: other work shared the cores, compare only figures from this one run"
    return f"{figures}: no sign of other work on the cores"


def run_header(script: str, load: LoadReading, own_processes: int = 1) -> str:
    """``Run <UTC time>, `<script>`: <CPU>, N cores (flags); <load sentence>.``"""
    flags = ", ".join(cpu_flags()) or "none of " + "/".join(FLAGS_OF_INTEREST[:3])
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"Run {when}, `{script}`: {cpu_model()}, {os.cpu_count()} cores (CPU flags: {flags}), "
            f"Python {platform.python_version()}; {load_sentence(load, own_processes)}.")
