"""INT8 MatMuls on the factory's operators (backends/python_backend/generation/int8_matmul.py and its kernel,
kernels/int8_matmul.cc): the grouped per-row form that build_engines/row_int8.py writes and dynamic INT8's
MatMulInteger -> Cast -> Mul chains give the same outputs in one node, on one MatMul at several shapes and row counts
(AVX-512 and AVX2 builds) and in a whole text-generation graph; forms they do not take are left as they are."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from model_factory.backend.generation import int8_attention as ia
from model_factory.backend.generation import int8_matmul as rk

needs_compiler = pytest.mark.skipif(ia.compile_problem() is not None, reason=str(ia.compile_problem()))


def _one_matmul(folder: Path, k: int, n: int, group: int, seed: int = 0) -> Path:
    """A graph of one float MatMul named as a down_proj, rewritten by row_int8.py to its grouped form (weights
    external, as a build writes them)."""
    import onnx
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper

    from model_factory.build_engines.row_int8 import per_row_matmuls

    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.05, (k, n)).astype(np.float32)
    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="/model/layers.0/mlp/down_proj/MatMul")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TP.FLOAT, ["B", "T", k])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, ["B", "T", n])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    path = folder / "model.onnx"
    onnx.save(model, str(path))
    assert per_row_matmuls(path, ("down_proj",), group=group) == 1
    return path


def _session(model_bytes: bytes, folder: Path, library: Path | None = None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    if library is not None:
        opts.register_custom_ops_library(str(library))
    return ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])


def _inputs(rows: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (rows, 1, k)).astype(np.float32)
    x[0, 0, 3] = 40.0  # a loud input in one group of the first row only
    if rows > 2:
        x[2, 0, :] = 0.0  # a silent row: its scale is the floor
    return x


def test_pack_puts_four_inputs_of_a_column_together_in_tiles_of_columns_and_sums_each_group():
    w = (np.arange(16 * 64) % 129 - 64).astype(np.int8).reshape(16, 64)  # K = 16, N = 64: two tiles
    packed, sums = rk.pack(w, 8)
    assert packed.shape == (2, 4, rk.TILE, 4)
    assert packed[1, 2, 5].tolist() == w[8:12, rk.TILE + 5].tolist()
    assert sums.tolist() == [w[:8].astype(int).sum(0).tolist(), w[8:].astype(int).sum(0).tolist()]


@needs_compiler
@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("k,n,group", [(2048, 640, 256), (512, 96, 128), (256, 32, 64)])
def test_the_operator_gives_the_standard_form_s_outputs(tmp_path, monkeypatch, isa, k, n, group):
    import onnx

    path = _one_matmul(tmp_path, k, n, group)
    packaged = _session(path.read_bytes(), tmp_path)
    model = onnx.load(str(path), load_external_data=False)
    assert rk.rewrite(model, tmp_path) == (1, 0)
    assert [nd.op_type for nd in model.graph.node] == [rk.OP_TYPE]
    assert not [t.name for t in model.graph.initializer if ".weight_q." in t.name]
    lib = ia.library(rk.SOURCE, isa=isa, name=rk.LIBRARY_NAME)
    kernel = _session(model.SerializeToString(), tmp_path, lib)
    for rows in (1, 3, 8, 16, 33):  # whole row tiles and a remainder (AMX tiles from 2 rows where the CPU has them)
        x = _inputs(rows, k, rows)
        want = packaged.run(None, {"x": x})[0]
        got = kernel.run(None, {"x": x})[0]
        assert got.shape == want.shape == (rows, 1, n)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(np.abs(want).max()))


@needs_compiler
def test_prepare_leaves_a_graph_without_the_grouped_form_alone(tmp_path):
    import onnx
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper

    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="/model/layers.0/mlp/down_proj/MatMul")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TP.FLOAT, ["B", 8])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, ["B", 4])],
                              [numpy_helper.from_array(np.ones((8, 4), np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    assert rk.prepare(model.SerializeToString()) is None
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    assert rk.prepare(path) is None


def test_a_form_missing_a_node_or_with_columns_off_the_tiles_is_left_as_packaged(tmp_path):
    import onnx

    odd = tmp_path / "odd"
    odd.mkdir()
    model = onnx.load(str(_one_matmul(odd, 256, 40, 64)), load_external_data=False)
    assert rk.rewrite(model, odd) == (0, 0)  # 40 columns: not whole tiles of 32

    path = _one_matmul(tmp_path, 512, 32, 128)
    model = onnx.load(str(path), load_external_data=False)
    nodes = [nd for nd in model.graph.node if not nd.name.endswith("/row_int8/Concat")]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    assert rk.rewrite(model, tmp_path) == (0, 0)
    assert all(nd.domain != rk.DOMAIN for nd in model.graph.node)


@pytest.fixture(scope="module")
def tiny_llm_rows(tiny_llm_int8_cache, tmp_path_factory):
    """tiny_llm's INT8-cache graph with its down_proj in the grouped per-row form (groups of 32 inputs)."""
    import shutil

    from model_factory.build_engines.row_int8 import per_row_matmuls

    folder = tmp_path_factory.mktemp("rows") / "g"
    shutil.copytree(tiny_llm_int8_cache.parent, folder)
    assert per_row_matmuls(folder / "model.onnx", ("down_proj",), group=32) == 2
    return folder / "model.onnx"


@needs_compiler
def test_a_text_generation_graph_decodes_the_same_on_both_kernels(tiny_llm_rows):
    """Three prompts of mixed lengths prefilled together, then 6 batched decode steps, the graph as packaged against
    the graph with both of the factory's operators (attention and the per-row MatMuls): logits equal within float
    rounding, every greedy token the same."""
    from test_int8_attention import _views, decode_logits

    from model_factory.backend.generation.causal_lm import CausalLM

    packaged = CausalLM(tiny_llm_rows, threads=2, int8_attention="onnxruntime", int8_matmul="onnxruntime")
    kernel = CausalLM(tiny_llm_rows, threads=2, int8_attention="kernel", int8_matmul="kernel")
    assert packaged.matmul == ""
    tiles = rk.tile_rows(ia.library(rk.SOURCE, name=rk.LIBRARY_NAME))  # AMX where this CPU and kernel have it
    assert kernel.matmul == (f"model-factory Int8MatMulToFloat (0 nodes) and RowInt8MatMul (2 nodes), {rk.LIBRARY_NAME}"
                             + (f", AMX tiles from {tiles} rows" if tiles else ""))
    assert kernel.attention.startswith("model-factory Int8KVAttention (2 nodes")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 2000, n).tolist() for n in (7, 23, 2)]
    runs = [decode_logits(model, prompts, _views(len(prompts))) for model in (packaged, kernel)]
    for a, b in zip(*runs):
        assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max()
        assert np.array_equal(a.argmax(-1), b.argmax(-1))


def test_auto_keeps_the_standard_ops_where_no_kernel_builds_and_kernel_refuses(tiny_llm_rows, monkeypatch, tmp_path):
    from model_factory.backend.engines.base import EngineError
    from model_factory.backend.generation.causal_lm import CausalLM

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("MF_KERNEL_CACHE", str(tmp_path / "cache"))  # nothing compiled earlier to reuse
    auto = CausalLM(tiny_llm_rows, threads=1, int8_attention="onnxruntime", int8_matmul="auto")
    assert auto.matmul.startswith("onnxruntime (the INT8 MatMul kernels are not used: no C++ compiler")
    from test_int8_attention import _views

    assert auto.prefill([[5, 6, 7]], _views(1)).shape[0] == 1  # the packaged graph runs
    with pytest.raises(EngineError, match=r'int8_matmul = "kernel" but the kernel cannot be used: no C\+\+ compiler'):
        CausalLM(tiny_llm_rows, threads=1, int8_attention="onnxruntime", int8_matmul="kernel")


def _chain(folder: Path, k: int, n: int, seed: int = 0, weight_max: int = 64) -> Path:
    """DynamicQuantizeLinear -> MatMulInteger (a 7-bit weight, zero points 0) -> Cast -> Mul by the activation's scale
    times the weight's per column: dynamic INT8's form of a projection, before ONNX Runtime fuses it."""
    import onnx
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(seed)
    w = rng.integers(-weight_max, weight_max + 1, (k, n)).astype(np.int8)
    w_scale = rng.uniform(0.001, 0.01, n).astype(np.float32)
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"], name="/m/q"),
             helper.make_node("MatMulInteger", ["xq", "w", "xz", "wz"], ["acc"], name="/m/proj/MatMul_quant"),
             helper.make_node("Cast", ["acc"], ["accf"], name="/m/cast", to=TP.FLOAT),
             helper.make_node("Mul", ["xs", "ws"], ["s"], name="/m/scales"),
             helper.make_node("Mul", ["accf", "s"], ["y"], name="/m/out")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, ["B", "T", k])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, ["B", "T", n])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.zeros(n, np.int8), "wz"),
                               numpy_helper.from_array(w_scale, "ws")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    path = folder / "chain.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="chain.onnx.data", size_threshold=0)
    return path


@needs_compiler
@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("k,n", [(640, 1536), (2048, 640), (64, 32)])
def test_a_matmulinteger_chain_on_the_operator_is_bit_for_bit_the_same(tmp_path, isa, k, n):
    import onnx
    import onnxruntime as ort

    path = _chain(tmp_path, k, n)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the nodes as written, unfused
    packaged = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    model = onnx.load(str(path), load_external_data=False)
    assert rk.rewrite(model, tmp_path) == (0, 1)
    assert [nd.op_type for nd in model.graph.node] == ["DynamicQuantizeLinear", "Mul", rk.TO_FLOAT]
    assert "w" not in {t.name for t in model.graph.initializer}
    kernel = _session(model.SerializeToString(), tmp_path, ia.library(rk.SOURCE, isa=isa, name=rk.LIBRARY_NAME))
    for rows in (1, 3, 8, 16, 33):
        x = _inputs(rows, k, rows)
        want = packaged.run(None, {"x": x})[0]
        got = kernel.run(None, {"x": x})[0]
        assert got.shape == want.shape == (rows, 1, n)
        assert np.array_equal(got, want)


@needs_compiler
def test_the_library_says_whether_it_multiplies_on_amx_tiles():
    """Where the CPU has AMX (amx_int8, amx_tile), a compiler that targets it and a kernel that grants the tile
    state, the native library takes its tile path from 2 rows (the outputs above are checked at 3 to 33 rows on
    it); the AVX2 build and a CPU without AMX never do."""
    native = rk.tile_rows(ia.library(rk.SOURCE, name=rk.LIBRARY_NAME))
    assert native in ((0, 2) if {"amx_int8", "amx_tile"} <= set(ia._cpu_flags().split()) else (0,))
    assert rk.tile_rows(ia.library(rk.SOURCE, isa="avx2", name=rk.LIBRARY_NAME)) == 0


@needs_compiler
def test_tiles_off_in_the_environment_keeps_the_vector_path(tmp_path, monkeypatch):
    """MF_INT8_MATMUL_TILES=off (read when a session registers the library): no tile products, the same outputs."""
    import onnx

    path = _chain(tmp_path, 640, 64)
    model = onnx.load(str(path), load_external_data=False)
    assert rk.rewrite(model, tmp_path) == (0, 1)
    lib = ia.library(rk.SOURCE, name=rk.LIBRARY_NAME)
    x = _inputs(8, 640, 1)
    on = _session(model.SerializeToString(), tmp_path, lib).run(None, {"x": x})[0]
    tiles = rk.tile_rows(lib)
    monkeypatch.setenv("MF_INT8_MATMUL_TILES", "off")
    off = _session(model.SerializeToString(), tmp_path, lib).run(None, {"x": x})[0]
    assert rk.tile_rows(lib) == 0 and np.array_equal(on, off)
    monkeypatch.delenv("MF_INT8_MATMUL_TILES")
    _session(model.SerializeToString(), tmp_path, lib)
    assert rk.tile_rows(lib) == tiles  # back on where the host has them


def test_an_8_bit_weight_keeps_its_standard_ops(tmp_path):
    """8-bit weights would overflow AVX2's int16 pairs: such a chain is not taken."""
    import onnx

    model = onnx.load(str(_chain(tmp_path, 64, 32, weight_max=127)), load_external_data=False)
    assert rk.rewrite(model, tmp_path) == (0, 0)


@needs_compiler
def test_a_dynamic_int8_text_generation_graph_decodes_the_same_on_the_operators(tiny_llm, tmp_path, monkeypatch):
    """tiny_llm at INT8 dynamic (every MatMul a chain, down_proj in the grouped per-row form): prefill of three
    prompts and 6 batched decode steps on the operators against the graph as packaged: the same greedy tokens, the
    logits within the activations' quantization (ONNX Runtime fuses the packaged chains and quantizes inside the fused
    node; the operators keep its DynamicQuantizeLinear). The chains go to the operator whatever this CPU: on AVX2
    alone ``prepare`` leaves them to ONNX Runtime (slower there, not wrong: the operator's AVX2 path computes them
    here, compiled for this host)."""
    from test_int8_attention import _views, decode_logits

    from model_factory.backend.generation.causal_lm import CausalLM
    from model_factory.build_engines.lm_quantize import dynamic_int8
    from model_factory.build_engines.row_int8 import per_row_matmuls

    monkeypatch.setattr(rk, "vnni", lambda: True)
    _hf, onnx_dir = tiny_llm
    graph = dynamic_int8(onnx_dir / "model.onnx", tmp_path / "q", ("down_proj",))
    assert per_row_matmuls(graph, ("down_proj",), group=32) == 2
    packaged = CausalLM(graph, threads=2, int8_matmul="onnxruntime")
    kernel = CausalLM(graph, threads=2, int8_matmul="kernel")
    chains = int(kernel.matmul.split("Int8MatMulToFloat (")[1].split(" ")[0])
    assert chains >= 4 and "RowInt8MatMul (2 nodes)" in kernel.matmul
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 2000, n).tolist() for n in (7, 23, 2)]
    runs = [decode_logits(model, prompts, _views(len(prompts), dtype=np.float32)) for model in (packaged, kernel)]
    for a, b in zip(*runs):
        assert np.abs(a - b).max() <= 2e-2 * np.abs(a).max()
        assert np.array_equal(a.argmax(-1), b.argmax(-1))


@needs_compiler
def test_without_vnni_the_chains_stay_on_onnxruntime_and_the_grouped_forms_still_go(tmp_path, monkeypatch):
    """On AVX2 alone the operator's u8 x s8 products are slower than with VNNI: prepare leaves the chains to ONNX
    Runtime there and still replaces the grouped per-row forms (two dozen nodes each)."""
    monkeypatch.setattr(rk, "_cpu_flags", lambda: "sse4_2 avx2 fma")
    assert rk.prepare(_chain(tmp_path, 64, 32)) is None
    rows = rk.prepare(_one_matmul(tmp_path, 512, 64, 128))
    assert rows is not None and (rows.nodes, rows.chains) == (1, 0)
    monkeypatch.setattr(rk, "_cpu_flags", lambda: "avx2 avx512f avx512_vnni")
    chains = rk.prepare(_chain(tmp_path, 64, 32))
    assert chains is not None and (chains.nodes, chains.chains) == (0, 1)
