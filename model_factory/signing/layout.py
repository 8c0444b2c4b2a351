"""What one signature covers in a Triton repository, and where it lives.

Triton loads version ``N`` of model ``M`` from ``<repo>/M/config.pbtxt``, the
folder ``<repo>/M/N/`` (model.onnx, model.py, the backend package, engines,
tokenizer) and, through backends and model code, possibly any other file in
``<repo>/M/``. So the signed unit of a version is the whole model folder
``<repo>/M/`` minus only:

* the other version folders ``<repo>/M/K/`` (K != N, canonical decimal names):
  each is its own unit with its own signature;
* the signature files ``<repo>/M/K.sig`` and ``<repo>/M/K.provenance.sig``
  (regular files, top level of the model folder, any K);
* OMS v1.0's default exclusions (§6.2): ``.git``, ``.gitignore``,
  ``.gitattributes`` and ``.github`` at the top of the model folder (files or
  folders, with everything under them). Triton never loads them.

A version that carries its own configuration (``<repo>/M/N/config.pbtxt``, which
packaging writes into every version it builds) leaves the model's
``config.pbtxt`` out of its unit too: that file is derived, a copy of the
configuration of the version it serves, so building version N+1 (which
rewrites it) leaves version N's signature verifying. Verification holds the
derived file to the served version's signed copy (``model_factory.signing.
model_config``), so a tampered ``config.pbtxt`` still fails the version it
would serve. A version
without its own copy (packaged before) keeps the model's ``config.pbtxt`` in
its unit, as it was signed.

Triton reads numeric sub-folders as versions and ignores plain files beside
``config.pbtxt``, so the signature files do not disturb it. The exclusion is a
fixed rule applied at verification time: ``ignore_paths`` written into a
bundle by its signer are never used to decide what is covered.

Nothing here follows symbolic links. A symlink, a special file (fifo, socket,
device) or a version folder with a non-canonical number ("01") is reported as a
problem; the caller decides whether that is an error (signing) or a failed
verification.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

SIGNATURE_SUFFIX = ".sig"
PROVENANCE_SUFFIX = ".provenance.sig"
_CANONICAL_VERSION = re.compile(r"^(0|[1-9][0-9]*)$")
_NUMERIC = re.compile(r"^[0-9]+$")
_SIG_FILE = re.compile(r"^(0|[1-9][0-9]*)(\.provenance)?\.sig$")
# OMS v1.0 §6.2: excluded by default, matched as top-level components of the model root only.
DEFAULT_EXCLUSIONS = (".git", ".gitignore", ".gitattributes", ".github")
# Triton's model configuration: at the model's top (what Triton reads) and, signed with it, in each version folder.
CONFIG = "config.pbtxt"


def own_config_path(model_dir: Path, version: int) -> Path:
    """``<repo>/<model>/<version>/config.pbtxt``: the version's own configuration, signed with it."""
    return Path(model_dir) / str(int(version)) / CONFIG


def carries_own_config(model_dir: Path, version: int) -> bool:
    """Whether the version holds its own ``config.pbtxt`` (a regular file): the model's one is then derived, out of
    its unit. Decided from the disk on both sides: a copy added to, or removed from, a signed version changes its
    file list, which verification reports."""
    try:
        return stat.S_ISREG(os.lstat(own_config_path(model_dir, version)).st_mode)
    except (OSError, ValueError):
        return False


def signature_path(model_dir: Path, version: int) -> Path:
    """``<repo>/<model>/<version>.sig``: the Sigstore bundle of one model version."""
    return Path(model_dir) / f"{int(version)}{SIGNATURE_SUFFIX}"


def provenance_path(model_dir: Path, version: int) -> Path:
    """``<repo>/<model>/<version>.provenance.sig``: the signed build provenance."""
    return Path(model_dir) / f"{int(version)}{PROVENANCE_SUFFIX}"


def is_version_name(name: str) -> bool:
    """True for a canonical version folder name (``"1"``, ``"20"``; not ``"01"``)."""
    return bool(_CANONICAL_VERSION.match(name))


def is_signature_name(name: str) -> bool:
    """True for ``K.sig`` and ``K.provenance.sig`` with a canonical K."""
    return bool(_SIG_FILE.match(name))


@dataclass(frozen=True)
class ModelEntries:
    """The versions found in a model folder and the signature files beside them."""

    versions: tuple[int, ...]  # canonical numeric entries (folders, or symlinks to report)
    signed_versions: tuple[int, ...]  # versions that have a K.sig file


def model_entries(model_dir: Path) -> ModelEntries:
    """List the version folders and signature files at the top of a model folder."""
    versions, signed = set(), set()
    with os.scandir(model_dir) as it:
        for entry in it:
            if is_version_name(entry.name) and (entry.is_dir(follow_symlinks=False) or entry.is_symlink()):
                versions.add(int(entry.name))
            m = _SIG_FILE.match(entry.name)
            if m and not m.group(2):
                signed.add(int(m.group(1)))
    return ModelEntries(tuple(sorted(versions)), tuple(sorted(signed)))


def excluded_top_level(name: str, is_dir: bool, is_file: bool, version: int, is_link: bool = False,
                       own_config: bool = False) -> bool:
    """The fixed exclusion rule for one top-level entry of the model folder.

    Another version's entry is left out even when it is a symlink: that
    version's own verification reports the link. With ``own_config`` (the
    version carries its own configuration) the model's ``config.pbtxt`` is left
    out when it is a regular file (a link is still reported).
    """
    if name in DEFAULT_EXCLUSIONS:
        return True
    if own_config and name == CONFIG and is_file:
        return True
    if (is_dir or is_link) and is_version_name(name) and int(name) != version:
        return True
    return is_file and is_signature_name(name)


def outside_unit(relpath: str, version: int) -> bool:
    """True for a path the rule leaves out of ``version``'s unit (another version, a signature file)."""
    parts = relpath.split("/")
    if parts[0] in DEFAULT_EXCLUSIONS:
        return True
    if is_version_name(parts[0]) and int(parts[0]) != version:
        return True
    return len(parts) == 1 and is_signature_name(parts[0])


@dataclass(frozen=True)
class UnitScan:
    """The content of one model version's unit, as found on disk.

    ``files`` and ``empty_dirs`` are POSIX paths relative to the model folder,
    sorted. ``problems`` name what cannot be signed or trusted (symlinks,
    special files, unreadable folders, odd version names).
    """

    files: tuple[str, ...]
    empty_dirs: tuple[str, ...]
    problems: tuple[str, ...]
    not_regular: tuple[str, ...] = ()  # symlinks and special files (named in ``problems``)


def _kind(mode: int) -> str:
    for test, word in ((stat.S_ISFIFO, "a fifo"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return word
    return "a special file"


def scan_unit(model_dir: Path, version: int) -> UnitScan:
    """Walk the unit of ``version`` in ``model_dir`` without following symlinks."""
    model_dir = Path(model_dir)
    files: list[str] = []
    empty: list[str] = []
    problems: list[str] = []
    not_regular: list[str] = []

    def walk(folder: Path, rel: PurePosixPath | None) -> int:
        """Add the folder's content; returns how many entries it had in the unit."""
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as exc:
            problems.append(f"cannot read folder {rel or '.'}: {exc.strerror or exc}")
            return 1
        count = 0
        for entry in entries:
            child = PurePosixPath(entry.name) if rel is None else rel / entry.name
            try:
                entry.name.encode("utf-8")
            except UnicodeEncodeError:
                # A signature names files in JSON (UTF-8): such a name cannot be signed faithfully.
                problems.append(f"{str(child)!a} has a name that is not valid UTF-8; rename it")
                not_regular.append(str(child))
                count += 1
                continue
            st = entry.stat(follow_symlinks=False)
            is_dir, is_file = stat.S_ISDIR(st.st_mode), stat.S_ISREG(st.st_mode)
            if rel is None and excluded_top_level(entry.name, is_dir, is_file, version,
                                                  stat.S_ISLNK(st.st_mode), own_config):
                continue
            count += 1
            if not (is_dir or is_file):
                not_regular.append(str(child))
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(entry.path)
                problems.append(f"{child} is a symlink (to {target}); symlinks are never signed or followed")
            elif is_dir:
                if rel is None and _NUMERIC.match(entry.name) and not is_version_name(entry.name):
                    problems.append(f"folder {child} looks like a model version with a non-canonical number; "
                                    f"rename it to {int(entry.name)} or remove it")
                if walk(Path(entry.path), child) == 0:
                    empty.append(str(child))
            elif is_file:
                files.append(str(child))
            else:
                problems.append(f"{child} is {_kind(st.st_mode)}, not a regular file")
        return count

    if os.path.islink(model_dir):
        problems.append(f"the model folder {model_dir.name} is a symlink; symlinks are never signed or followed")
    else:
        own_config = carries_own_config(model_dir, version)
        walk(model_dir, None)
    return UnitScan(tuple(sorted(files)), tuple(sorted(empty)), tuple(problems), tuple(sorted(not_regular)))


def other_version_ignores(model_dir: Path, version: int) -> list[str]:
    """The ``ignore_paths`` of one version's signature: what the unit leaves out.

    OMS v1.0's default exclusions, the other version folders, every
    signature file, present or to come, and the model's ``config.pbtxt`` when
    the version carries its own. model_signing honours them when it verifies;
    our verifier applies the same rule from :func:`scan_unit`.
    """
    entries = model_entries(model_dir)
    names = {f"{version}{SIGNATURE_SUFFIX}", f"{version}{PROVENANCE_SUFFIX}", *DEFAULT_EXCLUSIONS}
    if carries_own_config(model_dir, version):
        names.add(CONFIG)
    for k in entries.versions:
        names.update({f"{k}{SIGNATURE_SUFFIX}", f"{k}{PROVENANCE_SUFFIX}"})
        if k != version:
            names.add(str(k))
    with os.scandir(model_dir) as it:
        names.update(e.name for e in it if e.is_file(follow_symlinks=False) and is_signature_name(e.name))
    return sorted(names)
