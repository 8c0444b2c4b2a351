"""Packaging a prompt template as its own model version, and what ``contract diff`` says about two of them.

A prompt recipe (:mod:`model_factory.recipe.prompt`) becomes a model of the repository like any other::

    <repo>/<prompt>/config.pbtxt            python backend, task "prompt", base "<model>", one CPU instance
    <repo>/<prompt>/<v>/prompt.json         the definition: system, template, fields, schema, defaults, the base
                                            pinned by the digests of its generation.json and tokenizer
    <repo>/<prompt>/<v>/model.py, mf_backend/, config.pbtxt, contract.json, metadata.json

signed (``sign``: the staged folder, as every build signs), so ``verify`` covers it, ``serve`` verifies it and the
backend refuses a ``prompt.json`` changed after that (``backend/prompt_model.py``); released and rolled out as any
version. The base must be a text-generation model of the same repository, at the version the recipe names.

Its ``contract.json`` carries a ``prompt`` section, and ``contract diff`` names what changed between two versions
(``build/prompt_contract.py``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping

from model_factory.backend.contract import (PROMPT, PROMPT_BASE_PARAMETER, PROMPT_INPUT, PROMPT_OUTPUT,
                                            TEXT_GENERATION, Files)
from model_factory.build.repository import PackageResult, _copy_backend, config_parameters, config_to_pbtxt, read_config
from model_factory.errors import FactoryError
from model_factory.fileio import atomic_dir, remove_stale_staging
from model_factory.locking import exclusive
from model_factory.recipe.prompt import PromptRecipe

# What of the base the prompt depends on: its chat template (generation.json) and its tokenizer.
BASE_FILES = (Files.GENERATION, f"{Files.TOKENIZER_DIR}/{Files.TOKENIZER_JSON}")
_STRING = 13  # TYPE_STRING


def prompt_config_dict(recipe: PromptRecipe) -> dict[str, Any]:
    """``config.pbtxt`` of a prompt in Triton's JSON form: one optional input, its definition out."""
    return {
        "name": recipe.name, "backend": "python", "max_batch_size": 0,
        "input": [{"name": PROMPT_INPUT, "data_type": _STRING, "dims": [1], "optional": True}],
        "output": [{"name": PROMPT_OUTPUT, "data_type": _STRING, "dims": [1]}],
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
        "parameters": {"task": {"string_value": PROMPT},
                       PROMPT_BASE_PARAMETER: {"string_value": recipe.base_model}},
        "version_policy": {"specific": {"versions": [recipe.version]}},
    }


def base_digests(repository: Path, model: str, version: int) -> dict[str, str]:
    """The digests of the base version's files a prompt depends on, the base checked to be a text-generation model
    of ``repository``."""
    model_dir = Path(repository) / model
    vdir = model_dir / str(version)
    if not vdir.is_dir():
        raise FactoryError(f"recipe field 'base': {vdir} does not exist. Fix: build the base model into this "
                           "repository first, or name a model and version it holds")
    task = config_parameters(read_config(model_dir)).get("task")
    if task != TEXT_GENERATION:
        raise FactoryError(f"recipe field 'base.model': {model} is a {task or 'encoder'} model, not text-generation. "
                           "Fix: name a text-generation model of the repository")
    out = {}
    for rel in BASE_FILES:
        if (vdir / rel).is_file():
            out[rel] = hashlib.sha256((vdir / rel).read_bytes()).hexdigest()
    if Files.GENERATION not in out:
        raise FactoryError(f"recipe field 'base.version': {vdir} has no {Files.GENERATION}. Fix: rebuild the base "
                           "with this model-factory")
    return out


def package_prompt(recipe: PromptRecipe, sign: Callable[[Path], Any] | None = None) -> PackageResult:
    """Lay out ``<repo>/<prompt>/<version>`` (other versions kept, as every package keeps them), signed while staged
    when ``sign`` is given."""
    from model_factory.build.data_contract import write_contract

    definition = recipe.definition(base_digests(recipe.repository, recipe.base_model, recipe.base_version))
    pbtxt = config_to_pbtxt(prompt_config_dict(recipe))
    model_dir = recipe.repository / recipe.name
    version = str(recipe.version)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(model_dir, f"packaging or signing of {recipe.name}"):
        remove_stale_staging(model_dir.parent, model_dir.name)
        with atomic_dir(model_dir) as tmp:
            if model_dir.is_dir():
                for entry in model_dir.iterdir():
                    if entry.name == Files.CONFIG or entry.name == version or entry.name.startswith(f"{version}."):
                        continue
                    if entry.is_dir():
                        shutil.copytree(entry, tmp / entry.name, symlinks=True)
                    else:
                        shutil.copyfile(entry, tmp / entry.name)
            (tmp / Files.CONFIG).write_text(pbtxt)
            vdir = tmp / version
            vdir.mkdir()
            _copy_backend(vdir)
            (vdir / Files.PROMPT).write_text(json.dumps(definition, indent=2, sort_keys=True, ensure_ascii=False)
                                             + "\n", encoding="utf-8")
            (vdir / Files.CONFIG).write_text(pbtxt)
            write_contract(pbtxt, vdir)
            files = {p.relative_to(vdir).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                     for p in sorted(vdir.rglob("*")) if p.is_file()}
            metadata = {"model": recipe.name, "version": recipe.version, "task": PROMPT,
                        "base": {"model": recipe.base_model, "version": recipe.base_version},
                        "recipe": recipe.recipe_path.name if recipe.recipe_path else None, "files": files}
            (vdir / Files.METADATA).write_text(json.dumps(metadata, indent=2, sort_keys=True))
            if sign is not None:
                sign(tmp)
    return PackageResult(model_dir, model_dir / version, model_dir / Files.CONFIG, metadata)


def prompt_provenance(recipe: PromptRecipe, definition: Mapping[str, Any]) -> dict[str, Any]:
    """The signed provenance statement's facts (``signing.BuildProvenance`` keys) for a prompt: its source is its base,
    pinned by the digest of the base digests it records (so a policy that requires provenance serves it too)."""
    import datetime as dt

    from model_factory.build.repository import tool_versions

    base = json.dumps(definition["base"], sort_keys=True).encode()
    return {"source_model_digest": hashlib.sha256(base).hexdigest(),
            "source_model": f"{recipe.base_model}/{recipe.base_version}", "recipe": dict(recipe.raw),
            "tool_versions": tool_versions(), "precisions": [],
            "finished_on": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            **({"recipe_path": str(recipe.recipe_path)} if recipe.recipe_path else {})}


def build_prompt(recipe: PromptRecipe, signer: Any = None) -> PackageResult:
    """Package (and, with ``signer``, a ``signing.SignerConfig``, sign with its provenance) a prompt recipe:
    ``model-factory build``."""
    sign = None
    if signer is not None:
        from model_factory.signing import sign_model_version

        def sign(staged: Path) -> Path:
            definition = json.loads((staged / str(recipe.version) / Files.PROMPT).read_text(encoding="utf-8"))
            return sign_model_version(staged, recipe.version, signer,
                                      provenance=prompt_provenance(recipe, definition))
    return package_prompt(recipe, sign)
