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


STAGING_MARK = ".staging-"


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: the filesystem or kernel cannot exchange
        return False
    raise OSError(err, os.strerror(err), str(b))


def remove_stale_staging(parent: Path, name: str) -> None:
    """Remove what an interrupted :func:`atomic_dir` of ``parent/name`` left (its hidden staging folders).

    Call it only while holding the lock of ``parent/name`` (:mod:`model_factory.locking`): a staging
    folder of a writer that is still running must not be removed.
    """
    for leftover in Path(parent).glob(f".{name}{STAGING_MARK}*"):
        shutil.rmtree(leftover, ignore_errors=True)


@contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield an empty temporary folder that replaces ``target`` when the block succeeds.

    The folder is staged as ``<parent>/.<name>.staging-XXXX/<name>`` (same filesystem, so the final
    rename is atomic; the staged folder already bears the target's name, so it can be signed before it
    goes live). On error it is removed and ``target`` is untouched. An existing ``target`` is swapped with
    the new folder in one step (renameat2 RENAME_EXCHANGE), so a process killed at any instant leaves
    either the old folder or the new one at ``target``, never neither; where the filesystem cannot
    exchange, the old folder is moved aside first. Only a hidden staging folder may be left behind
    (``remove_stale_staging``; tools skip hidden folders at the top of a repository).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}{STAGING_MARK}", dir=target.parent))
    tmp = staging / target.name
    tmp.mkdir()
    # An ordinary folder (mkdtemp makes 0700; Triton in a container reads it).
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if target.exists() and _exchange(tmp, target):
        shutil.rmtree(staging, ignore_errors=True)  # now holds the old folder
        return
    if target.exists():
        os.replace(target, staging / (target.name + ".old"))
    os.replace(tmp, target)
    shutil.rmtree(staging, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# The largest TOML settings file (a recipe, a trust policy) that is read at all.
MAX_TOML_BYTES = 1 << 20


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
    size = path.stat().st_size
    if size > MAX_TOML_BYTES:
        # Parsing tens of MiB of TOML takes minutes: a settings file this big is not one.
        raise FactoryError(f"{what} {path} is {size / (1 << 20):.1f} MiB; a {what} is a small text file (at most "
                           f"{MAX_TOML_BYTES >> 20} MiB). Fix: pass the right file")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        problem = " ".join(str(exc).split())  # one line
        raise FactoryError(f"{what} {path} is not valid TOML: {problem}. Fix: correct the syntax at that line") from exc
    except RecursionError:
        raise FactoryError(f"{what} {path} nests arrays or tables too deeply to read. Fix: pass the right file, "
                           "or flatten the nesting") from None
