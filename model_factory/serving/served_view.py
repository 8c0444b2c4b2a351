"""The model repository Triton reads: a copy of the served models, without their signature files.

``serve`` verifies the repository it is given, then points Triton at a folder of its own
(``<work>/repository``) holding, per served model, the files Triton and the backend read: ``config.pbtxt``
and the other files beside it, and each version folder its loads name, copied from the repository (a reflink
where the file system has them: btrfs, XFS). The backend still checks each file it loads against the verified
digests (``backend/integrity.py``). Triton does the same with a repository in cloud storage: it copies each
model to a local folder before it loads it.

Why a folder of our own: so that a served version can stay loaded while another one is loaded beside it.
Triton 2.51 keeps a served version through a new load of its model (only its configuration updated) when
nothing it covers changed since its load: its version folder, and every file at the model's level other than
``config.pbtxt``, each compared by the later of its modification and status-change times
(``ModelTimestamp::IsModelVersionModified`` and ``LocalFileSystem::FileModificationTime`` in Triton's core;
the configuration may differ only in the version policy and the instance groups). In the repository, a new
version changes both for the previous one: signing writes files at the model's level (``K.sig``, and the
previous version's signature again), and packaging links every file of the other versions into the new model
folder (a new link changes a file's status-change time, for every name it has). So a rollout's switch
reloaded the previous version too, and an undo reloaded it once more. Here the signature files are left out
(Triton never reads them), the files are copies (hard links would share the repository's status changes), and
two more things keep a loaded version's folder untouched:

* a file is replaced (through a rename) only when it differs from the repository's: another size, or another
  modification time and, for a file of at most 1 MiB, other bytes;
* each version folder holds a plain file named ``__pycache__``: Triton's stub imports ``<version>/model.py``
  and writes its bytecode cache beside it whatever ``PYTHONDONTWRITEBYTECODE`` says (and our ``model.py``
  deletes that cache at once), which changed the folder at every load; with a file of that name in the way,
  Python writes no cache.

Version folders that left the repository (``pull`` replaces a model folder with the version it brings) stay
here, so a version still loaded can be loaded again within a rollout's grace period; a load checks their bytes
against the digests verified when they served, like any other.

Of a version's weight files only those its loads read are copied (:func:`read_precisions`, from the model's
configuration): the served precision's, a ``degrade_to`` or ``speculative_draft`` precision's, and for encoders the
FP32 files their engines may read beside (INT8's fallback, the torch program); a text-generation model reads its
served graph alone (and its draft's). A version packaged with every precision (``keep_all_precisions``: FP32, FP16,
INT8 and INT4 of an LLM) is no longer copied whole into the temporary folder.

The price: the loaded versions take their size again on the disk of the temporary folder (``TMPDIR``), and a
version is copied once before its first load (MiniLM's 89 MB: about 0.4 s here). The copy lives in the server's work
folder: a server killed outright leaves it behind until the next server starts (``work_folders.py``).
"""

from __future__ import annotations

import filecmp
import fcntl
import os
import shutil
import stat
from pathlib import Path

from typing import Mapping

from model_factory.backend.contract import TEXT_GENERATION, file_precision
from model_factory.errors import FactoryError
from model_factory.signing.layout import DEFAULT_EXCLUSIONS, is_signature_name, is_version_name

PYCACHE_BLOCKER = "__pycache__"
_COMPARE_BYTES_UP_TO = 1 << 20
_FICLONE = 0x40049409  # linux/fs.h: share the source's blocks, copy on write


def _same(src: Path, src_st: os.stat_result, dst: Path, dst_st: os.stat_result) -> bool:
    if src_st.st_size != dst_st.st_size:
        return False
    if src_st.st_mtime_ns == dst_st.st_mtime_ns:  # our copy of it (copies keep the modification time)
        return True
    return src_st.st_size <= _COMPARE_BYTES_UP_TO and filecmp.cmp(src, dst, shallow=False)  # rewritten alike


def _copy(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` with its modification time: a reflink where the file system has them.

    Elsewhere the bytes, and a hole in ``src`` (a sparse weight file's unused rows) stays a hole in the
    copy: a copy written densely would take the file's whole size on disk again.
    """
    from model_factory.backend.integrity import copy_sparse

    with open(src, "rb", buffering=0) as fin, open(dst, "wb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), _FICLONE, fin.fileno())
        except OSError:  # ext4, tmpfs, another file system: bytes (a file that shrank meanwhile is refused by
            copy_sparse(fin, fout)  # the backend's digest check)
    shutil.copystat(src, dst)


def _place(src: Path, dst: Path) -> None:
    """Make ``dst`` a copy of ``src``, replacing it through a rename."""
    tmp = dst.with_name(f".{dst.name}.mf-tmp")
    tmp.unlink(missing_ok=True)
    _copy(src, tmp)
    os.replace(tmp, dst)


def read_precisions(parameters: Mapping[str, str]) -> frozenset[str] | None:
    """The precisions whose weight files a model's loads read, from its configuration's parameters (name ->
    string value), or None (every file) for a package that names no precision."""
    precision = parameters.get("precision")
    if not precision:
        return None
    read = {precision}
    if parameters.get("task") != TEXT_GENERATION:
        read.add("fp32")  # an encoder's engines may read FP32 files beside (INT8's float fallback, the torch program)
    if parameters.get("degrade_to"):
        read.add(parameters["degrade_to"])
    if parameters.get("speculative_draft", "none") != "none":  # speculative decoding's draft graph
        read.add(parameters["speculative_draft"])
    for key in ("onnx_file", "plan_file", "torchscript_file"):
        named = file_precision(parameters.get(key) or "")
        if named:
            read.add(named)
    return frozenset(read)


def _sync_tree(src: Path, dst: Path, *, top: bool, precisions: frozenset[str] | None = None) -> None:
    """Make the folder ``dst`` hold the regular files of ``src`` (recursively). At ``top`` (a model folder)
    version folders, signature files and OMS's default exclusions are skipped; below it, ``__pycache__``
    entries are left alone (never signed; one is ours). With ``precisions``, weight files of other precisions
    (``contract.file_precision``) are skipped."""
    dst.mkdir(parents=True, exist_ok=True)
    wanted: set[str] = set()
    with os.scandir(src) as it:
        entries = list(it)
    for entry in entries:
        name = entry.name
        if top and (name.isdigit() or is_signature_name(name) or name in DEFAULT_EXCLUSIONS):
            continue  # version folders (a non-canonical one, "01", is never served: verification reports it)
        if name == PYCACHE_BLOCKER:
            continue
        if precisions is not None and file_precision(name) not in (None, *precisions):
            continue  # another precision's weights: no load reads them
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            wanted.add(name)
            _sync_tree(Path(entry.path), dst / name, top=False)
        elif stat.S_ISREG(st.st_mode):
            wanted.add(name)
            target = dst / name
            try:
                if _same(Path(entry.path), st, target, target.stat(follow_symlinks=False)):
                    continue
            except FileNotFoundError:
                pass
            _place(Path(entry.path), target)
        # links and special files are not served (verification reports them)
    with os.scandir(dst) as it:
        present = list(it)
    for entry in present:
        name = entry.name
        if name in wanted or name == PYCACHE_BLOCKER or (top and name.isdigit()):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)


def policy_versions(policy: dict | None, available: list[int]) -> list[int]:
    """The versions a Triton ``version_policy`` (JSON form) loads out of the ``available`` version folders:
    ``specific`` names them, ``latest`` takes the highest ``num_versions``, ``all`` every one; none: the latest."""
    policy = policy or {}
    if "specific" in policy:
        return sorted({int(v) for v in (policy["specific"] or {}).get("versions", [])})
    if "all" in policy:
        return sorted(available)
    n = int((policy.get("latest") or {}).get("num_versions", 1))
    return sorted(available)[-n:] if n > 0 else []


def sync_model(repository: Path, served: Path, model: str, policy: dict | None = None,
               precisions: frozenset[str] | None = None) -> Path:
    """Bring ``served/model`` in line with ``repository/model`` for the versions ``policy`` (a Triton
    ``version_policy``, JSON form) loads (see the module docstring); return it. Other versions are not copied,
    nor, with ``precisions`` (:func:`read_precisions`), other precisions' weight files."""
    src, dst = Path(repository) / model, Path(served) / model
    try:
        _sync_tree(src, dst, top=True)
        with os.scandir(src) as it:
            folders = {int(e.name): e for e in it if is_version_name(e.name) and e.is_dir(follow_symlinks=False)}
        wanted = set(policy_versions(policy, list(folders)))
        versions = [folders[v] for v in sorted(folders) if v in wanted]
        for entry in versions:
            folder = dst / entry.name
            _sync_tree(Path(entry.path), folder, top=False, precisions=precisions)
            blocker = folder / PYCACHE_BLOCKER
            if not blocker.is_file():
                if blocker.is_dir():
                    shutil.rmtree(blocker)
                blocker.write_bytes(b"")
    except OSError as exc:
        raise FactoryError(f"cannot lay out {model} for the server in {dst}: {exc}. Fix: free disk space or "
                           "check the permissions of the temporary folder (TMPDIR)") from exc
    return dst


def sync_adapter(repository: Path, served: Path, adapter: str, version: int) -> Path:
    """Bring LoRA adapter entry ``adapter``'s ``version`` into ``served`` as the version its base's next load finds
    (``lora_contract.adapter_entries`` takes an entry's newest version holding ``adapter.json``): a newer version
    folder there (one an undone rollout served) keeps its other files, since a stub loaded before may still read its
    weights, but loses its ``adapter.json``, so no load finds it. A rollout of the adapter sets ``version``."""
    from model_factory.backend.lora_contract import ADAPTER_SPEC

    dst = sync_model(repository, served, adapter, {"specific": {"versions": [int(version)]}})
    for folder in dst.iterdir():
        if is_version_name(folder.name) and int(folder.name) > int(version):
            (folder / ADAPTER_SPEC).unlink(missing_ok=True)
    return dst


def mark_changed(served: Path, model: str, version: int) -> None:
    """Make Triton's next load of ``model`` load ``version`` again though none of its files changed (its adapters
    did): the version folder's newest time moved to now (Triton 2.51 reloads a loaded version whose folder changed
    since its load, in the background: the loaded one serves until the new one is ready)."""
    import time

    folder = Path(served) / model / str(int(version))
    blocker = folder / PYCACHE_BLOCKER
    if not blocker.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        blocker.write_bytes(b"")
    # Past every time in the folder by a millisecond at least (the kernel's clock for file times is coarse).
    newest = max((max(st.st_mtime_ns, st.st_ctime_ns) for st in (p.stat() for p in [folder, *folder.rglob("*")])),
                 default=0)
    moved = max(time.time_ns(), newest + 1_000_000)
    os.utime(blocker, ns=(moved, moved))
