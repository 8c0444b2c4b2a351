"""The text-generation export's builder runs: what a run leaves behind in the process."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytest.importorskip("onnxruntime_genai")
pytest.importorskip("transformers")


def _mappings_of(path: Path) -> int:
    return sum(1 for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(str(path)))


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads /proc/self/maps (Linux)")
def test_builder_runs_release_the_source_weights(tmp_path):
    """The gate's ladder runs the builder up to three times in one stage: no run may keep the last one's model.

    The builder leaves its model in reference cycles; large tensors never trigger Python's collector, so (as here,
    with the collector off) each run's mapped weights stayed until the stage ended: on a 1.04B Llama the second
    INT4 run started with 6 GiB of the first still held.
    """
    from generative_models import make_causal_lm

    from model_factory.build_engines.causal_lm import run_builder

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src = make_causal_lm("llama", tmp_path / "llama", vocab_size=512)
    weights = (src / "model.safetensors").resolve()
    gc.disable()
    try:
        for i in range(2):
            graph = run_builder(src, tmp_path / f"int4-{i}", "int4", {"block_size": 32, "accuracy_level": 4})
            assert graph.is_file()
            assert _mappings_of(weights) == 0, f"run {i} left the source's weights mapped"
    finally:
        gc.enable()


def test_a_weight_only_int8_build_prints_no_error_line(tmp_path, capfd, caplog):
    """A tied model's INT8 build: the builder must not ask ONNX Runtime's quantizer to quantize the embedding's
    Gather at 8 bits (it can only at 4, and says "[ERROR] Gather only supports 4 bits quantization" while the
    build succeeds): a user reads an error line in a successful build as a failure."""
    from generative_models import make_causal_lm

    from model_factory.build_engines.causal_lm import run_builder
    from model_factory.build_engines.lm_quantize import _builder_options

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src = make_causal_lm("llama", tmp_path / "llama", vocab_size=512, tie=True)
    graph = run_builder(src, tmp_path / "int8", "int8", _builder_options("int8", "weight_only", 32, ()))
    out, err = capfd.readouterr()
    assert graph.is_file()
    import onnx

    ops = {n.op_type for n in onnx.load(str(graph), load_external_data=False).graph.node}
    assert "MatMulNBits" in ops  # the 8-bit weight-only form was built
    # The quantizer's logger writes through a handler of its own (to the stderr of its import) and propagates.
    logged = "\n".join(f"[{r.levelname}] {r.getMessage()}" for r in caplog.records)
    lines = [line for line in (out + err + logged + (graph.parent / "builder.log").read_text()).splitlines()
             if "[ERROR]" in line or "only supports 4 bits" in line]
    assert lines == [], lines
