"""Run a command in a fresh network namespace that has only loopback, up.

For tests that must show something works with no network at all (an offline
install, a build, a server): inside the namespace there is no interface but
``lo`` and no route, so any connection to a non-loopback address fails at once
with ENETUNREACH and no packet leaves the machine, while 127.0.0.1 works (a
server started inside the same namespace is reachable).

It uses ``unshare --net`` (util-linux) and ``ip link set lo up`` (iproute2).
As root that is all it needs; otherwise it adds ``--map-root-user`` (needs
unprivileged user namespaces). :func:`netns_available` says whether it works
here; tests skip on it.

Each call gets a new namespace that ends with the command: nothing is shared
between calls, and nothing outside can reach a server started inside.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from typing import Mapping, Sequence

# Exit code of the set-up wrapper when the namespace is not what it must be.
SETUP_FAILED = 125
_MARKER = "netns: set-up failed"

# Bring lo up, check that it is the only interface (so nothing can route out), then exec.
_WRAPPER = (
    'ip link set lo up || { echo "' + _MARKER + ': ip link set lo up" >&2; exit ' + str(SETUP_FAILED) + '; }; '
    'n=$(ip -o link show | wc -l); '
    '[ "$n" = 1 ] || { echo "' + _MARKER + ': $n interfaces, expected only lo" >&2; exit ' + str(SETUP_FAILED) + '; }; '
    'exec "$@"'
)


class NetnsError(RuntimeError):
    """The namespace could not be set up (not the command's own failure)."""


def _unshare_argv() -> list[str]:
    argv = ["unshare", "--net"]
    if os.geteuid() != 0:
        argv.append("--map-root-user")
    return argv


def netns_command(cmd: Sequence[str]) -> list[str]:
    """The argv that runs ``cmd`` inside a fresh loopback-only namespace."""
    if not cmd:
        raise ValueError("empty command")
    return [*_unshare_argv(), "--", "sh", "-c", _WRAPPER, "netns", *map(str, cmd)]


@functools.lru_cache(maxsize=1)
def netns_available() -> tuple[bool, str]:
    """``(True, "")`` when :func:`run_in_netns` works here, else ``(False, why)``."""
    for tool in ("unshare", "ip", "sh"):
        if shutil.which(tool) is None:
            return False, f"{tool} is not installed"
    try:
        proc = subprocess.run(netns_command(["true"]), capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"unshare failed: {exc}"
    if proc.returncode != 0:
        return False, f"unshare --net failed (rc {proc.returncode}): {proc.stderr.strip()[-300:]}"
    return True, ""


def run_in_netns(
    cmd: Sequence[str],
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    input: str | bytes | None = None,
    timeout: float | None = None,
    capture_output: bool = True,
    text: bool = True,
    check: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``cmd`` with no network but loopback and return its CompletedProcess.

    The arguments mean what they mean for :func:`subprocess.run`. ``args`` of
    the result is ``cmd`` as given. Raises :class:`NetnsError` when the
    namespace could not be made (with captured output: the wrapper's message),
    and ``subprocess.CalledProcessError`` for a failing command when ``check``.
    """
    proc = subprocess.run(netns_command(cmd), cwd=cwd, env=None if env is None else dict(env), input=input,
                          timeout=timeout, capture_output=capture_output, text=text, check=False)
    stderr = proc.stderr if isinstance(proc.stderr, str) else (proc.stderr or b"").decode("utf-8", "replace")
    if proc.returncode == SETUP_FAILED and (not capture_output or _MARKER in stderr):
        raise NetnsError(stderr.strip() or f"unshare/ip set-up failed (rc {SETUP_FAILED})")
    result = subprocess.CompletedProcess(list(cmd), proc.returncode, proc.stdout, proc.stderr)
    if check:
        result.check_returncode()
    return result
