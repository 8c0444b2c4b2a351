"""Model zoo, generic tensor models: a torch CNN and an ONNX file with two float inputs, end to end
(and a third ONNX file, FP32 only, whose INT32, BOOL and FP16 inputs cross the server).

Each model is made here (random init, no downloads), built at FP32/FP16/INT8 with the accuracy gate
(calibration from an .npz), packaged into one repository and served by one real Triton. Answers over
HTTP and gRPC are compared with the source framework (torch for the CNN, ONNX Runtime on the source
file for the ONNX model), and a bad request in the same window is answered 400 alone.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY_CNN = '''
import torch

from tiny_cnn_layers import head  # a sibling module: the recipe's folder is on the import path


class TinyCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(8, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        self.head = head(16, 10)

    def forward(self, pixels):
        return self.head(self.features(pixels))


def build():
    torch.manual_seed(0)
    return TinyCNN().eval(), {"pixels": torch.rand(2, 3, 64, 64)}
'''
TINY_CNN_LAYERS = '''
import torch


def head(features, classes):
    return torch.nn.Linear(features, classes)
'''
README = Path(__file__).resolve().parents[2] / "docs" / "models.md"  # the recipes users read


def readme_cnn_recipe() -> str:
    """The CNN recipe README shows, verbatim: what the README tells users is what this test builds."""
    blocks = re.findall(r"```toml\n(.*?)```", README.read_text(), re.S)
    return next(b for b in blocks if 'factory = "tiny_cnn:build"' in b)


# Added to README's recipe here: a smaller batch, the engines where TensorRT is installed, the repository.
CNN_RECIPE_TAIL = '''
[shapes]
max_batch = 8

[tensorrt]
enabled = {trt}

[repository]
path = "{repo}"
'''
# No [[inputs]]/[[outputs]]: they are read from the graph.
ONNX_RECIPE = '''
precisions = ["fp32", "fp16", "int8"]

[model]
name = "two-inputs"
task = "generic"

[source]
kind = "onnx"
path = "two_inputs.onnx"

[shapes]
max_batch = 8
max_sequence_length = 32
sequence_buckets = [8, 32]

# y is computed per position and g from b alone, so zeros padded along seq change neither: requests of
# different lengths may share a launch (a model without that property keeps the default, false).
# A window gathers for 100 ms and is padded to its longest, so the test sees padded launches sliced back.
[batching]
pad_sequences = true
grouping = "pad_to_longest"
max_queue_delay_us = 100000

[quantization]
calibration_data = "calib.npz"
heldout_data = "heldout.npz"
min_accuracy = 0.99

[tensorrt]
enabled = {trt}

[repository]
path = "{repo}"
'''


def make_two_input_onnx(path: Path) -> Path:
    """``a`` FP32 [batch, seq, 8] and ``b`` FP32 [batch, 8] (one dynamic axis: seq) ->
    ``y`` = tanh(a W1 + b W2) per position [batch, seq, 16] and ``g`` = b W3 [batch, 4]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = {n: numpy_helper.from_array(rng.normal(0, 0.4, s).astype(np.float32), n)
               for n, s in (("W1", (8, 16)), ("W2", (8, 16)), ("W3", (8, 4)))}
    nodes = [helper.make_node("MatMul", ["a", "W1"], ["aw"]), helper.make_node("MatMul", ["b", "W2"], ["bw"]),
             helper.make_node("Unsqueeze", ["bw", "axes"], ["bw3"]), helper.make_node("Add", ["aw", "bw3"], ["s"]),
             helper.make_node("Tanh", ["s"], ["y"]), helper.make_node("MatMul", ["b", "W3"], ["g"])]
    graph = helper.make_graph(
        nodes, "two_inputs",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", "seq", 8]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 16]),
         helper.make_tensor_value_info("g", TensorProto.FLOAT, ["batch", 4])],
        list(weights.values()) + [helper.make_tensor("axes", TensorProto.INT64, [1], [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def make_mixed_dtype_onnx(path: Path) -> Path:
    """``ids`` INT32 [batch, seq], ``keep`` BOOL [batch, seq], ``scale`` FP16 [batch, 1] ->
    ``y`` FP32 [batch, seq] = ids * keep * scale: the other dtypes a recipe may declare, through the server."""
    import onnx
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Cast", ["ids"], ["idf"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["keep"], ["kf"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["scale"], ["sf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["idf", "kf"], ["p"]), helper.make_node("Mul", ["p", "sf"], ["y"])]
    graph = helper.make_graph(
        nodes, "mixed",
        [helper.make_tensor_value_info("ids", TensorProto.INT32, ["batch", "seq"]),
         helper.make_tensor_value_info("keep", TensorProto.BOOL, ["batch", "seq"]),
         helper.make_tensor_value_info("scale", TensorProto.FLOAT16, ["batch", 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """Both models built by the console script (as a user runs it) into one repository, served by one Triton."""
    from model_factory.build_engines.tensorrt import tensorrt_available
    from model_factory.serving.server import ServerOptions, TritonServer

    # TensorRT-RTX compiles engines on a CPU (ahead of time); serving here falls back to ONNX Runtime.
    trt = "true" if tensorrt_available() else "false"
    root = tmp_path_factory.mktemp("zoo-generic")
    repo = root / "model_repository"
    rng = np.random.default_rng(1)
    cnn_dir = root / "cnn"
    cnn_dir.mkdir()
    (cnn_dir / "tiny_cnn.py").write_text(TINY_CNN)
    (cnn_dir / "tiny_cnn_layers.py").write_text(TINY_CNN_LAYERS)
    np.savez(cnn_dir / "images.npz", pixels=rng.random((40, 3, 64, 64), dtype=np.float32))
    (cnn_dir / "cnn.toml").write_text(readme_cnn_recipe() + CNN_RECIPE_TAIL.format(repo=repo, trt=trt))
    onnx_dir = root / "onnx"
    onnx_dir.mkdir()
    make_two_input_onnx(onnx_dir / "two_inputs.onnx")
    for name, n in (("calib", 32), ("heldout", 12)):
        np.savez(onnx_dir / f"{name}.npz", a=rng.normal(size=(n, 12, 8)).astype(np.float32),
                 b=rng.normal(size=(n, 8)).astype(np.float32))
    (onnx_dir / "two.toml").write_text(ONNX_RECIPE.format(repo=repo, trt=trt))
    make_mixed_dtype_onnx(onnx_dir / "mixed.onnx")
    (onnx_dir / "mixed.toml").write_text(f'[model]\nname = "mixed-dtypes"\ntask = "generic"\n[source]\nkind = "onnx"\n'
                                         f'path = "mixed.onnx"\n[shapes]\nmax_batch = 8\nmax_sequence_length = 16\n'
                                         f'sequence_buckets = [16]\n[repository]\npath = "{repo}"\n')
    # The console script, run from elsewhere with no PYTHONPATH: the factory module beside the recipe imports.
    cli = Path(sys.executable).parent / "model-factory"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for recipe in (cnn_dir / "cnn.toml", onnx_dir / "two.toml", onnx_dir / "mixed.toml"):
        done = subprocess.run([str(cli), "build", str(recipe)], cwd=root, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    server = TritonServer(repo, options=ServerOptions(0, 0, 0)).start()
    yield {"server": server, "repo": repo, "cnn_dir": cnn_dir, "onnx": onnx_dir / "two_inputs.onnx",
           "mixed": onnx_dir / "mixed.onnx", "trt": trt}
    server.stop()


def _torch_cnn(cnn_dir: Path):
    import torch

    sys.path.insert(0, str(cnn_dir))  # only to load the source model for the reference answers
    try:
        spec = importlib.util.spec_from_file_location("zoo_tiny_cnn", cnn_dir / "tiny_cnn.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model, _ = module.build()
    finally:
        sys.path.remove(str(cnn_dir))
        sys.modules.pop("tiny_cnn_layers", None)
    return lambda x: model(torch.from_numpy(x)).detach().numpy()


def test_both_models_load_and_every_precision_passed_its_gate(zoo) -> None:
    server, repo = zoo["server"], zoo["repo"]
    assert sorted(server.ready_models) == ["mixed-dtypes", "tiny-cnn", "two-inputs"], server.log_tail()
    log = server.log_file.read_text(errors="replace")
    assert "Unexpected input data type" not in log
    for model in ("tiny-cnn", "two-inputs"):
        # What each stage built (the version folder holds what the deployment serves).
        work = repo.parent / "build" / model
        # model.int8.w7.onnx (7-bit weights, for CPUs without VNNI/AMX) is kept only when it passes the gate.
        built = {p.name for p in (work / "quantize").glob("model.*.onnx")} - {"model.int8.w7.onnx"}
        assert built == {"model.fp16.onnx", "model.int8.onnx"}
        assert (repo / model / "1" / "model.onnx").is_file()
        report = json.loads((work / "quantize" / "accuracy.json").read_text())
        assert report["passed"] and {r["precision"] for r in report["results"]} == {"fp16", "int8"}
        assert all(r["metric"] == "cosine" and r["score"] >= 0.99 for r in report["results"])
        int8 = next(r for r in report["results"] if r["precision"] == "int8")
        assert int8["int8_nodes"] >= 1  # Conv/Gemm (CNN), MatMul (ONNX) really run in INT8
        if zoo["trt"] == "true":
            plans = {p: json.loads((work / "engines" / f"model.{p}.plan.json").read_text())
                     for p in ("fp32", "fp16", "int8")}
            # A fixed-shape model gets one profile; the sequence model one per bucket.
            assert {len(m["profiles"]) for m in plans.values()} == {1 if model == "tiny-cnn" else 2}
    for model, pad in (("two-inputs", "true"), ("tiny-cnn", "false")):
        config = (repo / model / "config.pbtxt").read_text()
        assert re.search(r'key: "pad_sequences"\s+value \{\s+string_value: "%s"' % pad, config), config


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_cnn_answers_like_torch(zoo, protocol: str) -> None:
    from model_factory.measure.client import infer_tensors

    server = zoo["server"]
    url = server.http_url if protocol == "http" else server.grpc_url
    reference = _torch_cnn(zoo["cnn_dir"])
    rng = np.random.default_rng(2)
    requests = [rng.random((n, 3, 64, 64), dtype=np.float32) for n in (1, 3, 2, 5, 1)]
    with concurrent.futures.ThreadPoolExecutor(5) as pool:  # one window: plain batches, split at max_batch
        answers = list(pool.map(lambda x: infer_tensors(url, "tiny-cnn", {"pixels": x}, protocol), requests))
    for x, got in zip(requests, answers):
        assert got["logits"].shape == (x.shape[0], 10)
        np.testing.assert_allclose(got["logits"], reference(x), atol=1e-4)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_two_input_onnx_answers_like_onnxruntime(zoo, protocol: str) -> None:
    from model_factory.build_engines.export import onnxruntime_session
    from model_factory.measure.client import infer_tensors

    server = zoo["server"]
    url = server.http_url if protocol == "http" else server.grpc_url
    source = onnxruntime_session(zoo["onnx"])
    rng = np.random.default_rng(3)
    requests = [{"a": rng.normal(size=(n, length, 8)).astype(np.float32), "b": rng.normal(size=(n, 8)).astype(np.float32)}
                for n, length in ((1, 5), (2, 32), (1, 5), (3, 1), (1, 17))]
    with concurrent.futures.ThreadPoolExecutor(5) as pool:  # mixed lengths in one window
        answers = list(pool.map(lambda f: infer_tensors(url, "two-inputs", f, protocol), requests))
    for feeds, got in zip(requests, answers):
        want_y, want_g = source.run(["y", "g"], feeds)
        assert got["y"].shape == want_y.shape and got["g"].shape == want_g.shape
        np.testing.assert_allclose(got["y"], want_y, atol=1e-5)
        np.testing.assert_allclose(got["g"], want_g, atol=1e-5)
    # The answers above came from launches padded along seq (more tokens computed than sent), sliced back.
    computed, real = _tokens(server, "two-inputs")
    assert computed > real > 0


def _tokens(server, model: str) -> tuple[float, float]:
    """The backend's computed and real token counters for ``model`` (sent about once a second)."""
    import time
    import urllib.request

    deadline = time.monotonic() + 5
    while True:
        with urllib.request.urlopen(server.metrics_url, timeout=5) as r:
            body = r.read().decode()
        values = {}
        for name in ("computed", "real"):  # summed over the model's instances (one series each)
            found = re.findall(rf'^model_factory_{name}_tokens_total{{[^}}]*model="{model}"[^}}]*}} (\S+)$', body, re.M)
            values[name] = sum(float(v) for v in found)
        if values["computed"] > values["real"] or time.monotonic() > deadline:
            return values["computed"], values["real"]
        time.sleep(0.2)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_int32_bool_fp16_inputs_answer_like_onnxruntime(zoo, protocol: str) -> None:
    from model_factory.build_engines.export import onnxruntime_session
    from model_factory.measure.client import infer_tensors

    server = zoo["server"]
    url = server.http_url if protocol == "http" else server.grpc_url
    source = onnxruntime_session(zoo["mixed"])
    rng = np.random.default_rng(5)
    requests = [{"ids": rng.integers(-50, 50, (n, length)).astype(np.int32), "keep": rng.random((n, length)) > 0.3,
                 "scale": rng.normal(size=(n, 1)).astype(np.float16)} for n, length in ((1, 4), (2, 9), (1, 4), (3, 16))]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # no attention mask: only equal lengths share a launch
        answers = list(pool.map(lambda f: infer_tensors(url, "mixed-dtypes", f, protocol), requests))
    for feeds, got in zip(requests, answers):
        np.testing.assert_array_equal(got["y"], source.run(["y"], feeds)[0])


def _status(exc: Exception) -> str:
    return str(getattr(exc, "status", lambda: "")())


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_bad_request_is_answered_400_alone(zoo, protocol: str) -> None:
    from model_factory.measure.client import infer_tensors

    server = zoo["server"]
    url = server.http_url if protocol == "http" else server.grpc_url
    rng = np.random.default_rng(4)
    good = {"a": rng.normal(size=(1, 6, 8)).astype(np.float32), "b": rng.normal(size=(1, 8)).astype(np.float32)}
    too_long = {"a": np.zeros((1, 33, 8), np.float32), "b": np.zeros((1, 8), np.float32)}  # max_sequence_length 32
    cases = [("two-inputs", good), ("two-inputs", too_long), ("two-inputs", good),
             ("tiny-cnn", {"pixels": rng.random((1, 3, 64, 64), dtype=np.float32)}),
             ("tiny-cnn", {"pixels": rng.random((1, 3, 64, 64)).astype(np.float64)})]  # wrong dtype

    def ask(case):
        try:
            return infer_tensors(url, case[0], case[1], protocol)
        except Exception as exc:  # tritonclient's InferenceServerException
            return exc

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(ask, cases))
    assert [isinstance(a, Exception) for a in answers] == [False, True, False, False, True], answers
    bad = "400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT"
    assert _status(answers[1]) == bad and "sequence length 33 exceeds the maximum 32" in str(answers[1])
    assert _status(answers[4]) == bad
    assert answers[0]["y"].shape == (1, 6, 16) and answers[3]["logits"].shape == (1, 10)
