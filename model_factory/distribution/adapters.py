"""A LoRA adapter entry through a registry: pushed as any signed version, pulled only onto the base it was built on.

An adapter entry (``lora_contract``: ``<adapter>/<v>/adapter.json`` and ``adapter.npz``, no ``config.pbtxt``) is a
signed version like a model's, so ``push`` sends it and ``pull`` verifies it as one. Its ``adapter.json`` ties it to
the bytes of one base version (the sha256 of its graphs, their weights and ``generation.json``): ``pull`` installs it
only where DEST holds that base version with those bytes, and refuses it by name otherwise, before DEST changes. The
serving stub checks the same digests again at load (``generation/lora.py``).
"""

from __future__ import annotations

from pathlib import Path

from model_factory.backend.lora_contract import ADAPTER_SPEC, AdapterSpec, file_sha256
from model_factory.errors import FactoryError


def is_adapter_entry(model_dir: Path) -> bool:
    """Whether ``model_dir`` is a LoRA adapter entry (a version folder holding ``adapter.json``, no ``config.pbtxt``)."""
    model_dir = Path(model_dir)
    return not (model_dir / "config.pbtxt").is_file() and any(model_dir.glob(f"*/{ADAPTER_SPEC}"))


def base_problem(version_dir: Path, repository: Path) -> str | None:
    """Why the adapter version at ``version_dir`` cannot go into ``repository`` (its base absent, or there with other
    bytes), else None."""
    spec = AdapterSpec.from_json((Path(version_dir) / ADAPTER_SPEC).read_text())
    base_dir = Path(repository) / spec.base / str(spec.base_version)
    if not base_dir.is_dir():
        return (f"adapter {spec.name} version {spec.version} was built for {spec.base} version {spec.base_version}, "
                f"which {repository} does not hold. Fix: pull that base version first, then the adapter")
    wrong = sorted(rel for rel, sha in spec.base_digests.items()
                   if not (base_dir / rel).is_file() or file_sha256(base_dir / rel) != sha)
    if not wrong and spec.base_digests:
        return None
    return (f"adapter {spec.name} version {spec.version} was built for {spec.base} version {spec.base_version} whose "
            f"{', '.join(wrong) or 'files'} differ{'s' if len(wrong) == 1 else ''} from {base_dir}: it is another base. "
            f"Fix: pull the base version the adapter was built on, or rebuild the adapter against this base")


def check_base(version_dir: Path, repository: Path) -> None:
    """FactoryError naming the adapter and its base when :func:`base_problem` finds one."""
    problem = base_problem(version_dir, repository)
    if problem:
        raise FactoryError(problem)
