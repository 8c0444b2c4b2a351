"""A LoRA adapter's build: the check stage (``build_engines/lora.py``), then its own versioned, signed entry.

::

    <repo>/<adapter>/<v>/adapter.json      lora_contract.AdapterSpec: the base's name, version and digests
    <repo>/<adapter>/<v>/adapter.npz       the graph's pairs (A [in, r], B [r, out], scaling folded in)
    <repo>/<adapter>/<v>/accuracy.json     the check and the gate (greedy vs transformers + peft, held-out text)
    <repo>/<adapter>/<v>/metadata.json     what was built from what (the adapter's source digest, tool versions)

No ``config.pbtxt``: the entry is not a Triton model. ``serve`` verifies it like every version (its signature, the
release policy) and its base's stub loads it (``generation/lora.py``), after checking that the base it serves has
the digests ``adapter.json`` names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from model_factory.backend.lora_contract import ADAPTER_SPEC, ADAPTER_WEIGHTS
from model_factory.errors import FactoryError

ACCURACY = "accuracy.json"
METADATA = "metadata.json"


@dataclass(frozen=True)
class AdapterBuild:
    """The packaged adapter: its model folder, version folder, signature (or None) and check report."""

    model_dir: Path
    version_dir: Path
    signature: Path | None
    report: dict


def build_adapter(recipe: Any, *, signer: Any = None, progress: Callable[[str], None] | None = None,
                  isolate: bool = False, sandbox: str = "auto") -> AdapterBuild:
    """Check ``recipe``'s adapter on its base (in a walled child process with ``isolate``), package it as
    ``<repository>/<name>/<version>`` and sign it with ``signer`` (a ``SignerConfig``) before it goes live."""
    from model_factory.build.pipeline import run_stage
    from model_factory.build_engines.lora import check_adapter
    from model_factory.locking import exclusive

    if not recipe.is_adapter:
        raise FactoryError(f"{recipe.name} is not a LoRA adapter recipe. Fix: set source.kind = \"lora\" and an "
                           "[adapter] table, or build it with model-factory build")
    say = progress or (lambda _m: None)
    with exclusive(recipe.work_dir, f"a build of {recipe.name}"):
        out = Path(recipe.work_dir) / "adapter"
        if isolate:
            checked = run_stage(recipe, "adapter", check_adapter, recipe, out, progress=say, sandbox=sandbox)
        else:
            checked = check_adapter(recipe, out, progress=say)
        return _package(recipe, checked, signer, say)


def _package(recipe: Any, checked: Any, signer: Any, say: Callable[[str], None]) -> AdapterBuild:
    import shutil

    from model_factory.build.repository import tool_versions
    from model_factory.build_engines.causal_lm import source_digest
    from model_factory.build_engines.onnx_files import hardlink_or_copy
    from model_factory.fileio import atomic_dir, remove_stale_staging

    repo = Path(recipe.repository.path)
    model_dir = repo / recipe.name
    if (model_dir / "config.pbtxt").exists():
        raise FactoryError(f"{model_dir} is a Triton model, not an adapter entry. Fix: give the adapter a name of its "
                           "own (model.name)")
    if model_dir.name == recipe.adapter.name:
        raise FactoryError(f"the adapter is named {recipe.name}, as its base. Fix: give it a name of its own")
    version = str(recipe.version)
    digest = source_digest(Path(recipe.source.path))
    remove_stale_staging(repo, recipe.name)
    with atomic_dir(model_dir) as tmp:
        if model_dir.is_dir():  # other versions (and their signatures) kept; everything of this version rebuilt
            for entry in model_dir.iterdir():
                if entry.name == version or entry.name.startswith(f"{version}."):
                    continue
                if entry.is_dir():
                    shutil.copytree(entry, tmp / entry.name, copy_function=hardlink_or_copy, symlinks=True)
                else:
                    hardlink_or_copy(str(entry), str(tmp / entry.name))
        vdir = tmp / version
        vdir.mkdir()
        (vdir / ADAPTER_SPEC).write_text(checked.spec.to_json())
        shutil.copyfile(checked.weights, vdir / ADAPTER_WEIGHTS)
        (vdir / ACCURACY).write_text(json.dumps(checked.report, indent=2, sort_keys=True) + "\n")
        (vdir / METADATA).write_text(json.dumps({
            "name": recipe.name, "version": recipe.version, "kind": "lora-adapter",
            "base": {"name": checked.spec.base, "version": checked.spec.base_version},
            "source_digest": digest, "tools": tool_versions()}, indent=2, sort_keys=True) + "\n")
        if signer is not None:
            from model_factory.build.pipeline import provenance_for
            from model_factory.signing import sign_model_version

            # Signed while staged (the staged folder bears the model's name): never live unsigned.
            sign_model_version(tmp, recipe.version, signer,
                               provenance=provenance_for(recipe, {"source_digest": digest}, checked.report))
    version_dir = model_dir / version
    signature = None
    if signer is not None:
        from model_factory.signing.layout import signature_path

        signature = signature_path(model_dir, recipe.version)
    say(f"[package] {version_dir}: adapter of {checked.spec.base} version {checked.spec.base_version}"
        + (", signed" if signature is not None else ""))
    return AdapterBuild(model_dir, version_dir, signature, checked.report)
