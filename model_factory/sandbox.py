"""The build's sandbox: the walls themselves live in the backend (:mod:`model_factory.backend.operations.sandbox`,
standard library only, so a serving stub can wall itself in too); this adds the build's wording and its
one user-error type."""

from __future__ import annotations

from model_factory.backend.operations.sandbox import (SYSTEM_FILES, SYSTEM_READ, Support, SandboxUnavailable,  # noqa: F401
                                           Walls, active, blocked_by_walls, gpu_devices, landlock_abi,
                                           network_filter, python_paths, seccomp_available, support,
                                           syscall_filter)
from model_factory.backend.operations import sandbox as _walls
from model_factory.errors import FactoryError


def support_line(have: Support) -> str:
    """One line for the build's output: the sandbox is on, or off here and why, with the fix."""
    if have.complete:
        return (f"[sandbox] on: Landlock ABI {have.landlock_abi} (files) and seccomp (no network sockets) "
                "wall in export, quantize and engine build")
    return (f"[sandbox] off here: {'; '.join(have.missing)}. The stages run with every right of this user. "
            "Fix: build on a Linux kernel with Landlock (5.13+, enabled in the lsm= list) and seccomp, or pass "
            "--require-sandbox to refuse such machines")


def apply(walls: Walls, required: bool = False) -> Support:
    """Put this process behind ``walls`` (:func:`model_factory.backend.operations.sandbox.apply`); a FactoryError when
    they are ``required`` and the kernel lacks them."""
    try:
        return _walls.apply(walls, required=required)
    except SandboxUnavailable as exc:
        raise FactoryError(f"the build sandbox is required but {exc}. Fix: build on a Linux kernel with Landlock "
                           "and seccomp, or drop --require-sandbox") from None
