"""Load-time integrity: the bytes the backend loads must be the bytes that were verified.

``model-factory serve`` verifies the repository with the installed package
(outside the repository, so code in the repository cannot vouch for itself),
then writes the verified ``relpath -> sha256`` maps to a file outside the
repository and names it in ``MODEL_FACTORY_VERIFIED_DIGESTS`` for the server.
Here, each file the engine loads is read once, its bytes hashed and compared,
and those same bytes are used: a file swapped after verification is refused.
Standard library only: this runs inside Triton's stub.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path
from typing import BinaryIO, Callable

ENV = "MODEL_FACTORY_VERIFIED_DIGESTS"
_BLOCK = 1 << 24


class IntegrityError(RuntimeError):
    """A file differs from what was verified, or the model was never verified."""


def verified_digests(model: str, version: str) -> dict[str, str] | None:
    """The verified digests of one model version, or None when the server runs without verification."""
    path = os.environ.get(ENV)
    if not path:
        return None
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise IntegrityError(f"cannot read the verified digests {path}: {exc}") from exc
    digests = table.get(model, {}).get(str(version))
    if digests is None:
        raise IntegrityError(f"{model} version {version} was not verified before the server started; "
                             "refusing to load it")
    return digests


def _check_covered(path: Path, relpath: str, digests: dict[str, str]) -> None:
    if relpath not in digests:
        raise IntegrityError(f"{relpath} is not covered by the verified signature")
    if path.is_symlink():
        raise IntegrityError(f"{relpath} is a symlink; verified files are never links")


def _changed(relpath: str, actual: str, expected: str) -> IntegrityError:
    return IntegrityError(f"{relpath} changed after verification (sha256 {actual[:16]}…, verified "
                          f"{expected[:16]}…); refusing to load it")


def read_checked(model_dir: Path, relpath: str, digests: dict[str, str] | None) -> bytes:
    """Read ``model_dir/relpath`` once; with ``digests``, refuse bytes that differ from the verified ones."""
    path = Path(model_dir) / relpath
    if digests is not None:
        _check_covered(path, relpath, digests)
    data = path.read_bytes()
    if digests is not None:
        actual = hashlib.sha256(data).hexdigest()
        if actual != digests[relpath]:
            raise _changed(relpath, actual, digests[relpath])
    return data


def copy_checked(model_dir: Path, relpath: str, digests: dict[str, str], dest: Path) -> None:
    """Copy ``model_dir/relpath`` to ``dest`` while hashing it; refuse (and remove ``dest``) if it differs.

    For files too large to hold twice in memory (an ONNX model's external data): ``dest`` lies in a
    private folder of the loading process, so what is loaded from it is exactly what was hashed.
    """
    path = Path(model_dir) / relpath
    _check_covered(path, relpath, digests)
    h = hashlib.sha256()
    with path.open("rb", buffering=0) as src, Path(dest).open("wb") as out:
        copy_sparse(src, out, h.update)  # a file that shrank while copied: its hash will not match
    actual = h.hexdigest()
    if actual != digests[relpath]:
        Path(dest).unlink(missing_ok=True)
        raise _changed(relpath, actual, digests[relpath])


def copy_sparse(src: BinaryIO, out: BinaryIO, update: Callable[[bytes], None] | None = None) -> None:
    """Copy the open file ``src`` (unbuffered) into ``out``, a hole in ``src`` left a hole in ``out`` (a copy written
    densely would take a sparse weight file's whole size on disk). ``update`` sees every byte of ``src`` in order, a
    hole's as zeros: a hash of what was copied. A file that shrinks while copied ends the copy where it ends."""
    for start, end, data in file_regions(src.fileno(), os.fstat(src.fileno()).st_size):
        if not data:
            if update is not None:
                zeros = bytes(min(_BLOCK, end - start))
                for at in range(start, end, _BLOCK):
                    update(zeros if end - at >= _BLOCK else zeros[:end - at])
            out.seek(end)
            continue
        src.seek(start)
        left = end - start
        while left > 0:
            chunk = src.read(min(_BLOCK, left))
            if not chunk:
                break
            if update is not None:
                update(chunk)
            out.write(chunk)
            left -= len(chunk)
    out.truncate()


def file_regions(fd: int, size: int):
    """``(start, end, is_data)`` spans covering a file's ``size`` bytes: its data and its holes.

    Holes (runs of zeros a filesystem stores as nothing: a sparse weight file's unused rows) are found
    with ``SEEK_DATA``/``SEEK_HOLE``; where the filesystem cannot say, the whole file is one data span.
    """
    if not hasattr(os, "SEEK_DATA"):
        yield 0, size, True
        return
    pos = 0
    while pos < size:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # not supported here: all data
                yield pos, size, True
                return
            data = size  # ENXIO: only a hole from pos to the end
        if data > pos:
            yield pos, min(data, size), False
        if data >= size:
            return
        hole = min(os.lseek(fd, data, os.SEEK_HOLE), size)
        yield data, hole, True
        pos = hole
