"""Export stage: HF folder, torch factory and ONNX sources, checked against the source framework."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import pytest

from model_factory.build_engines.export import export_model, onnxruntime_session
from model_factory.errors import FactoryError
from model_factory.recipe import parse_recipe

TINY_FACTORY = '''
import torch


class Scale(torch.nn.Module):
    def __init__(self, noisy=False):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)
        self.noisy = noisy

    def forward(self, x):
        y = self.proj(x).sum(dim=1)
        if self.noisy:
            # Random numbers differ between eager torch and the exported graph: a bad export.
            y = y + torch.rand_like(y)
        return y


def make():
    torch.manual_seed(0)
    return Scale(), {"x": torch.randn(2, 5, 4)}


def make_noisy():
    torch.manual_seed(0)
    return Scale(noisy=True), {"x": torch.randn(2, 5, 4)}


def make_wrong():
    return Scale()
'''


def torch_recipe(tmp_path: Path, factory: str) -> dict:
    return {"model": {"name": "tiny", "task": "generic"},
            "source": {"kind": "torch", "factory": factory},
            "inputs": [{"name": "x", "dtype": "FP32", "dims": [-1, 4]}],
            "outputs": [{"name": "y", "dtype": "FP32", "dims": [3]}],
            "shapes": {"max_batch": 4, "max_sequence_length": 16, "sequence_buckets": [16]}}


@pytest.fixture
def factory_module(tmp_path: Path, monkeypatch) -> str:
    name = f"tiny_factory_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(TINY_FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_hf_export_matches_torch_with_dynamic_axes(minilm_export, minilm_recipe) -> None:
    assert minilm_export.max_abs_error < minilm_recipe.export.tolerance
    assert minilm_export.input_names == ("input_ids", "attention_mask", "token_type_ids")
    assert (minilm_export.tokenizer_dir / "tokenizer.json").is_file()
    report = json.loads((minilm_export.onnx_path.parent / "export.json").read_text())
    assert report["max_abs_error"] == minilm_export.max_abs_error
    sess = onnxruntime_session(minilm_export.onnx_path)
    dims = {i.name: i.shape for i in sess.get_inputs()}
    assert all(isinstance(d, str) for d in dims["input_ids"])  # batch and sequence are dynamic
    for batch, length in ((1, 3), (5, 40)):
        ids = np.ones((batch, length), np.int64)
        hidden, emb = sess.run(None, {"input_ids": ids, "attention_mask": ids, "token_type_ids": 0 * ids})
        assert hidden.shape == (batch, length, 384) and emb.shape == (batch, 384)


def test_minilm_weights_are_external_data_beside_the_graph(minilm_export) -> None:
    # 90 MB of weights: over EXTERNAL_DATA_MIN_BYTES, so one data file beside a graph of a few hundred kB.
    data = minilm_export.onnx_path.with_name("model.onnx.data")
    assert data.stat().st_size > 80_000_000 and minilm_export.onnx_path.stat().st_size < 2_000_000
    assert sorted(p.name for p in minilm_export.onnx_path.parent.glob("model.onnx*")) == ["model.onnx",
                                                                                        "model.onnx.data"]


def test_dynamo_exporter_names_outputs_and_streams_weights(tmp_path: Path, minilm_recipe) -> None:
    """The exporter large models get by default (export.dynamo unset, >= 32M parameters), here asked for."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_torch_models import save_tiny_bert

    folder = save_tiny_bert(tmp_path / "bert", minilm_recipe.source.path)
    recipe = parse_recipe({"model": {"name": "tiny"}, "source": {"kind": "huggingface", "path": str(folder)},
                           "export": {"dynamo": True, "opset": 18}, "shapes": {"max_sequence_length": 32}}, tmp_path)
    result = export_model(recipe)
    assert result.output_names == ("last_hidden_state", "embedding") and result.opset == 18
    assert result.max_abs_error < recipe.export.tolerance
    # The dynamo exporter names an internal value "embedding" too: outputs are named after export, uniquely.
    sess = onnxruntime_session(result.onnx_path)
    assert [o.name for o in sess.get_outputs()] == ["last_hidden_state", "embedding"]
    assert [p.name for p in result.onnx_path.parent.iterdir() if p.name.startswith("model.onnx")] == ["model.onnx"]


def test_torch_factory_export(tmp_path: Path, factory_module: str) -> None:
    recipe = parse_recipe(torch_recipe(tmp_path, f"{factory_module}:make"), tmp_path)
    res = export_model(recipe)
    assert res.max_abs_error < 1e-4 and res.tokenizer_dir is None
    out = onnxruntime_session(res.onnx_path).run(None, {"x": np.ones((3, 7, 4), np.float32)})[0]
    assert out.shape == (3, 3)


def test_bad_export_fails_over_tolerance_and_writes_nothing(tmp_path: Path, factory_module: str) -> None:
    recipe = parse_recipe(torch_recipe(tmp_path, f"{factory_module}:make_noisy"), tmp_path)
    with pytest.raises(FactoryError, match="over the tolerance"):
        export_model(recipe)
    assert not (recipe.work_dir / "export").exists()
    assert not any(p.name.startswith(".export") for p in recipe.work_dir.iterdir())


def test_factory_errors_name_the_fix(tmp_path: Path, factory_module: str) -> None:
    with pytest.raises(FactoryError, match=r"returned Scale. Fix: return \(torch.nn.Module, example_inputs\)"):
        export_model(parse_recipe(torch_recipe(tmp_path, f"{factory_module}:make_wrong"), tmp_path))
    with pytest.raises(FactoryError, match="has no function 'absent'.*name one of: make, make_noisy, make_wrong"):
        export_model(parse_recipe(torch_recipe(tmp_path, f"{factory_module}:absent"), tmp_path))
    with pytest.raises(FactoryError, match=rf"no module 'no_such_module_xyz' beside the recipe \({tmp_path}\) or "
                                           r"installed. Fix: put no_such_module_xyz.py beside the recipe"):
        export_model(parse_recipe(torch_recipe(tmp_path, "no_such_module_xyz:make"), tmp_path))


FACTORY_WITH_SIBLING = '''
import torch
from cnn_layers import Block  # a sibling module beside the recipe, as a user writes it


def build():
    torch.manual_seed(0)
    return Block(), {"x": torch.randn(2, 5, 4)}
'''
SIBLING = '''
import torch


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.proj(x).sum(dim=1)
'''


def test_factory_module_beside_the_recipe_imports_without_leaking(tmp_path: Path) -> None:
    import sys

    folder = tmp_path / "recipes"
    folder.mkdir()
    (folder / "user_cnn_factory.py").write_text(FACTORY_WITH_SIBLING)
    (folder / "cnn_layers.py").write_text(SIBLING)
    path_before = list(sys.path)
    res = export_model(parse_recipe(torch_recipe(folder, "user_cnn_factory:build"), folder))
    assert res.max_abs_error < 1e-4
    assert sys.path == path_before
    assert "user_cnn_factory" not in sys.modules and "cnn_layers" not in sys.modules
    # A module of the same name imported from elsewhere does not shadow the one beside the recipe, and stays.
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "user_cnn_factory.py").write_text("def build():\n    raise AssertionError('the wrong module')\n")
    sys.path.insert(0, str(other))
    try:
        importlib.import_module("user_cnn_factory")  # imported to be shadowed

        assert export_model(parse_recipe(torch_recipe(folder, "user_cnn_factory:build"), folder)).max_abs_error < 1e-4
        assert sys.modules["user_cnn_factory"].__file__ == str(other / "user_cnn_factory.py")
    finally:
        sys.path.remove(str(other))
        sys.modules.pop("user_cnn_factory", None)
    # A recipe folder that holds an import-path entry of its own (a virtual environment in the project,
    # say): what is imported through that entry is not the recipe's and stays imported.
    (folder / "venv_lib" / "vendored_dep_xyz").mkdir(parents=True)
    (folder / "venv_lib" / "vendored_dep_xyz" / "__init__.py").write_text("VALUE = 1\n")
    (folder / "user_cnn_factory.py").write_text("import vendored_dep_xyz\n" + FACTORY_WITH_SIBLING)
    sys.path.append(str(folder / "venv_lib"))
    try:
        export_model(parse_recipe(torch_recipe(folder, "user_cnn_factory:build"), folder))
        assert "vendored_dep_xyz" in sys.modules and "user_cnn_factory" not in sys.modules
    finally:
        sys.path.remove(str(folder / "venv_lib"))
        sys.modules.pop("vendored_dep_xyz", None)
    (folder / "user_cnn_factory.py").write_text(FACTORY_WITH_SIBLING)
    # The module's own missing dependency is named as such, not as a missing factory module.
    (folder / "cnn_layers.py").write_text("import not_installed_dep_xyz\n")
    with pytest.raises(FactoryError, match="importing 'user_cnn_factory' failed.*pip install the package that "
                                           "provides 'not_installed_dep_xyz'"):
        export_model(parse_recipe(torch_recipe(folder, "user_cnn_factory:build"), folder))
    (folder / "cnn_layers.py").write_text(SIBLING)
    (folder / "user_cnn_factory.py").write_text(FACTORY_WITH_SIBLING.replace("torch.randn(2, 5, 4)",
                                                                             "torch.randn(2, 5, 4).double()"))
    with pytest.raises(FactoryError, match="'x' is torch.float64, the recipe declares FP32"):
        export_model(parse_recipe(torch_recipe(folder, "user_cnn_factory:build"), folder))
    (folder / "user_cnn_factory.py").write_text("def build():\n    raise RuntimeError('no weights file')\n")
    with pytest.raises(FactoryError, match="build\\(\\) raised RuntimeError: no weights file. Fix: make it run"):
        export_model(parse_recipe(torch_recipe(folder, "user_cnn_factory:build"), folder))


def test_onnx_source_is_checked_and_copied(tmp_path: Path, factory_module: str) -> None:
    first = export_model(parse_recipe(torch_recipe(tmp_path, f"{factory_module}:make"), tmp_path))
    data = torch_recipe(tmp_path, "")
    data["source"] = {"kind": "onnx", "path": str(first.onnx_path)}
    data["model"]["name"] = "tiny_onnx"
    res = export_model(parse_recipe(data, tmp_path))
    assert res.onnx_path.read_bytes() == first.onnx_path.read_bytes()
    data["outputs"][0]["name"] = "not_in_graph"
    with pytest.raises(FactoryError, match="make \\[\\[inputs\\]\\]/\\[\\[outputs\\]\\] match"):
        export_model(parse_recipe(data, tmp_path))


def test_broken_onnx_file_is_named(tmp_path: Path) -> None:
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"\x08\x07garbage that is not a protobuf")
    data = {"model": {"name": "b"}, "source": {"kind": "onnx", "path": str(broken)},
            "inputs": [{"name": "x", "dtype": "FP32", "dims": [-1]}],
            "outputs": [{"name": "y", "dtype": "FP32", "dims": [-1]}]}
    with pytest.raises(FactoryError, match="is not a valid ONNX model.*Fix"):
        export_model(parse_recipe(data, tmp_path))


# --------------------------------------------------------------------------- TorchScript (export.torchscript)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory, minilm_recipe) -> Path:
    from tiny_torch_models import save_tiny_bert

    return save_tiny_bert(tmp_path_factory.mktemp("ts") / "tiny-bert", minilm_recipe.source.path)


def _program_outputs(path: Path, feeds: dict[str, np.ndarray], names: list[str]) -> list[np.ndarray]:
    import torch

    module = torch.export.load(str(path)).module()
    with torch.no_grad():
        outs = module(*(torch.from_numpy(feeds[n]) for n in names))
    return [o.numpy() for o in outs]


def test_hf_exported_program_matches_onnxruntime(tiny_bert: Path, tmp_path: Path) -> None:
    import torch

    recipe = parse_recipe({"model": {"name": "tiny"}, "source": {"kind": "huggingface", "path": str(tiny_bert)},
                           "export": {"torchscript": True},
                           "shapes": {"max_batch": 8, "max_sequence_length": 64, "sequence_buckets": [64]}}, tmp_path)
    res = export_model(recipe)
    assert res.torchscript_path == res.onnx_path.parent / "model.pt2" and res.torchscript_path.is_file()
    assert not (res.onnx_path.parent / "model.torchscript.pt").exists()  # new builds write no TorchScript
    assert res.torchscript_max_abs_error is not None and res.torchscript_max_abs_error <= recipe.export.tolerance
    report = json.loads((res.onnx_path.parent / "export.json").read_text())
    assert report["torchscript"]["file"] == "model.pt2"
    assert report["torchscript"]["torch"] == torch.__version__
    # The names travel inside the file, in forward()'s positional order.
    extra = {"model_factory_io.json": ""}
    torch.export.load(str(res.torchscript_path), extra_files=extra)
    assert json.loads(extra["model_factory_io.json"]) | {"torch": None} == {
        "format": 1, "inputs": ["input_ids", "attention_mask", "token_type_ids"],
        "outputs": ["last_hidden_state", "embedding"], "torch": None}
    sess = onnxruntime_session(res.onnx_path)
    rng = np.random.default_rng(0)
    for batch, length in ((1, 3), (5, 40)):  # shapes other than the exported one (dynamic batch and sequence)
        ids = rng.integers(0, 30522, (batch, length))
        mask = np.ones_like(ids)
        mask[0, length // 2:] = 0
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        want = sess.run(list(res.output_names), feeds)
        got = _program_outputs(res.torchscript_path, feeds, list(res.input_names))
        for g, w in zip(got, want):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, atol=1e-4)


def test_default_export_makes_no_torchscript(tmp_path: Path, factory_module: str) -> None:
    res = export_model(parse_recipe(torch_recipe(tmp_path, f"{factory_module}:make"), tmp_path))
    assert res.torchscript_path is None and not (res.onnx_path.parent / "model.pt2").exists()
    assert json.loads((res.onnx_path.parent / "export.json").read_text())["torchscript"] is None


def test_torch_factory_torchscript_export(tmp_path: Path, monkeypatch) -> None:
    from tiny_torch_models import encoder_recipe, write_factory

    name = write_factory(tmp_path, monkeypatch)
    res = export_model(parse_recipe(encoder_recipe(f"{name}:make", torchscript=True), tmp_path))
    assert res.torchscript_path.is_file()
    feeds = {"input_ids": np.arange(12).reshape(2, 6) % 50, "attention_mask": np.ones((2, 6), np.int64)}
    want = onnxruntime_session(res.onnx_path).run(list(res.output_names), feeds)
    got = _program_outputs(res.torchscript_path, feeds, list(res.input_names))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5)


def test_trace_that_bakes_a_shape_in_fails_with_the_fix(tmp_path: Path, monkeypatch) -> None:
    from tiny_torch_models import encoder_recipe, write_factory

    name = write_factory(tmp_path, monkeypatch)
    recipe = parse_recipe(encoder_recipe(f"{name}:make_branchy", torchscript=True), tmp_path)
    # The ONNX export bakes the branch in too; it is now checked at a second batch size and fails first.
    with pytest.raises(FactoryError, match="matches the source at the example's batch size 3 but differs by .* at "
                                           "batch size 1: the export baked the batch size in .* Fix: remove"):
        export_model(recipe)
    assert not (recipe.work_dir / "export").exists()


def test_onnx_source_cannot_make_torchscript(tmp_path: Path, factory_module: str) -> None:
    from dataclasses import replace

    first = export_model(parse_recipe(torch_recipe(tmp_path, f"{factory_module}:make"), tmp_path))
    data = torch_recipe(tmp_path, "")
    data["source"] = {"kind": "onnx", "path": str(first.onnx_path)}
    data["model"]["name"] = "tiny_onnx"
    data["export"] = {"torchscript": True}
    with pytest.raises(FactoryError, match="export.torchscript.*no torch module to trace.*Fix"):
        parse_recipe(data, tmp_path)
    # A recipe built in code (not parsed) is refused by the stage too.
    del data["export"]
    recipe = parse_recipe(data, tmp_path)
    recipe = replace(recipe, export=replace(recipe.export, torchscript=True))
    with pytest.raises(FactoryError, match="no torch module to trace. Fix: set export.torchscript = false"):
        export_model(recipe)


# --------------------------------------------------------------------------- Hugging Face task heads


def _task_recipe(folder: Path, task: str, tmp_path: Path):
    data = {"model": {"name": "t", "task": task}, "source": {"kind": "huggingface", "path": str(folder)},
            "shapes": {"max_sequence_length": 32, "sequence_buckets": [32]}, "repository": {"path": "repo"}}
    return parse_recipe(data, tmp_path)


def test_head_without_its_weights_is_refused(tiny_bert: Path, tmp_path: Path) -> None:
    """config.json claims a classifier, the weights are the bare encoder: never export a random head."""
    import shutil

    folder = tmp_path / "claims-a-head"
    shutil.copytree(tiny_bert, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"architectures": ["BertForSequenceClassification"],
                                                           "id2label": {"0": "a", "1": "b"}}))
    with pytest.raises(FactoryError, match=r"lack .* tensor\(s\) of the classification head.*Fix:"):
        export_model(_task_recipe(folder, "classification", tmp_path), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_token_classifier_exports_per_token_logits(tmp_path: Path, minilm_recipe) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import zoo_models

    member = zoo_models.make_token_classifier(tmp_path, minilm_recipe.source.path)
    res = export_model(_task_recipe(member.folder, "token-classification", tmp_path), tmp_path / "out")
    assert res.output_names == ("logits",) and res.max_abs_error < 1e-3
    sess = onnxruntime_session(res.onnx_path)
    out = sess.run(["logits"], {"input_ids": np.full((2, 7), 1000, np.int64),
                                "attention_mask": np.ones((2, 7), np.int64),
                                "token_type_ids": np.zeros((2, 7), np.int64)})[0]
    assert out.shape == (2, 7, len(zoo_models.NER_LABELS))


def test_cli_names_a_missing_factory_module_in_one_line(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from model_factory.cli.main import main

    recipe = tmp_path / "cnn.toml"
    recipe.write_text('[model]\nname = "cnn"\n[source]\nkind = "torch"\nfactory = "tiny_cnn:build"\n'
                      '[[inputs]]\nname = "pixels"\ndtype = "FP32"\ndims = [3, 8, 8]\n'
                      '[[outputs]]\nname = "logits"\ndtype = "FP32"\ndims = [10]\n')
    result = CliRunner().invoke(main, ["export", str(recipe)])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert f"no module 'tiny_cnn' beside the recipe ({tmp_path}) or installed. Fix: put tiny_cnn.py beside the " \
           "recipe" in result.output


def test_exported_program_refuses_a_branch_on_a_dynamic_axis(tmp_path: Path, monkeypatch) -> None:
    """The exported program's own check at a second batch size (kept for exports whose ONNX graph did not bake it in)."""
    import importlib

    import torch
    from tiny_torch_models import encoder_recipe, write_factory

    from model_factory.build_engines.export import save_exported_program

    name = write_factory(tmp_path, monkeypatch)
    module, example = importlib.import_module(name).make_branchy()
    args = (example["input_ids"], example["attention_mask"])
    recipe = parse_recipe(encoder_recipe(f"{name}:make_branchy", torchscript=True), tmp_path)
    with pytest.raises(FactoryError, match="exported program differs.*Fix: set export.torchscript = false"):
        save_exported_program(torch, module, [args, tuple(a[:1] for a in args)], tmp_path,
                              ["input_ids", "attention_mask"], ["last_hidden_state", "embedding"], recipe,
                              lambda _m: None, dynamic={"input_ids": (0, 1), "attention_mask": (0, 1)})
