"""Integer MatMuls with an activation scale per row (per token), for the MatMuls dynamic INT8 would keep in float.

ONNX Runtime's dynamic quantization gives a MatMul's input one scale per tensor (``DynamicQuantizeLinear``), fused
into ``DynamicQuantizeMatMul`` / ``MatMulIntegerToFloat``, whose activation scale is a scalar. One outlier row (a
token whose activations are far larger than the others': Gemma's first token) sets the scale of every row it is
batched with. Here a float ``MatMul(X, W)`` left by :func:`lm_quantize.dynamic_int8` is rewritten in standard ops:
each row of ``X`` scaled by its own ``max|x| / 127`` and rounded to uint8 around a zero point of 128, the weight
7-bit symmetric per output column as :func:`lm_quantize.dynamic_int8` stores it, the product in ``MatMulInteger``
(the same integer kernels), then the row's scale times the column's. A row's output no longer depends on the rows
batched with it (at these MatMuls). The pairs of a u8 x s8 product sum at most 2·255·64 = 32640: within int16 on a
CPU without VNNI, as the rest of the 7-bit graph.

With a group (``ROW_GROUP`` in the ladder), each row has a scale per group of inputs too, and the weight a scale per
group and column: a loud stretch of a row's inputs (Gemma's down_proj has a few) no longer coarsens the rest of
the row. Each group's product comes from a ``MatMulInteger`` of its own ([B, T, 1, G] by the group's [G, N] rows of
the 7-bit weight), the products joined, each scaled by its row's and weight's scales, then summed over the groups.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

# The ladder's marker for the step (in DYNAMIC_STEPS beside the parts kept in float; never a node name).
ROW_DOWN = "rows:down_proj"
QMAX = 127  # the activations' symmetric range per row, stored around ZERO in uint8
ZERO = 128
WEIGHT_MAX = 64  # 7-bit weights (dynamic_int8's reduce_range)
# The ladder's inputs per activation scale: on Gemma 3 270M (bench_gemma_accuracy) down_proj per row scored a
# perplexity ratio of 1.121, per row and per 64 / 128 / 256 of its 2048 inputs 1.097 / 1.089 / 1.083 (down_proj in
# float: 1.0998; 1.081 for 256 in this file's form): 256, the fewest groups and the lowest ratio (the ratio is not
# monotonic in the group here).
ROW_GROUP = 256


def per_row_matmuls(graph: Path, parts: Sequence[str], group: int = 0, weight_max: int = WEIGHT_MAX) -> int:
    """Rewrite ``graph`` in place (its external data rewritten too): every float ``MatMul`` whose name holds
    ``/<part>/`` for a part of ``parts`` and whose weight is an initializer becomes the per-row integer form; returns
    how many were rewritten.

    ``group`` > 0 gives each row a scale per ``group`` inputs, and the weight a scale per group and column: one
    ``MatMulInteger`` per group for the K / group partial products, each scaled, then summed (a MatMul whose K it does
    not divide, or no larger than it, has a scale per row alone).
    ``weight_max`` 127 (8-bit weights) is for measuring what 7 bits cost: wrong on a CPU without VNNI."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = Path(graph)
    model = onnx.load(str(graph))
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    new_nodes, new_inits, done = [], [], 0
    shared = ("row_int8.axes", "row_int8.qmax", "row_int8.zero_f", "row_int8.zero_u8", "row_int8.eps")
    grouped = 0
    for node in g.node:
        if node.op_type != "MatMul" or node.input[1] not in inits or not any(f"/{p}/" in node.name for p in parts):
            new_nodes.append(node)
            continue
        w = numpy_helper.to_array(inits[node.input[1]]).astype(np.float32)
        k, n = w.shape
        size = group if group and k % group == 0 and k > group else 0
        if size:
            w = w.reshape(k // size, size, n)
        w_scale = np.maximum(np.abs(w).max(axis=-2, keepdims=bool(size)), 1e-12) / weight_max
        wq = np.clip(np.round(w / w_scale), -weight_max, weight_max).astype(np.int8)
        p = node.name.rsplit("/", 1)[0] + "/row_int8"
        x, y = node.input[0], node.output[0]
        if size:
            new_inits += [*(numpy_helper.from_array(wq[i], f"{p}.weight_q.{i}") for i in range(k // size)),
                          numpy_helper.from_array(w_scale[:, 0].astype(np.float32), f"{p}.weight_scale"),
                          numpy_helper.from_array(np.asarray([0, 0, k // size, size], np.int64), f"{p}.groups")]
            new_nodes += _grouped(helper, TensorProto, p, x, y, shared, k // size)
            g.initializer.remove(inits[node.input[1]])
            done += 1
            grouped += 1
            continue
        new_inits += [numpy_helper.from_array(wq, f"{p}.weight_q"),
                      numpy_helper.from_array(w_scale.astype(np.float32), f"{p}.weight_scale")]
        t = lambda name: f"{p}/{name}"  # noqa: E731
        new_nodes += [
            helper.make_node("Abs", [x], [t("abs")], name=t("Abs")),
            helper.make_node("ReduceMax", [t("abs"), shared[0]], [t("max")], name=t("ReduceMax"), keepdims=1),
            helper.make_node("Max", [t("max"), shared[4]], [t("max_eps")], name=t("Max")),
            helper.make_node("Div", [t("max_eps"), shared[1]], [t("scale")], name=t("Scale")),
            helper.make_node("Div", [x, t("scale")], [t("scaled")], name=t("Div")),
            helper.make_node("Round", [t("scaled")], [t("rounded")], name=t("Round")),
            helper.make_node("Add", [t("rounded"), shared[2]], [t("shifted")], name=t("Shift")),
            helper.make_node("Cast", [t("shifted")], [t("q")], name=t("CastU8"), to=TensorProto.UINT8),
            helper.make_node("MatMulInteger", [t("q"), f"{p}.weight_q", shared[3]], [t("acc")],
                             name=t("MatMulInteger")),
            helper.make_node("Cast", [t("acc")], [t("acc_f")], name=t("CastF"), to=TensorProto.FLOAT),
            helper.make_node("Mul", [t("acc_f"), f"{p}.weight_scale"], [t("cols")], name=t("ColScale")),
            helper.make_node("Mul", [t("cols"), t("scale")], [y], name=t("RowScale")),
        ]
        g.initializer.remove(inits[node.input[1]])
        done += 1
    if done:
        if grouped:
            new_inits.append(numpy_helper.from_array(np.asarray([2], np.int64), "row_int8.group_axis"))
        new_inits += [numpy_helper.from_array(np.asarray([-1], np.int64), shared[0]),
                      numpy_helper.from_array(np.asarray(QMAX, np.float32), shared[1]),
                      numpy_helper.from_array(np.asarray(ZERO, np.float32), shared[2]),
                      numpy_helper.from_array(np.asarray(ZERO, np.uint8), shared[3]),
                      numpy_helper.from_array(np.asarray(1e-12, np.float32), shared[4])]
        del g.node[:]
        g.node.extend(new_nodes)
        g.initializer.extend(new_inits)
        data = graph.name + ".data"
        (graph.parent / data).unlink(missing_ok=True)
        onnx.save(model, str(graph), save_as_external_data=True, all_tensors_to_one_file=True, location=data,
                  size_threshold=1024)
        (graph.parent / data).chmod(0o644)
    return done


def _grouped(helper, TensorProto, p: str, x: str, y: str, shared, groups: int) -> list:
    """The nodes of the grouped form: x [B, T, K] seen as [B, T, K/G, G], a scale per (row, group); each group's
    integer product [B, T, 1, N] in a MatMulInteger of its own (a 2-D constant weight, which ONNX Runtime prepacks: one
    batched MatMulInteger over a 3-D weight cost more CPU than the float MatMul), joined, each scaled by its row's
    and its weight's scales, summed."""
    t = lambda name: f"{p}/{name}"  # noqa: E731
    parts = [t(f"q{i}") for i in range(groups)]
    accs = [t(f"acc{i}") for i in range(groups)]
    return [
        helper.make_node("Reshape", [x, f"{p}.groups"], [t("xg")], name=t("Reshape")),
        helper.make_node("Abs", [t("xg")], [t("abs")], name=t("Abs")),
        helper.make_node("ReduceMax", [t("abs"), shared[0]], [t("max")], name=t("ReduceMax"), keepdims=1),
        helper.make_node("Max", [t("max"), shared[4]], [t("max_eps")], name=t("Max")),
        helper.make_node("Div", [t("max_eps"), shared[1]], [t("scale")], name=t("Scale")),
        helper.make_node("Div", [t("xg"), t("scale")], [t("scaled")], name=t("Div")),
        helper.make_node("Round", [t("scaled")], [t("rounded")], name=t("Round")),
        helper.make_node("Add", [t("rounded"), shared[2]], [t("shifted")], name=t("Shift")),
        helper.make_node("Cast", [t("shifted")], [t("q")], name=t("CastU8"), to=TensorProto.UINT8),
        helper.make_node("Split", [t("q")], parts, name=t("Split"), axis=2, num_outputs=groups),
        *[helper.make_node("MatMulInteger", [parts[i], f"{p}.weight_q.{i}", shared[3]], [accs[i]],
                           name=t(f"MatMulInteger{i}")) for i in range(groups)],
        helper.make_node("Concat", accs, [t("acc")], name=t("Concat"), axis=2),
        helper.make_node("Cast", [t("acc")], [t("acc_f")], name=t("CastF"), to=TensorProto.FLOAT),
        helper.make_node("Mul", [t("acc_f"), f"{p}.weight_scale"], [t("cols")], name=t("ColScale")),
        helper.make_node("Mul", [t("cols"), t("scale")], [t("parts")], name=t("RowScale")),
        helper.make_node("ReduceSum", [t("parts"), "row_int8.group_axis"], [y], name=t("Sum"), keepdims=0),
    ]
