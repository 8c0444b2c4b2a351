"""A model past protobuf's 2 GB limit, end to end: ONNX source with external data → FP16 and INT8 →
package (weights hard-linked) → sign → verify → served on the real Triton from verified bytes.

The model is made cheaply: a 2.2M x 256 FP32 embedding table (2.25 GB) whose data file is sparse
on disk: only its first and last 1,000 rows hold values, the rows between are zeros (holes). A
small MatMul after it gives INT8 something to quantize. Requests use ids from both ends of the
table, so a weight read at a wrong offset shows in the answers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROWS, HIDDEN, FILLED = 2_200_000, 256, 1000
TABLE_BYTES = ROWS * HIDDEN * 4


def _rows(ids: np.ndarray) -> np.ndarray:
    """The table's rows for ``ids`` (the reference the served model is compared with)."""
    rng = np.random.default_rng(0)
    head = rng.standard_normal((FILLED, HIDDEN)).astype(np.float32)
    tail = rng.standard_normal((FILLED, HIDDEN)).astype(np.float32)
    out = np.zeros(ids.shape + (HIDDEN,), np.float32)
    out[ids < FILLED] = head[ids[ids < FILLED]]
    far = ids >= ROWS - FILLED
    out[far] = tail[ids[far] - (ROWS - FILLED)]
    return out


def _weight() -> np.ndarray:
    return (np.random.default_rng(1).standard_normal((HIDDEN, HIDDEN)) / 16).astype(np.float32)


def _write_source(folder: Path) -> Path:
    """``big.onnx`` + ``big.onnx.data`` (sparse): hidden = table[ids] * mask; out = hidden @ W; mean over L."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    folder.mkdir(parents=True)
    data = folder / "big.onnx.data"
    head = _rows(np.arange(FILLED))
    tail = _rows(np.arange(ROWS - FILLED, ROWS))
    with data.open("wb") as f:
        f.write(head.tobytes())
        f.seek(TABLE_BYTES - tail.nbytes)
        f.write(tail.tobytes())
    table = TensorProto(name="table", data_type=TensorProto.FLOAT, dims=[ROWS, HIDDEN],
                        data_location=TensorProto.EXTERNAL)
    for key, value in (("location", data.name), ("offset", "0"), ("length", str(TABLE_BYTES))):
        entry = table.external_data.add()
        entry.key, entry.value = key, value
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["rows"]),
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask_f", "last_axis"], ["mask_3d"]),
        helper.make_node("Mul", ["rows", "mask_3d"], ["hidden"]),
        helper.make_node("MatMul", ["hidden", "w"], ["last_hidden_state"], name="proj"),
        helper.make_node("ReduceMean", ["last_hidden_state"], ["embedding"], axes=[1], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "big",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["n", "l"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["n", "l"])],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["n", "l", HIDDEN]),
         helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["n", HIDDEN])],
        [table, numpy_helper.from_array(_weight(), "w"), numpy_helper.from_array(np.array([-1], np.int64), "last_axis")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(folder / "big.onnx"))
    return folder / "big.onnx"


def _ids(n: int, length: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    near = rng.integers(0, FILLED, (n, length))
    far = rng.integers(ROWS - FILLED, ROWS, (n, length))
    return np.where(rng.random((n, length)) < 0.5, near, far).astype(np.int64)


def test_model_over_2gb_builds_signs_and_serves(tmp_path: Path) -> None:
    from model_factory.measure.client import infer_ids
    from model_factory.demo import write_key_policy
    from model_factory.build.pipeline import build
    from model_factory.recipe import load_recipe
    from model_factory.serving.server import ServerOptions, start_verified_server
    from model_factory.signing import SignerConfig, generate_keypair

    source = _write_source(tmp_path / "source")
    for name, seed in (("calib.npz", 1), ("held.npz", 2)):
        ids = _ids(24, 8, seed)
        np.savez(tmp_path / name, input_ids=ids, attention_mask=np.ones_like(ids))
    recipe_path = tmp_path / "big.toml"
    recipe_path.write_text(f"""
precisions = ["fp32", "fp16", "int8"]
[model]
name = "big"
task = "generic"
[source]
kind = "onnx"
path = "{source}"
[[inputs]]
name = "input_ids"
dtype = "INT64"
dims = [-1]
[[inputs]]
name = "attention_mask"
dtype = "INT64"
dims = [-1]
[[outputs]]
name = "last_hidden_state"
dtype = "FP32"
dims = [-1, {HIDDEN}]
[[outputs]]
name = "embedding"
dtype = "FP32"
dims = [{HIDDEN}]
[shapes]
max_batch = 8
max_sequence_length = 16
sequence_buckets = [16]
[quantization]
calibration_data = "calib.npz"
heldout_data = "held.npz"
mixed_precision = false
[tensorrt]
enabled = false
[batching]
preferred_batch_sizes = [8]
[repository]
serve = "int8"
""")
    recipe = load_recipe(recipe_path)
    keys = generate_keypair(tmp_path / "keys")
    result = build(recipe, signer=SignerConfig(private_key=keys.private_key, password=None),
                   parameters={"cost_model": "0.001,1e-6,1e-9"})

    export_dir = recipe.work_dir / "export"
    assert (export_dir / "model.onnx.data").stat().st_size > 2**31  # past protobuf's limit, as data
    assert (export_dir / "model.onnx").stat().st_size < 1 << 20  # the graph alone
    quant_dir = recipe.work_dir / "quantize"
    assert (quant_dir / "model.fp16.onnx.data").stat().st_size >= TABLE_BYTES // 2
    assert {r["precision"]: r["score"] >= 0.99 for r in result.accuracy["results"]} == {"fp16": True, "int8": True}
    # The version folder holds the served INT8 model only (with its 7-bit weight form for CPUs without VNNI/AMX),
    # its weights hard-linked from the build.
    v = result.version_dir
    models = sorted(p.name for p in v.iterdir() if p.name.startswith("model.") and p.name != "model.py")
    assert models == ["model.int8.onnx", "model.int8.onnx.data", "model.int8.w7.onnx", "model.int8.w7.onnx.data"]
    assert (v / "model.int8.onnx.data").stat().st_ino == (quant_dir / "model.int8.onnx.data").stat().st_ino
    assert (v / "model.int8.onnx.data").stat().st_size > 2**31

    policy = write_key_policy(tmp_path / "policy.toml", [keys.public_key])
    server, report = start_verified_server(recipe.repository.path, ServerOptions(0, 0, 0), policy)
    try:
        assert report.served == ("big",), report.refused
        ids = _ids(3, 6, 3)
        mask = np.ones_like(ids)
        mask[1, 4:] = 0
        for url, protocol in ((server.http_url, "http"), (server.grpc_url, "grpc")):
            out = infer_ids(url, "big", ids, mask, protocol=protocol,
                            outputs=("last_hidden_state", "embedding"))
            expected = (_rows(ids) * mask[..., None]) @ _weight()
            # INT8 (Q/DQ on the MatMul) against the FP32 source, computed here with numpy.
            got = out["last_hidden_state"].reshape(expected.shape)
            real, want = got[mask == 1], expected[mask == 1]
            cos = np.sum(real * want, -1) / (np.linalg.norm(real, axis=-1) * np.linalg.norm(want, axis=-1))
            assert np.all(cos > 0.99), cos
            assert np.allclose(got[mask == 0], 0.0)
        # The backend says which precision it serves, and from which file: the 8-bit weights where the CPU has
        # integer dot products, the 7-bit form elsewhere (AVX2 only: 8-bit weights would saturate there).
        from model_factory.backend.engines.cpu_features import choose_int8_kernels

        served = "model.int8.w7.onnx" if choose_int8_kernels("auto", seven_bit=True)[1] == "7-bit" else "model.int8.onnx"
        assert f"big serves int8 on onnxruntime ({served})" in server.log_file.read_text(errors="replace")
    finally:
        assert server.stop() == 0
