"""The torch engine (the export's ExportedProgram, model.pt2; TorchScript from older repositories) on the CPU:
same outputs as ONNX Runtime, names checked.

The CUDA path (stream, host copies, allocator, memory stats) runs only on a GPU: the ``gpu`` test
below, and benchmarks/gpu_checks.py's Triton check.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest

from model_factory.backend.engines import torch as torch_engine
from model_factory.backend.engines.base import Engine, EngineError
from model_factory.backend.engines.onnxruntime import OnnxRuntimeEngine
from model_factory.backend.engines.torch import TorchEngine

# The hand-made traces below stand for repositories built before torch.export: TorchScript warns it is deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A small token-id encoder exported with export.torchscript = true: (onnx bytes, model.pt2 bytes)."""
    from tiny_torch_models import encoder_recipe, write_factory

    from model_factory.build_engines.export import export_model
    from model_factory.recipe import parse_recipe

    root = tmp_path_factory.mktemp("torch-engine")
    with pytest.MonkeyPatch.context() as mp:
        name = write_factory(root, mp)
        res = export_model(parse_recipe(encoder_recipe(f"{name}:make", torchscript=True), root))
    return res.onnx_path.read_bytes(), res.torchscript_path.read_bytes()


def _feeds(batch: int = 4, length: int = 9, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 50, (batch, length))
    mask = np.ones_like(ids)
    mask[0, length // 2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_cpu_outputs_match_onnxruntime(exported) -> None:
    onnx, ts = exported
    engine, ort = TorchEngine(ts, "cpu"), OnnxRuntimeEngine(onnx)
    assert isinstance(engine, Engine) and engine.flavour == "torch" and engine.format == "ExportedProgram"
    assert engine.input_names == ort.input_names == ("input_ids", "attention_mask")
    assert engine.output_names == ort.output_names == ("last_hidden_state", "embedding")
    for batch, length in ((1, 1), (4, 9), (7, 16)):
        feeds = _feeds(batch, length)
        got, want = engine.run(feeds, profile=0), ort.run(feeds)
        for name in engine.output_names:
            assert isinstance(got[name], np.ndarray) and got[name].dtype == np.float32
            np.testing.assert_allclose(got[name], want[name], atol=1e-5)
    assert engine.memory_stats() == {} and engine.pool is None and engine.allocator_backend is None
    # No device memory to guard on the CPU: the executor's memory check launches every group.
    assert engine.activation_bytes(4, 9) is None and engine.free_device_bytes() is None
    engine.close()
    engine.close()  # idempotent
    with pytest.raises(EngineError, match="closed"):
        engine.run(_feeds())


def test_inputs_are_checked_by_name(exported) -> None:
    engine = TorchEngine(exported[1], "cpu")
    with pytest.raises(EngineError, match=r"missing \['attention_mask'\].*unknown \['x'\]"):
        engine.run({"input_ids": np.ones((1, 2), np.int64), "x": np.ones((1, 2), np.int64)})


def test_vocab_size_refuses_ids_on_the_host(exported) -> None:
    engine = TorchEngine(exported[1], "cpu", vocab_size=50)
    feeds = _feeds()
    engine.run(feeds)
    feeds["input_ids"][1, 2] = 50
    with pytest.raises(EngineError, match=r"outside \[0, 50\)"):
        engine.run(feeds)


def test_names_given_must_agree_with_the_file(exported) -> None:
    ts = exported[1]
    TorchEngine(ts, "cpu", input_names=["input_ids", "attention_mask"],
                output_names=["last_hidden_state", "embedding"])
    with pytest.raises(EngineError, match="were expected: repackage"):
        TorchEngine(ts, "cpu", input_names=["attention_mask", "input_ids"],
                    output_names=["last_hidden_state", "embedding"])


def _bare_trace() -> bytes:
    """A TorchScript file without the export's names (as made by hand)."""
    import torch

    traced = torch.jit.trace(torch.nn.Linear(3, 2).eval(), (torch.ones(1, 3),))
    buf = io.BytesIO()
    torch.jit.save(traced, buf)
    return buf.getvalue()


def test_file_without_names_needs_them_given() -> None:
    data = _bare_trace()
    with pytest.raises(EngineError, match="names no inputs/outputs"):
        TorchEngine(data, "cpu")
    engine = TorchEngine(data, "cpu", input_names=["x"], output_names=["y"])
    assert engine.run({"x": np.ones((2, 3), np.float32)})["y"].shape == (2, 2)
    with pytest.raises(EngineError, match="takes 1 inputs.*names 2"):
        TorchEngine(data, "cpu", input_names=["x", "z"], output_names=["y"])
    with pytest.raises(EngineError, match="returned 1 tensors, expected 2"):
        TorchEngine(data, "cpu", input_names=["x"], output_names=["y", "w"]).run({"x": np.ones((1, 3), np.float32)})


def test_bad_bytes_are_an_engine_error() -> None:
    with pytest.raises(EngineError, match="cannot load the TorchScript file"):
        TorchEngine(b"not a zip archive", "cpu")
    with pytest.raises(EngineError, match="takes the TorchScript file's bytes"):
        TorchEngine(Path("model.torchscript.pt"), "cpu")  # type: ignore[arg-type]


def test_cuda_without_cuda_says_why(exported) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert "no usable CUDA" in torch_engine.cuda_unavailable_reason(0)
    with pytest.raises(EngineError, match="needs CUDA"):
        TorchEngine(exported[1], "cuda:0")


def test_allocator_backend_is_set_only_before_torch_and_never_over_the_user(monkeypatch) -> None:
    monkeypatch.setattr(torch_engine, "_SET_HERE", False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert "set by the user" in torch_engine.configure_cuda_allocator()
    assert torch_engine.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert "already fixed" in torch_engine.configure_cuda_allocator()  # torch is imported in this process
    assert "PYTORCH_CUDA_ALLOC_CONF" not in torch_engine.os.environ
    monkeypatch.delitem(sys.modules, "torch")  # as in a fresh Triton stub, before anything imported torch
    assert "set PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync" in torch_engine.configure_cuda_allocator()
    assert torch_engine.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"
    assert "set PYTORCH_CUDA_ALLOC_CONF" in torch_engine.configure_cuda_allocator()  # idempotent


def test_backend_package_imports_without_torch() -> None:
    import subprocess

    code = ("import sys; sys.modules['torch'] = None\n"
            "import model_factory.backend.engines.torch as t, model_factory.backend.engines.loading\n"
            "print(t.cuda_unavailable_reason(0))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "torch is not installed" in out.stdout


def _traced_encoder() -> bytes:
    """An encoder traced and saved here with the export's name file (no model_factory export needed:
    the GPU machine runs this test from a plain checkout)."""
    import json

    import torch

    torch.manual_seed(0)

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(50, 64)
            self.proj = torch.nn.Linear(64, 64)

        def forward(self, input_ids, attention_mask):  # noqa: ANN001
            hidden = torch.tanh(self.proj(self.embed(input_ids)))
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            return hidden, (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)

    feeds = _feeds()
    with torch.no_grad():
        traced = torch.jit.trace(Encoder().eval(), tuple(torch.from_numpy(feeds[n]) for n in feeds))
    buf = io.BytesIO()
    names = {"inputs": ["input_ids", "attention_mask"], "outputs": ["last_hidden_state", "embedding"]}
    torch.jit.save(traced, buf, _extra_files={torch_engine.IO_EXTRA_FILE: json.dumps(names)})
    return buf.getvalue()


@pytest.mark.gpu
def test_cuda_outputs_match_cpu_and_report_memory() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    ts = _traced_encoder()
    cpu, gpu = TorchEngine(ts, "cpu"), TorchEngine(ts, "cuda:0")
    assert gpu.device == "cuda:0" and gpu.allocator_backend in ("native", "cudaMallocAsync")
    for batch, length in ((1, 3), (64, 128), (16, 16)):
        feeds = _feeds(batch, length)
        got, want = gpu.run(feeds), cpu.run(feeds)
        for name in gpu.output_names:
            assert got[name].flags.owndata or got[name].base is not None
            np.testing.assert_allclose(got[name], want[name], atol=1e-4)
    stats = gpu.memory_stats()
    assert stats["reserved_bytes"] > 0 and stats["high_water_bytes"] >= stats["reserved_bytes"]
    assert stats["used_high_water_bytes"] >= stats["used_bytes"]
    assert gpu.pool.stats().high_water >= stats["high_water_bytes"]
    gpu.pool.trim(0)  # what the idle trimmer calls
    gpu.close()
    assert gpu.pool.closed


def test_device_constants_of_the_trace_follow_the_engine() -> None:
    """A trace records ``x.device`` as a constant; the engine points it at its own device."""
    import json

    import torch

    class Positions(torch.nn.Module):
        def forward(self, x):  # noqa: ANN001
            return x + torch.arange(x.shape[1], device=x.device).to(x.dtype)

    traced = torch.jit.trace(Positions(), (torch.zeros(2, 4),))
    # As if traced on another device: the constant says "meta", and the module would compute there.
    moved = torch_engine.retarget_device_constants(traced, "meta")
    assert moved >= 1 and 'device("meta")' in traced.code
    buf = io.BytesIO()
    torch.jit.save(traced, buf, _extra_files={torch_engine.IO_EXTRA_FILE: json.dumps({"inputs": ["x"],
                                                                                        "outputs": ["y"]})})
    engine = TorchEngine(buf.getvalue(), "cpu")
    assert engine.retargeted == moved
    out = engine.run({"x": np.zeros((3, 5), np.float32)})["y"]
    np.testing.assert_array_equal(out, np.tile(np.arange(5, dtype=np.float32), (3, 1)))
