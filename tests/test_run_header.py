"""The benchmarks' run header (benchmarks/harness/run_header.py): what it says ran beside a run comes from the CPU the
machine spent outside the run's own processes, not from the load averages (which count the run's own servers too)."""

from __future__ import annotations

import os

from benchmarks.harness.run_header import OTHER_WORK_CORES, CpuSnapshot, LoadReading, load_sentence, other_work

TICK = os.sysconf("SC_CLK_TCK")


def _snap(busy_s: float, at: float, **procs: tuple[int, int, float]) -> CpuSnapshot:
    """A snapshot from ``name=(pid, ppid, cpu seconds)`` (every process started at tick 1)."""
    return CpuSnapshot(int(busy_s * TICK), {pid: (ppid, 1, int(secs * TICK), name) for name, (pid, ppid, secs) in
                                            procs.items()}, at)


def test_the_run_s_own_processes_are_not_other_work_and_the_others_are_named():
    # The run (pid 10) starts a server (11) that starts a stub (12); a test runner (20) runs beside it.
    start = _snap(100.0, 0.0, bench=(10, 1, 5.0), pytest=(20, 1, 50.0))
    end = _snap(100.0 + 18.0, 10.0, bench=(10, 1, 6.0), tritonserver=(11, 10, 4.0), stub=(12, 11, 5.0),
                pytest=(20, 1, 58.0))
    other = other_work(start, end, root=10)
    assert round(other.seconds, 2) == 8.0  # 18 busy: 1 + 4 + 5 ours (the server and stub started since: all theirs)
    assert round(other.cores, 2) == 0.8 and other.busiest == (("pytest", 0.8),)


def test_the_sentence_says_other_work_from_the_cpu_outside_the_run():
    me = os.getpid()
    start = _snap(100.0, 0.0, bench=(me, 1, 5.0), pytest=(me + 1, 1, 50.0))
    busy = _snap(118.0, 10.0, bench=(me, 1, 15.0), pytest=(me + 1, 1, 58.0))
    quiet = _snap(110.5, 10.0, bench=(me, 1, 15.0), pytest=(me + 1, 1, 50.5))
    said = load_sentence(LoadReading((1.0, 1.0), (1.5, 1.0), start, busy))
    assert "CPU outside this run's processes 0.80 of a core" in said and "pytest 0.80" in said
    assert said.endswith("other work shared the cores, compare only figures from this one run")
    # A load average of 2.5 on 2 cores from the run's own processes alone: quiet, as the CPU outside says.
    said = load_sentence(LoadReading((2.5, 2.5), (2.5, 2.5), start, quiet))
    assert "0.05 of a core" in said and said.endswith("no sign of other work on the cores")


def test_a_quiet_machine_says_so_whatever_the_load_average_of_the_run_itself():
    start = _snap(100.0, 0.0, bench=(10, 1, 5.0), sshd=(30, 1, 1.0))
    end = _snap(100.0 + 19.05, 10.0, bench=(10, 1, 6.0), tritonserver=(11, 10, 18.0), sshd=(30, 1, 1.05))
    other = other_work(start, end, root=10)
    assert other.cores < OTHER_WORK_CORES and other.busiest == ()  # 0.05 s: under 2 % of a core, not named


def test_a_header_from_real_snapshots_names_the_busy_loop_of_another_process_not_its_own_child():
    import subprocess
    import sys
    import time

    busy = "import time\nt = time.time()\nwhile time.time() - t < 1.2: pass"
    start = CpuSnapshot.take()
    assert start is not None, "/proc is readable on Linux"
    child = subprocess.Popen([sys.executable, "-c", busy])
    child.wait()
    end = CpuSnapshot.take()
    other = other_work(start, end)
    assert not any(name.startswith("python") and share > 0.5 for name, share in other.busiest)
    assert end.processes[os.getpid()][2] - start.processes[os.getpid()][2] >= 1.0 * TICK  # the child's CPU, reaped



BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0:\n    pass\n"
MIDDLE = "import subprocess, sys\nsubprocess.Popen([sys.executable, sys.argv[1]])\n"  # exits at once: an orphan
RUN = """
import os, subprocess, sys, time
from benchmarks.harness.run_header import adopt_orphans, CpuSnapshot
assert adopt_orphans()
subprocess.run([sys.executable, sys.argv[1], sys.argv[2]], check=True)
def children():
    return [p for p in os.listdir("/proc") if p.isdigit()
            and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1] == str(os.getpid())]
deadline = time.time() + 30
while time.time() < deadline:  # the orphan, adopted here, burns its second and exits: a zombie, not reaped
    states = [open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] for p in children()]
    if states and all(s == "Z" for s in states):
        break
    time.sleep(0.1)
end = CpuSnapshot.take()
mine = end.descendants(os.getpid()) - {os.getpid()}
print(len(mine), sum(end.processes[p][2] for p in mine) / os.sysconf("SC_CLK_TCK"))
"""


def test_an_orphan_of_the_run_stays_the_run_s_and_is_not_other_work(tmp_path):
    """A grandchild whose parent exits first (as vLLM's engine core when its API server stops) is adopted by the run
    (a zombie under it, its CPU time with it) instead of by init, whose reaped children would read as other work.
    In a child process: the subreaper setting is per process, and pytest must not become one."""
    import subprocess
    import sys

    import pytest

    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_CHILD_SUBREAPER is Linux's")
    for name, text in (("burn.py", BURN), ("middle.py", MIDDLE), ("run.py", RUN)):
        (tmp_path / name).write_text(text)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(tmp_path / "middle.py"),
                          str(tmp_path / "burn.py")], capture_output=True, text=True, cwd=root, timeout=60,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr
    count, seconds = out.stdout.split()
    assert int(count) == 1 and float(seconds) >= 0.9, out.stdout  # the orphan and its second, under the run


def test_a_load_reading_in_a_test_runner_does_not_make_it_the_reaper():
    """Under pytest (a test calling a benchmark's section code) ``begin`` leaves the runner as it is: orphans of later
    tests (a killed server's stubs) must go to init, which reaps them."""
    import sys

    if not sys.platform.startswith("linux"):
        import pytest

        pytest.skip("PR_GET_CHILD_SUBREAPER is Linux's")
    import ctypes

    LoadReading.begin()
    libc = ctypes.CDLL(None)
    flag = ctypes.c_int(-1)
    assert libc.prctl(37, ctypes.byref(flag), 0, 0, 0) == 0  # PR_GET_CHILD_SUBREAPER
    assert flag.value == 0
