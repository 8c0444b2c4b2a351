"""A stub whose server died exits too.

Triton 2.51's Python backend stubs can outlive a ``tritonserver`` that dies under load: after a server died of
SIGSEGV (docs/environment.md, its tracer) its MiniLM stubs were still there 20 minutes later, each at 2-3 % of a
core and each holding its model in memory (for a large model, gigabytes no new server can have); a SIGKILL of the
server with requests in flight leaves them too (tests/integration/test_server_death.py). Every thread of such a
stub waits on a futex, so a Python thread of ours could not run to notice: the watch is a separate process. At
load, before the sandbox walls go up, the stub starts a small ``/bin/sh`` loop (about 1 MB) that reads the stub's
``/proc/<pid>/stat`` once a second and SIGKILLs the stub when its parent is no longer the server that forked it
(the stub was re-parented: the server is gone). It ends by itself when the stub ends, and, started through a
second shell that exits at once, it is nobody's child to reap. Standard library only.
"""

from __future__ import annotations

import os
import shutil
import subprocess

# $4: the parent's pid; $22: the start time, which tells the stub from a later process given its pid.
_WATCH = """
read -r line < /proc/{stub}/stat || exit 0
set -- $line
born=${{22}}
while read -r line < /proc/{stub}/stat; do
  set -- $line
  [ "${{22}}" = "$born" ] || exit 0
  [ "$4" = "{server}" ] || {{ kill -9 {stub}; exit 0; }}
  sleep {interval}
done
"""


def watch_parent(interval_s: float = 1.0) -> bool:
    """Start the watch of this process (the stub) and its parent (the server); False where it cannot run."""
    sh = shutil.which("sh") or "/bin/sh"
    if not os.path.isfile(f"/proc/{os.getpid()}/stat") or not os.access(sh, os.X_OK):
        return False
    script = _WATCH.format(stub=os.getpid(), server=os.getppid(), interval=f"{max(0.05, float(interval_s)):g}")
    try:
        # The outer shell starts the loop in the background and exits: the loop is re-parented, reaped by init.
        subprocess.run([sh, "-c", f"( {script} ) </dev/null >/dev/null 2>&1 &"], check=True, timeout=10,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return False
    return True
