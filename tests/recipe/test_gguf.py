"""A GGUF source in the recipe (model_factory/recipe/gguf.py): what is refused before any build, and how."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from model_factory.errors import FactoryError
from model_factory.recipe import parse_recipe


def _data(path: str) -> dict:
    return {"precisions": ["fp32"], "model": {"name": "m", "task": "text-generation"},
            "source": {"kind": "gguf", "path": path}}


def test_a_file_that_is_not_a_gguf_names_the_field_and_the_fix(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"\x00\x01 safetensors, say")
    with pytest.raises(FactoryError) as err:
        parse_recipe(_data("model.gguf"), tmp_path)
    assert str(err.value).startswith("recipe field 'source.path': ") and "is not a GGUF file" in str(err.value)
    assert "Fix: point it at a .gguf file" in str(err.value)


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FactoryError, match="does not exist. Fix: point it at an existing .gguf file"):
        parse_recipe(_data("absent.gguf"), tmp_path)


def test_without_the_gguf_package_the_message_names_the_extra(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "model.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    with pytest.raises(FactoryError, match=r"pip install 'model-factory\[gguf\]'"):
        parse_recipe(_data("model.gguf"), tmp_path)


def test_a_truncated_gguf_is_refused_not_crashed(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    (tmp_path / "model.gguf").write_bytes(b"GGUF\x03\x00\x00\x00\x05")
    with pytest.raises(FactoryError, match="is not a readable GGUF"):
        parse_recipe(_data("model.gguf"), tmp_path)


def test_gguf_precision_is_refused_on_another_source(tmp_path: Path) -> None:
    (tmp_path / "m.onnx").write_bytes(b"")
    data = {"precisions": ["fp32", "gguf"], "model": {"name": "m", "task": "text-generation"},
            "source": {"kind": "onnx", "path": "m.onnx"}}
    with pytest.raises(FactoryError, match="recipe field 'precisions': gguf carries a GGUF's own quantized blocks"):
        parse_recipe(data, tmp_path)
