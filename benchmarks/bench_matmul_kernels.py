"""ONNX Runtime's CPU kernels for one quantized MatMul at a model's shape: which is fastest at 1, 8 and 32 rows.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_matmul_kernels.py [--shapes 640x262144,2048x640] [--rows 1,8,32]
        [--rounds 2] [--write]

Issue 49: Gemma 3 270M's LM head (640 x 262,144, tied: 63 % of the weights) and its ``down_proj`` (2048 x 640, kept in
float by INT8 dynamic's gate ladder) decide much of a decode step at 8 and 32 rows (``bench_decode_profile``). Each
shape as a one-node graph on random weights (the speed does not depend on their values), 2 intra-op threads:

- ``fp32``: MatMul in float;
- ``dynamic``: DynamicQuantizeLinear + MatMulInteger (u8 activations, s8 weights per output channel) + the scales, as
  ``int8_method = "dynamic"`` writes it (ONNX Runtime fuses it into DynamicQuantizeMatMul);
- ``nbits8`` / ``nbits4``: MatMulNBits at 8 / 4 bits, block 32, accuracy level 4 (int8 activations), ONNX Runtime's
  own quantizer, as INT8 weight-only and INT4 write it;
- ``kernel``: the ``dynamic`` graph with its MatMulInteger -> Cast -> Mul on the factory's ``Int8MatMulToFloat``
  (``backends/python_backend/generation/int8_matmul.py``, compiled for this host: AVX-512 VNNI, or AVX2's
  vpmaddubsw), as ``int8_matmul = "kernel"`` serves it. ``dynamic`` and ``kernel`` both take 7-bit weights (what
  INT8 dynamic writes, so AVX2's u8 x s8 pairs stay within int16); the CPU's flags are in the header.

CPU milliseconds per call (process time: both threads), the median over the rounds with the range; the wall time
beside it. The section between ``<!-- matmul_kernels:start -->`` and ``<!-- matmul_kernels:end -->`` is replaced.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks.results_file import publish, say, suffixed  # noqa: E402

START, END = "<!-- matmul_kernels:start -->", "<!-- matmul_kernels:end -->"
KINDS = ("fp32", "dynamic", "kernel", "nbits8", "nbits4")


def _options(ort):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.log_severity_level = 3
    return opts


def sessions(k: int, n: int) -> dict:
    """One session per kind for a ``k x n`` weight."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).normal(0, 0.05, (k, n)).astype(np.float32)
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])
    y_info = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]

    def session(model) -> object:
        return ort.InferenceSession(model.SerializeToString(), _options(ort), providers=["CPUExecutionProvider"])

    def graph(nodes, inits):
        return helper.make_model(helper.make_graph(nodes, "g", [x_info], [y_info], inits), opset_imports=opsets)

    out = {"fp32": session(graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
                                 [numpy_helper.from_array(w, "w")]))}
    scale = (np.abs(w).max(axis=0) / 63.0).astype(np.float32)  # 7-bit, as INT8 dynamic writes its weights
    q = np.clip(np.round(w / scale), -63, 63).astype(np.int8)
    dynamic = graph([
        helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
        helper.make_node("MatMulInteger", ["xq", "wq", "xz", "wz"], ["yi"]),
        helper.make_node("Cast", ["yi"], ["yf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["xs", "ws"], ["sc"]),
        helper.make_node("Mul", ["yf", "sc"], ["y"])],
        [numpy_helper.from_array(q, "wq"), numpy_helper.from_array(np.zeros(n, np.int8), "wz"),
         numpy_helper.from_array(scale, "ws")])
    out["dynamic"] = session(dynamic)
    from model_factory.backend.generation import int8_matmul

    lib = int8_matmul.library(int8_matmul.SOURCE, name=int8_matmul.LIBRARY_NAME)
    if int8_matmul.rewrite_chains(dynamic) != 1:
        raise SystemExit("the factory's operator did not take the dynamic graph's MatMulInteger chain")
    opts = _options(ort)
    opts.register_custom_ops_library(str(lib))
    out["kernel"] = ort.InferenceSession(dynamic.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    for bits in (8, 4):
        model = graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [numpy_helper.from_array(w, "w")])
        quant = MatMulNBitsQuantizer(model, algo_config=DefaultWeightOnlyQuantConfig(
            block_size=32, is_symmetric=True, accuracy_level=4, bits=bits))
        quant.process()
        out[f"nbits{bits}"] = session(quant.model.model)
    return out


def time_call(sess, x: np.ndarray, calls: int) -> tuple[float, float]:
    sess.run(None, {"x": x})
    c, w = time.process_time(), time.perf_counter()
    for _ in range(calls):
        sess.run(None, {"x": x})
    return (time.process_time() - c) / calls * 1000, (time.perf_counter() - w) / calls * 1000


def main() -> int:
    from benchmarks.harness.run_header import LoadReading, run_header

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="640x262144,2048x640", help="K x N of the weight, a comma list")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--section-suffix", default="", help="appended to the section's markers and title (a run on "
                    "another machine kept beside the first: --section-suffix epyc)")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    load = LoadReading.begin()
    rows = [int(r) for r in args.rows.split(",")]
    table: dict = {}
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.lower().split("x"))
        say(f"{k} x {n}: making the sessions")
        made = sessions(k, n)
        calls = max(3, int(2e8 // (k * n)))  # about the same time per cell whatever the shape
        rng = np.random.default_rng(k)
        for r in range(args.rounds):
            for m in rows:
                x = rng.normal(0, 1, (m, k)).astype(np.float32)
                for kind in KINDS:
                    table.setdefault((shape, m, kind), []).append(time_call(made[kind], x, calls))
                say(f"round {r + 1} {shape} rows {m}: " + ", ".join(
                    f"{kind} {table[(shape, m, kind)][-1][0]:.2f} ms" for kind in KINDS))
        del made

    def cell(values: list[tuple[float, float]]) -> str:
        cpu = [v[0] for v in values]
        wall = statistics.median(v[1] for v in values)
        return (f"{statistics.median(cpu):.2f} ({min(cpu):.2f}-{max(cpu):.2f})" if len(cpu) > 1
                else f"{cpu[0]:.2f}") + f" [{wall:.2f}]"

    start, end, title = suffixed(START, END, args.section_suffix)
    lines = [start, f"## One quantized MatMul's kernels at a model's shape (`matmul_kernels`){title}", "",
             run_header("benchmarks/bench_matmul_kernels.py", load.finish()), "",
             "One-node graphs, random weights, 2 intra-op threads; CPU ms per call (both threads), median (range) over "
             f"{args.rounds} rounds, [wall ms median]. `dynamic`: DynamicQuantizeLinear + MatMulInteger (INT8 "
             "dynamic, 7-bit weights); `kernel`: the same graph on the factory's Int8MatMulToFloat (`int8_matmul = "
             "\"kernel\"`); `nbits8` / `nbits4`: MatMulNBits block 32, accuracy level 4 (INT8 weight-only / INT4).", "",
             "| weight (K x N) | rows | " + " | ".join(KINDS) + " |", "| --- | ---: |" + " ---: |" * len(KINDS)]
    for shape in args.shapes.split(","):
        for m in rows:
            lines.append(f"| {shape} | {m} | " + " | ".join(cell(table[(shape, m, kind)]) for kind in KINDS) + " |")
    lines.append(end)
    publish("\n".join(lines), HERE / "RESULTS.md", start, end, args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
