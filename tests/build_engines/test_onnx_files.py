"""ONNX files with external data: written tensor by tensor, read without onnx's loaders, checked with links."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from model_factory.build_engines import onnx_files
from model_factory.errors import FactoryError

onnx = pytest.importorskip("onnx")


def _model(scale: float = 1.0):
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array((np.arange(64 * 64, dtype=np.float32).reshape(64, 64) / 4096 * scale), "w")
    b = numpy_helper.from_array(np.full(64, 0.5, np.float32), "b")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 64])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"], name="mm"), helper.make_node("Add", ["xw", "b"], ["y"])]
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y], [w, b]),
                             opset_imports=[helper.make_opsetid("", 17)])


def _run(path: Path) -> np.ndarray:
    from model_factory.build_engines.export import onnxruntime_session

    return onnxruntime_session(path).run(["y"], {"x": np.ones((2, 64), np.float32)})[0]


def test_small_models_stay_one_file_and_large_ones_get_one_data_file(tmp_path: Path) -> None:
    (tmp_path / "one").mkdir()
    one = onnx_files.save(_model(), tmp_path / "one" / "model.onnx")
    assert onnx_files.files_of(one) == [one]
    (tmp_path / "ext").mkdir()
    ext = onnx_files.save(_model(), tmp_path / "ext" / "model.onnx", external=True)
    assert onnx_files.files_of(ext) == [ext, tmp_path / "ext" / "model.onnx.data"]
    assert ext.stat().st_size < 2048 <= (tmp_path / "ext" / "model.onnx.data").stat().st_size
    np.testing.assert_allclose(_run(ext), _run(one))
    # The graph of a large model: weights stay references until read one by one.
    graph = onnx_files.load_graph(ext)
    w = next(t for t in graph.graph.initializer if t.name == "w")
    assert w.data_location == onnx.TensorProto.EXTERNAL and not w.raw_data
    np.testing.assert_array_equal(onnx_files.tensor_array(w, ext.parent), onnx.numpy_helper.to_array(
        _model().graph.initializer[0]))


def test_weights_stream_from_one_data_file_into_another_with_a_conversion(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    onnx_files.save(_model(), src / "model.onnx", external=True)
    graph = onnx_files.load_graph(src / "model.onnx")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "model.onnx.data").write_bytes(b"stale bytes that must not be appended to")
    # Doubling every FP32 value of w on the way (chunk by chunk): the graph is unchanged, the data is new.
    double = {"w": lambda chunk: (np.frombuffer(chunk, np.float32) * 2).tobytes()}
    onnx_files.save(graph, dst / "model.onnx", base_dir=src, external=True, convert=double)
    np.testing.assert_allclose(_run(dst / "model.onnx"), _run(src / "model.onnx") * 2 - 0.5, rtol=1e-6)
    # Into one file (the tensors are read back into the graph) when asked.
    onnx_files.save(graph, dst / "single.onnx", base_dir=src, external=False)
    assert onnx_files.files_of(dst / "single.onnx") == [dst / "single.onnx"]
    np.testing.assert_allclose(_run(dst / "single.onnx"), _run(src / "model.onnx"))


def test_check_accepts_hard_linked_data_and_names_a_truncated_file(tmp_path: Path) -> None:
    path = onnx_files.save(_model(), tmp_path / "model.onnx", external=True)
    (tmp_path / "repo").mkdir()
    linked = onnx_files.link_into(path, tmp_path / "repo")
    # onnx's own checker refuses a data file with two links ("hardlink attack"); packaging makes them.
    assert os.stat(tmp_path / "model.onnx.data").st_nlink == 2
    onnx_files.check(path)
    onnx_files.check(linked)
    data = tmp_path / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:100])  # the same inode: both copies are now truncated
    with pytest.raises(FactoryError, match=r"model.onnx.data holds 100 bytes but tensor 'w' ends at byte 16384"):
        onnx_files.check(linked)


def test_normalize_gathers_an_exporters_per_tensor_files(tmp_path: Path) -> None:
    model = _model()
    reference = onnx.numpy_helper.to_array(model.graph.initializer[0])
    for tensor in model.graph.initializer:  # as torch's exporter lays out a large model: a file per tensor
        (tmp_path / tensor.name).write_bytes(tensor.raw_data)
        tensor.ClearField("raw_data")
        tensor.data_location = onnx.TensorProto.EXTERNAL
        entry = tensor.external_data.add()
        entry.key, entry.value = "location", tensor.name
    (tmp_path / "model.onnx").write_bytes(model.SerializeToString())
    before = {p.name for p in tmp_path.iterdir()}
    assert {"w", "b"} <= before  # one file per tensor, named after it
    onnx_files.normalize(tmp_path / "model.onnx")
    # Under EXTERNAL_DATA_MIN_BYTES of tensors: one self-contained file, the exporter's files gone.
    assert {p.name for p in tmp_path.iterdir()} == {"model.onnx"}
    np.testing.assert_allclose(_run(tmp_path / "model.onnx"), np.ones((2, 64)) @ reference + 0.5, rtol=1e-5)


def test_fp16_of_a_graph_whose_weights_stay_on_disk_matches_the_in_memory_conversion(tmp_path: Path) -> None:
    from model_factory.build_engines.quantize import convert_fp16, convert_fp16_graph

    path = onnx_files.save(_model(), tmp_path / "model.onnx", external=True)
    graph, converted = convert_fp16_graph(onnx_files.load_graph(path))
    assert set(converted) == {"w"}  # b (256 bytes) stays in the graph and the converter converts it there
    (tmp_path / "fp16").mkdir()
    out = onnx_files.save(graph, tmp_path / "fp16" / "model.fp16.onnx", base_dir=tmp_path, external=True,
                          convert=converted)
    assert (tmp_path / "fp16" / "model.fp16.onnx.data").stat().st_size < (tmp_path / "model.onnx.data").stat().st_size
    in_memory = convert_fp16(_model())
    (tmp_path / "mem").mkdir()
    onnx_files.save(in_memory, tmp_path / "mem" / "model.onnx", external=False)
    np.testing.assert_array_equal(_run(out), _run(tmp_path / "mem" / "model.onnx"))


def test_a_model_can_be_rewritten_over_the_files_it_reads_from(tmp_path: Path) -> None:
    path = onnx_files.save(_model(), tmp_path / "model.onnx", external=True)
    expected = _run(path)
    onnx_files.save(onnx_files.load_graph(path), path, external=True)  # reads model.onnx.data while replacing it
    np.testing.assert_allclose(_run(path), expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]


def test_zero_runs_in_weights_are_written_as_holes(tmp_path: Path) -> None:
    # A 48 MiB table whose middle is zeros (unused embedding rows): every data file written from it keeps the
    # zeros as holes, through a streamed copy with a conversion too; the bytes read back are the same.
    from onnx import TensorProto, helper, numpy_helper

    table = np.zeros((48 * 1024, 256), np.float32)
    table[:100] = 1.5
    table[-100:] = -2.0
    nodes = [helper.make_node("Gather", ["table", "ids"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 256])],
                              [numpy_helper.from_array(table, "table")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    (tmp_path / "a").mkdir()
    first = onnx_files.save(model, tmp_path / "a" / "model.onnx")
    data = onnx_files.data_file(first)
    assert data.stat().st_size >= table.nbytes
    (tmp_path / "b").mkdir()
    halve = {"table": lambda chunk: (np.frombuffer(chunk, np.float32) / 2).tobytes()}
    second = onnx_files.save(onnx_files.load_graph(first), tmp_path / "b" / "model.onnx", base_dir=first.parent,
                             convert=halve)
    from model_factory.build_engines.export import onnxruntime_session

    ids = np.array([0, 99, 100, 30000, 48 * 1024 - 1], np.int64)
    np.testing.assert_array_equal(onnxruntime_session(first).run(["y"], {"ids": ids})[0], table[ids])
    np.testing.assert_array_equal(onnxruntime_session(second).run(["y"], {"ids": ids})[0], table[ids] / 2)
    probe = tmp_path / "probe"
    with probe.open("wb") as f:
        f.truncate(table.nbytes)
    if probe.stat().st_blocks * 512 < table.nbytes // 4:  # this filesystem keeps holes: the written files do
        for path in (data, onnx_files.data_file(second)):
            assert path.stat().st_blocks * 512 < table.nbytes // 4, (path, path.stat().st_blocks)
