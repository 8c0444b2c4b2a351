"""How a refused model is worded: one line that names the problem and ends with a fix (the stack is for --debug)."""

from __future__ import annotations

import re

from model_factory.errors import FactoryError


def one_line(exc: BaseException, fix: str = "rebuild the model (model-factory build), or serve it where its "
                                             "engine loads") -> str:
    """An exception as one line (no stack, whitespace collapsed) that ends with a fix."""
    text = " ".join(str(exc).split())
    if not isinstance(exc, FactoryError) and not text.startswith(type(exc).__name__):
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if "Fix:" in text or "fix:" in text.lower() else f"{text}. Fix: {fix}"


def load_error_line(text: str) -> str:
    """Triton's load error for a model as one line: the backend's stack (``At:`` ...) cut, a fix appended.

    The backend raises its refusals with their fix (``Fix:`` or ``: <what to do>``); other causes get one.
    """
    head = re.split(r"\n\s*At:\s*\n", text, maxsplit=1)[0]
    line = " ".join(head.split()).rstrip(";").strip()
    line = re.sub(r"^load failed for model '[^']*': version \d+ is at UNAVAILABLE state: (Internal: )?", "", line)
    if "Fix:" in line or "repackage" in line or "rebuild" in line:
        return line
    return (f"{line}. Fix: run model-factory accept on the repository to see why this machine cannot load it, "
            "then rebuild it or serve it where its engine loads")
