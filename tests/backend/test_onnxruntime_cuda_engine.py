"""The ONNX Runtime CUDA engine without a GPU: a fake ``onnxruntime`` (CUDA provider, I/O binding) over the
fake CUDA runtime and host-memory pool of the TensorRT engine's tests.

Checked here: the provider options (the instance's stream, device, arena strategy), inputs copied into pool
buffers on the instance stream and bound by device pointer, outputs bound to pool buffers when their shape
follows from the inputs (else left to ONNX Runtime), every buffer freed, and the refusals (CPU wheel, a
session that fell back to the CPU provider). The fake's API names are checked against the real
``onnxruntime`` installed here. A real run: the gpu test below, on a GPU with onnxruntime-gpu.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

from model_factory.backend.engines.base import Engine, EngineError
from model_factory.backend.engines.onnxruntime import CUDA_PROVIDER, OnnxRuntimeCudaEngine
from test_tensorrt_engine import FakeCuda, HostPool


class FakeBinding:
    def __init__(self, session):
        self.session = session
        self.inputs: dict[str, tuple] = {}
        self.outputs: dict[str, tuple] = {}

    def bind_input(self, name, device_type, device_id, element_type, shape, buffer_ptr):
        self.inputs[name] = (device_type, device_id, np.dtype(element_type), tuple(shape), buffer_ptr)

    def bind_output(self, name, device_type="cpu", device_id=0, element_type=None, shape=None, buffer_ptr=None):
        self.outputs[name] = (device_type, device_id, element_type, None if shape is None else tuple(shape), buffer_ptr)

    def copy_outputs_to_cpu(self):
        return [self.session.computed[n] for n in self.outputs]


class FakeSession:
    """x [n, s] int64 -> hidden [n, s, 2] (float, shape from the inputs), pooled [n, "dynamic"] (ORT-allocated)."""

    def __init__(self, source, sess_options=None, providers=None, cpu_only=False):
        self.source, self.providers = source, providers
        self._used = ["CPUExecutionProvider"] if cpu_only else [CUDA_PROVIDER, "CPUExecutionProvider"]
        self.computed: dict[str, np.ndarray] = {}
        self.runs = 0

    def get_providers(self):
        return self._used

    def get_inputs(self):
        return [SimpleNamespace(name="x", shape=["batch", "seq"], type="tensor(int64)")]

    def get_outputs(self):
        return [SimpleNamespace(name="hidden", shape=["batch", "seq", 2], type="tensor(float)"),
                SimpleNamespace(name="pooled", shape=["batch", "unknown"], type="tensor(float)")]

    def io_binding(self):
        return FakeBinding(self)

    def run_with_iobinding(self, binding):
        self.runs += 1
        device_type, device_id, dtype, shape, ptr = binding.inputs["x"]
        assert device_type == "cuda" and dtype == np.int64
        x = np.frombuffer(ctypes.string_at(ptr, int(np.prod(shape)) * 8), dtype=np.int64).reshape(shape)
        hidden = np.stack([x, -x], axis=-1).astype(np.float32)
        _, _, _, out_shape, out_ptr = binding.outputs["hidden"]
        assert out_shape == hidden.shape
        ctypes.memmove(out_ptr, hidden.ctypes.data, hidden.nbytes)
        self.computed = {"hidden": hidden, "pooled": hidden.sum(axis=1)}


class FakeOrt:
    __version__ = "fake-gpu"

    def __init__(self, providers=(CUDA_PROVIDER, "CPUExecutionProvider"), cpu_only_session=False):
        self._providers = list(providers)
        self.cpu_only_session = cpu_only_session
        self.sessions: list[FakeSession] = []

    def get_available_providers(self):
        return self._providers

    class SessionOptions:
        log_severity_level = 0

    def InferenceSession(self, source, sess_options=None, providers=None):  # noqa: N802 - ORT's name
        s = FakeSession(source, sess_options, providers, cpu_only=self.cpu_only_session)
        self.sessions.append(s)
        return s


def make(ort=None, pool=None, rt=None):
    return OnnxRuntimeCudaEngine(b"onnx bytes", device_id=0, ort_module=ort or FakeOrt(), runtime=rt or FakeCuda(),
                                 pool=pool or HostPool())


def test_runs_on_the_instance_stream_with_pool_buffers_bound_by_pointer() -> None:
    ort, pool, rt = FakeOrt(), HostPool(), FakeCuda()
    engine = make(ort, pool, rt)
    assert isinstance(engine, Engine) and engine.device == "cuda:0" and engine.pool is pool
    name, options = ort.sessions[0].providers[0]
    assert name == CUDA_PROVIDER and options["user_compute_stream"] == str(0xABC)
    assert options["has_user_compute_stream"] == "1" and options["arena_extend_strategy"] == "kSameAsRequested"
    x = np.arange(6, dtype=np.int64).reshape(2, 3)
    out = engine.run({"x": x})
    np.testing.assert_array_equal(out["hidden"][..., 0], x)
    np.testing.assert_array_equal(out["pooled"], np.stack([x.sum(1), -x.sum(1)], -1))
    assert list(out) == ["hidden", "pooled"]
    # Input and the shape-known output came from the pool and went back to it; both copies on the stream.
    assert len(pool.freed) == 2 and not pool.live
    kinds = [e[1] for e in rt.log if e[0] == "copy"]
    assert kinds == ["cudaMemcpyHostToDevice", "cudaMemcpyDeviceToHost"]
    assert rt.log[-1] == ("sync", 0xABC)
    engine.close()
    engine.close()  # idempotent
    assert ("stream_destroy", 0xABC) in rt.log and pool.closed is False  # a pool passed in is the caller's
    with pytest.raises(EngineError, match="closed"):
        engine.run({"x": x})


def test_refuses_the_cpu_wheel_and_a_session_that_fell_back_to_the_cpu() -> None:
    with pytest.raises(EngineError, match="no CUDAExecutionProvider: it is the CPU wheel.*onnxruntime-gpu"):
        make(FakeOrt(providers=["CPUExecutionProvider"]))
    rt = FakeCuda()
    with pytest.raises(EngineError, match="did not enable CUDAExecutionProvider"):
        make(FakeOrt(cpu_only_session=True), rt=rt)
    assert ("stream_destroy", 0xABC) in rt.log  # nothing left behind


def test_the_fake_uses_real_onnxruntime_names() -> None:
    ort = pytest.importorskip("onnxruntime")
    assert callable(ort.get_available_providers) and hasattr(ort, "SessionOptions")
    binding_cls = ort.capi.onnxruntime_inference_collection.IOBinding
    for name in ("bind_input", "bind_output", "copy_outputs_to_cpu"):
        assert hasattr(binding_cls, name), name
    session_cls = ort.InferenceSession
    for name in ("io_binding", "run_with_iobinding", "get_providers", "get_inputs", "get_outputs"):
        assert hasattr(session_cls, name), name


def test_auto_on_a_gpu_instance_takes_onnxruntime_cuda_before_torch(tmp_path, monkeypatch) -> None:
    from model_factory.backend.engines import loading
    from model_factory.backend.engines import onnxruntime as ort_engine
    from model_factory.backend.settings import parse_settings

    v = tmp_path / "m" / "1"
    v.mkdir(parents=True)
    (v / "model.onnx").write_bytes(b"onnx bytes")
    (v / "model.torchscript.pt").write_bytes(b"never read")
    made = []

    class Engine(OnnxRuntimeCudaEngine):
        def __init__(self, data, *, device_id=0, settings=None):
            made.append(data)
            super().__init__(data, device_id=device_id, settings=settings, ort_module=FakeOrt(),
                             runtime=FakeCuda(), pool=HostPool())

    monkeypatch.setattr(ort_engine, "OnnxRuntimeCudaEngine", Engine)
    monkeypatch.setattr(ort_engine, "cuda_provider_unavailable_reason", lambda ort=None: None)
    engine, info = loading.load_engine(v, parse_settings({"name": "m"}), "GPU", 0)
    assert made == [b"onnx bytes"] and info["device"] == "cuda:0" and info["provider"] == CUDA_PROVIDER
    assert info["flavour"] == "onnxruntime" and "no fp32 plan" in info["fallback_from_tensorrt"]
    assert "fallback_from_torch" not in info
    engine.close()


@pytest.mark.gpu
def test_real_onnxruntime_cuda_engine_matches_the_cpu(tmp_path) -> None:
    ort = pytest.importorskip("onnxruntime")
    if CUDA_PROVIDER not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is not installed here (pip install 'model-factory[onnxruntime-gpu]')")
    from onnx import TensorProto, helper

    from model_factory.backend.engines.onnxruntime import OnnxRuntimeEngine

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])
    graph = helper.make_graph([helper.make_node("Tanh", ["x"], ["y"])], "g", [x], [y])
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    feeds = {"x": np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)}
    gpu = OnnxRuntimeCudaEngine(data, device_id=0)
    try:
        np.testing.assert_allclose(gpu.run(feeds)["y"], OnnxRuntimeEngine(data).run(feeds)["y"], atol=1e-5)
    finally:
        gpu.close()
