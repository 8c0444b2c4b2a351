"""One packaged model version, as the report reads it: its folder, metadata.json and files.

Everything here is read from the repository as it is on disk; nothing is rebuilt or
recomputed except the sizes of the files (``metadata.json`` records their digests).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from model_factory.errors import FactoryError

METADATA_FILE = "metadata.json"  # model_factory.build.repository.METADATA_FILE (not imported: no protobuf needed)


@dataclass(frozen=True)
class FileEntry:
    """One file of a version folder (``../config.pbtxt`` for the model folder's files)."""

    path: str
    size: int | None  # None when the file is missing on disk
    sha256: str | None  # as metadata.json records it


@dataclass(frozen=True)
class Release:
    """A model version in a repository."""

    repo: Path
    model: str
    version: int
    model_dir: Path
    version_dir: Path
    metadata: Mapping[str, Any]
    files: tuple[FileEntry, ...]

    @property
    def title(self) -> str:
        return f"{self.model} v{self.version}"

    @property
    def total_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files)

    def read_json(self, name: str) -> Any:
        """A JSON file of the version folder, or None when it is not there."""
        path = self.version_dir / name
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise FactoryError(f"cannot read {path}: {exc}. Fix: rebuild the version, or restore the file") from exc


def model_names(repo: Path) -> list[str]:
    """Model folders in ``repo`` (those holding a config.pbtxt; hidden staging folders are not)."""
    from model_factory.build.repository import discover_models

    if not repo.is_dir():
        raise FactoryError(f"model repository {repo} does not exist. Fix: pass the folder model-factory build wrote")
    return discover_models(repo)


def version_numbers(model_dir: Path) -> list[int]:
    """The canonical version folders of a model, lowest first."""
    from model_factory.signing.layout import is_version_name

    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and is_version_name(p.name))


def read_release(repo: Path, model: str, version: int) -> Release:
    """The version ``version`` of ``model`` in ``repo``."""
    model_dir = Path(repo) / model
    vdir = model_dir / str(version)
    meta_path = vdir / METADATA_FILE
    if not meta_path.is_file():
        raise FactoryError(f"{meta_path} is missing: {model}/{version} was not packaged by model-factory. Fix: "
                           "build it with model-factory build (or package)")
    try:
        metadata = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise FactoryError(f"cannot read {meta_path}: {exc}. Fix: rebuild the version") from exc
    digests = dict(metadata.get("files") or {})
    names = set(digests)
    # Files on disk that metadata.json does not list (it cannot list itself) are shown too.
    names |= {p.relative_to(vdir).as_posix() for p in vdir.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    entries = []
    for name in sorted(names):
        path = (vdir / name).resolve() if not name.startswith("../") else model_dir / name[3:]
        entries.append(FileEntry(name, path.stat().st_size if path.is_file() else None, digests.get(name)))
    return Release(Path(repo), model, int(version), model_dir, vdir, metadata, tuple(entries))


def find_releases(repo: Path, model: str | None = None) -> list[Release]:
    """Every version of ``model`` (or of every model) in ``repo``."""
    repo = Path(repo)
    names = model_names(repo)
    if model is not None:
        if model not in names:
            raise FactoryError(f"{repo} has no model {model!r} (it has {', '.join(names) or 'none'}). Fix: name one "
                               "of those with --model")
        names = [model]
    if not names:
        raise FactoryError(f"{repo} holds no model folder with a config.pbtxt. Fix: run model-factory build first")
    releases = [read_release(repo, m, v) for m in names for v in version_numbers(repo / m)]
    if not releases:
        raise FactoryError(f"{repo} has no version folder for {', '.join(names)}. Fix: run model-factory build first")
    return releases


def latest_release(repo: Path, model: str) -> Release | None:
    """The highest version of ``model`` in ``repo`` (what ``--against`` compares with), or None."""
    model_dir = Path(repo) / model
    if not (model_dir / "config.pbtxt").is_file():
        return None
    versions = version_numbers(model_dir)
    return read_release(Path(repo), model, versions[-1]) if versions else None
