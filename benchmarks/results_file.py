"""benchmarks/RESULTS.md: each benchmark script owns one section between its own markers."""

from __future__ import annotations

import sys
import time
from pathlib import Path

HEADER = ("# Benchmark results\n\nEach section is written by one script in benchmarks/ from a real run "
          "(see the index).\n")


def write_section(path: Path, start: str, end: str, section: str) -> None:
    """Replace the text between ``start`` and ``end`` (markers included in ``section``), or append it."""
    text = path.read_text() if path.is_file() else HEADER
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def suffixed(start: str, end: str, suffix: str) -> tuple[str, str, str]:
    """A section's markers with ``suffix`` (``<!-- chunked-prefill-epyc:start -->``) and its title's tail
    (`` (epyc)``): a run on another machine kept beside the first (the scripts' ``--section-suffix``)."""
    if not suffix:
        return start, end, ""
    return start.replace(":start", f"-{suffix}:start"), end.replace(":end", f"-{suffix}:end"), f" ({suffix})"


def median_cell(values: list[float], digits: int) -> str:
    """A table cell of a run's rounds: ``median (min–max)``, a single round's value alone."""
    import statistics

    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def say(msg: str) -> None:
    """A benchmark's progress line on stderr, ``[HH:MM:SS] msg`` (stdout keeps the section)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def publish(section: str, path: Path, start: str, end: str, write: bool) -> None:
    """Print a benchmark's section and, with ``write``, put it into RESULTS.md in place of the old one."""
    print(section)
    if write:
        write_section(path, start, end, section)
        say(f"wrote {path}")


def machine_header(note: str = "") -> str:
    """One line for a section's header: the date, the CPU (model, cores, the flags INT8 depends on), the load."""
    import datetime as dt
    import os
    import platform

    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name in ("", platform.machine()):
                name = value.strip()
            elif key.strip().lower() in ("flags", "features"):
                flags.update(value.split())
    except OSError:
        pass
    shown = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "asimddp", "i8mm") if f in flags]
    averages = os.getloadavg()
    load = ", ".join(f"{x:.2f}" for x in averages)
    calm = max(averages) <= 0.5 * (os.cpu_count() or 1)
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"*{when}; {name}, {os.cpu_count()} cores, flags {' '.join(shown) or 'none of the INT8 ones'}; "
            f"load average {load} ({'a calm machine' if calm else 'the machine is shared with other work'})"
            f"{'; ' + note if note else ''}.*")
