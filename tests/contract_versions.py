"""Versions of the session's MiniLM packaged for data-contract tests: a rebuild, a retrained tokenizer, other
limits (tests/build/test_data_contract.py, and the report's --against in tests/measure)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path


def package_version(recipe, export, root: Path, tokenizer_dir=None, **shapes) -> Path:
    """Package the export into ``root`` (a repository) as ``build`` would; returns the version folder."""
    from model_factory.build.repository import package_model

    recipe = dataclasses.replace(recipe, repository=dataclasses.replace(recipe.repository, path=root),
                                 shapes=dataclasses.replace(recipe.shapes, **shapes) if shapes else recipe.shapes)
    package_model(recipe, {"model.onnx": export.onnx_path}, tokenizer_dir=tokenizer_dir or export.tokenizer_dir,
                  parameters={"cost_model": "0.002,8e-5,4e-7"})  # MiniLM's on 2 cores (conftest.MINILM_COST)
    return root / recipe.name / str(recipe.version)


def retrained_tokenizer(tokenizer_dir: Path, dst: Path) -> Path:
    """The tokenizer with two frequent word pieces swapped: same file shape, other ids for the same text."""
    shutil.copytree(tokenizer_dir, dst)
    path = dst / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    vocab["guitar"], vocab["playing"] = vocab["playing"], vocab["guitar"]
    path.write_text(json.dumps(data))
    return dst
