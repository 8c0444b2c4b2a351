"""Running one build stage in a child process, so that its memory goes back to the system when it ends.

A stage that holds a model several times over (torch and its exporter, TensorRT's builder) leaves
the process larger than it found it: freed heap is kept for reuse, and the libraries it imported
(torch alone is hundreds of MB) stay mapped. The next stage's peak then adds to that. Run in a
child (``spawn``: a fresh interpreter, nothing inherited), a stage costs its own peak and nothing
after it; the build's peak is the largest stage's, not their sum.

The child's progress lines reach the caller's ``progress`` callback as they are said; its result or
its exception (a :class:`~model_factory.errors.FactoryError` stays one, with its message) comes back
through a pipe. A child that dies without answering (killed for memory, say) is a FactoryError
naming its exit status.

With ``walls`` (:class:`model_factory.sandbox.Walls`) the child puts itself behind them before it runs the
stage: Landlock (files) and seccomp (no network sockets), where the kernel offers them. What the walls
stop comes back as one line that says the sandbox refused it, what it allows, and the fix.
"""

from __future__ import annotations

import multiprocessing
import pickle
import signal
from typing import Any, Callable

from model_factory.errors import FactoryError


def run_isolated(fn: Callable[..., Any], /, *args: Any, progress: Callable[[str], None] | None = None,
                 what: str = "stage", walls: Any = None, require_sandbox: bool = False, **kwargs: Any) -> Any:
    """``fn(*args, progress=..., **kwargs)`` in a spawned child; its return value (picklable) or exception.

    ``walls`` (a :class:`~model_factory.sandbox.Walls`) sandboxes the child first; ``require_sandbox`` refuses
    to run it where the kernel lacks Landlock or seccomp.
    """
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, fn, args, kwargs, walls, require_sandbox),
                        name=f"model-factory {what}")
    child.start()
    send.close()  # the child holds the only writing end: EOF when it ends
    outcome: tuple[str, Any] | None = None
    try:
        while True:
            try:
                kind, value = receive.recv()
            except EOFError:
                break
            if kind == "progress":
                if progress is not None:
                    progress(value)
            else:
                outcome = (kind, value)
    finally:
        receive.close()
        child.join()
    if outcome is None:
        code = child.exitcode
        why = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit status {code}")
        if code == -signal.SIGKILL:
            why += ", most likely because the system ran out of memory"
        raise FactoryError(f"the {what} process ended without a result ({why}). Fix: free memory on this "
                           "machine or build on a larger one, then run the build again")
    kind, value = outcome
    if kind == "error":
        raise value
    return value


def _child(send: Any, fn: Callable[..., Any], args: tuple, kwargs: dict, walls: Any = None,
           require_sandbox: bool = False) -> None:
    def say(message: str) -> None:
        send.send(("progress", message))

    try:
        if walls is not None:
            from model_factory import sandbox

            sandbox.apply(walls, required=require_sandbox)
        send.send(("ok", fn(*args, progress=say, **kwargs)))
    except BaseException as exc:  # everything goes back to the caller, which raises it there
        send.send(("error", _transportable(_explained(exc, walls))))
    finally:
        send.close()


def _explained(exc: BaseException, walls: Any) -> BaseException:
    """A refusal by the walls as one line naming what was refused and what the walls allow."""
    if walls is None:
        return exc
    from model_factory import sandbox

    if sandbox.active() is None:
        return exc
    blocked = sandbox.blocked_by_walls(exc)
    if blocked is None:
        return exc
    target = f" {blocked.filename}" if blocked.filename else " a network socket"
    return FactoryError(f"the build sandbox stopped the {walls.what}: permission denied for{target} "
                        f"(the {walls.what} {walls.describe()}). Fix: keep what the model needs inside its source "
                        "folder and make its code open no network connection and run no program; if this source is "
                        "trusted, build with --no-sandbox")


def _transportable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (both ways), else a FactoryError with its message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # an exception type whose constructor does not take its own args
        return FactoryError(f"{type(exc).__name__}: {exc}")
