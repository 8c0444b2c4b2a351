"""Output files: atomic writes (a temporary sibling, then a rename) and content digests.

An interrupted or failed stage leaves the previous output intact and no
half-written folder behind.
"""

from __future__ import annotations

import hashlib
import os
import sys
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from model_factory.errors import FactoryError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


@contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield an empty temporary folder that replaces ``target`` when the block succeeds.

    The temporary folder is a sibling of ``target`` (same filesystem, so the
    rename is atomic). On error it is removed and ``target`` is untouched. When
    ``target`` already exists it is moved aside first and deleted only after the
    new folder is in place.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    # mkdtemp makes 0700 folders; the output is an ordinary folder (Triton in a container reads it).
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
    os.replace(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_file(target: Path, mode: str = "w") -> Iterator:
    """Open a temporary sibling of ``target`` for writing; rename it into place on success."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        os.chmod(name, 0o666 & ~_umask())  # mkstemp makes 0600 files
        os.replace(name, target)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


def digest_path(path: Path) -> str:
    """sha256 of a file, or of a folder's files (sorted relative paths and their digests)."""
    h = hashlib.sha256()
    if path.is_file():
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        h.update(str(p.relative_to(path)).encode() + b"\0" + digest_path(p).encode() + b"\n")
    return h.hexdigest()


def read_toml(path: Path, what: str, missing_fix: str) -> dict[str, Any]:
    """Read a TOML file (a recipe, a trust policy); a missing or malformed one is a FactoryError."""
    path = Path(path)
    if not path.is_file():
        raise FactoryError(f"{what} {path} does not exist. Fix: {missing_fix}")
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise FactoryError(f"{what} {path} is not valid TOML: {exc}. Fix: correct the syntax at that line") from exc
