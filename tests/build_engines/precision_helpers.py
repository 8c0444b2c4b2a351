"""Helpers shared by the quantize / accuracy / engine tests (imported by conftest and test modules)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import numpy as np

EXAMPLES = Path(__file__).resolve().parents[2] / "model_factory" / "examples"
EXAMPLE = EXAMPLES / "minilm.toml"


def minilm_precision_recipe(root: Path, **overrides):
    """The shipped MiniLM recipe with FP16 + INT8, the example data and the 0.99 gate, under ``root``."""
    from model_factory.recipe import load_recipe

    base = {
        "repository.path": str(root / "model_repository"),
        "precisions": ["fp32", "fp16", "int8"],
        "quantization.calibration_data": str(EXAMPLES / "calibration.txt"),
        "quantization.heldout_data": str(EXAMPLES / "heldout.txt"),
        "quantization.min_accuracy": 0.99,
    }
    base.update(overrides)
    return load_recipe(EXAMPLE, base)


# --------------------------------------------------------------------------- a tiny ONNX model


def tiny_model(seed: int = 0):
    """A small attention-like graph: a mask path, weight MatMuls, activation MatMuls and a Gemm head.

    Inputs ``x`` [B, S, 8] (float) and ``attention_mask`` [B, S] (int64); outputs ``hidden`` [B, S, 16]
    and ``logits`` [B, 4]. ``mask_proj`` is a MatMul that reads the mask path and must never be quantized.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (8, 16)).astype(np.float32), "w_in"),
        numpy_helper.from_array(rng.normal(0, 0.5, (1, 16)).astype(np.float32), "w_mask"),
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 16)).astype(np.float32), "w_head"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array(-10000.0, np.float32), "neg"),
        numpy_helper.from_array(np.array([1], np.int64), "axis1"),
        numpy_helper.from_array(np.array([-1], np.int64), "axis_last"),
        numpy_helper.from_array(np.array([0, 2, 1], np.int64), "perm"),
    ]
    nodes = [
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], name="mask_cast", to=TensorProto.FLOAT),
        helper.make_node("Sub", ["one", "mask_f"], ["mask_inv"], name="mask_sub"),
        helper.make_node("Mul", ["mask_inv", "neg"], ["mask_add"], name="mask_mul"),
        helper.make_node("Unsqueeze", ["mask_add", "axis1"], ["mask_add3"], name="mask_unsq"),
        helper.make_node("MatMul", ["x", "w_in"], ["h"], name="proj_in"),
        helper.make_node("Relu", ["h"], ["h_act"], name="relu"),
        helper.make_node("Transpose", ["h_act"], ["h_t"], name="transpose", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["h_act", "h_t"], ["scores"], name="scores"),
        helper.make_node("Add", ["scores", "mask_add3"], ["scores_masked"], name="add_mask"),
        helper.make_node("Softmax", ["scores_masked"], ["probs"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["probs", "h_act"], ["ctx"], name="context"),
        helper.make_node("Unsqueeze", ["mask_f", "axis_last"], ["mask_f3"], name="mask_unsq2"),
        helper.make_node("MatMul", ["mask_f3", "w_mask"], ["mask_emb"], name="mask_proj"),
        helper.make_node("Add", ["ctx", "mask_emb"], ["hidden"], name="residual"),
        helper.make_node("ReduceMean", ["hidden"], ["pooled"], name="pool", axes=[1], keepdims=0),
        helper.make_node("Gemm", ["pooled", "w_head"], ["logits"], name="head", transB=1),
    ]
    graph = helper.make_graph(
        nodes, "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "seq", 16]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])],
        initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def tiny_feeds(n: int = 12, seq: int = 6, seed: int = 1) -> dict[str, np.ndarray]:
    """Inputs for :func:`tiny_model` (synthetic: this model has no real data)."""
    rng = np.random.default_rng(seed)
    mask = np.ones((n, seq), np.int64)
    for i in range(n):
        mask[i, seq - (i % 3):] = 0
    return {"x": rng.normal(0, 1, (n, seq, 8)).astype(np.float32), "attention_mask": mask}


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def write_recipe(root: Path, precisions: list[str], export_dir: Path | None = None) -> Path:
    """A recipe file for CLI tests: the MiniLM example plus precisions and the example data, under ``root``.

    When ``export_dir`` is given it is linked in as the recipe's export stage output, so stand-alone
    commands find it without exporting again.
    """
    # The example's own precisions and [quantization] table (paths relative to the example) are
    # replaced by this test's.
    text = re.sub(r"(?m)^precisions = .*$", "", EXAMPLE.read_text())
    text = re.sub(r"(?ms)^\[quantization\]$.*?(?=^\[)", "", text)
    recipe = root / "recipe.toml"
    recipe.write_text(
        f"precisions = {precisions!r}\n".replace("'", '"') + text
        + "\n[quantization]\n"
        + f'calibration_data = "{EXAMPLES / "calibration.txt"}"\nheldout_data = "{EXAMPLES / "heldout.txt"}"\n'
        + "min_accuracy = 0.99\nmax_calibration_samples = 16\n")
    if export_dir is not None:
        work = root / "build" / "minilm"  # recipe.work_dir for repository.path = <root>/model_repository
        work.mkdir(parents=True)
        # Hard links (a copy where they cannot be made), not a link to the folder: the command's stage runs behind
        # the build's walls, which let it read its own work folder, not the session's shared export it points to.
        shutil.copytree(export_dir, work / "export", copy_function=_link_or_copy)
    return recipe
