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


def test_one_reader_per_file_reads_each_file_once_and_puts_the_reader_back(tmp_path: Path) -> None:
    """Converting a GGUF reads its metadata four times (the header, transformers' config, weights and tokenizer):
    inside ``one_reader_per_file`` each file gets one reader, the same object each time, and outside it
    ``gguf.GGUFReader`` is gguf-py's class again."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from model_factory.recipe.gguf import one_reader_per_file

    files = []
    for name in ("a.gguf", "b.gguf"):
        writer = gguf.GGUFWriter(str(tmp_path / name), "llama")
        writer.add_uint32("test.value", len(files))
        writer.add_tensor("w", np.zeros((2, 4), np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        files.append(tmp_path / name)
    original = gguf.GGUFReader
    with one_reader_per_file():
        from gguf import GGUFReader  # as transformers imports it, at call time

        first, again, other = GGUFReader(str(files[0])), gguf.GGUFReader(files[0]), gguf.GGUFReader(str(files[1]))
        assert first is again and other is not first
        assert int(first.fields["test.value"].parts[-1][0]) == 0 and int(other.fields["test.value"].parts[-1][0]) == 1
        assert [t.name for t in first.tensors] == ["w"]
    assert gguf.GGUFReader is original and isinstance(gguf.GGUFReader(str(files[0])), original)
