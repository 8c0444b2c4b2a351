"""A text-generation graph that computes the LM head only at the positions it is asked for.

The model builder's graph applies the LM head to every new token: ``logits [batch, new_tokens, vocab]``. A
server samples only each row's last position, so a prefill of ``n`` prompts of ``s`` tokens computed and wrote
``n * s * vocab`` logits to use ``n * vocab`` of them: with a real vocabulary (SmolLM's 49k, Qwen2's 152k) the
LM head is a sixth to a third of the model's weights, so prefill spent that share of its work on rows nobody
reads, and a 16 x 128-token prefill of a 152k vocabulary allocated 1.2 GiB of logits outside the KV budget.

:func:`select_logits_positions` adds the graph input ``logits_positions [batch, k]`` (``contract.LOGITS_POSITIONS``:
indices into each row's new tokens) and gathers the final norm's output at those positions before the LM head,
so ``logits`` becomes ``[batch, k, vocab]``. The backend asks for each row's last real token (``k = 1``);
teacher-forced scoring (the gate, ``accept``) asks for every position (``k = new_tokens``) and gets exactly what
the whole graph gave. The rewrite runs on the builder's output before quantization, so every precision packaged
has it; a graph without the input (packaged by an older model-factory) is still served (``causal_lm``).
"""

from __future__ import annotations

from pathlib import Path

from model_factory.backend.contract import LOGITS, LOGITS_POSITIONS
from model_factory.errors import FactoryError
from model_factory.fileio import atomic_file

_NORMS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "LayerNormalization",
          "SkipLayerNormalization", "RMSNormalization")


def _lm_head_input(graph) -> str:
    """The final norm's output that the LM head reads: walking back from ``logits`` along first inputs (through
    a quantized head's DynamicQuantizeLinear / Cast / Mul), the first edge that a normalization produced."""
    producers = {out: node for node in graph.node for out in node.output}
    node = producers.get(LOGITS)
    for _ in range(8):
        if node is None or not node.input:
            break
        src = producers.get(node.input[0])
        if src is None:
            break
        if src.op_type in _NORMS:
            return node.input[0]
        node = src
    raise FactoryError("the text-generation graph's logits do not come from a normalized hidden state through an "
                       "LM head: its positions cannot be selected. Fix: rebuild with the model builder this "
                       "model-factory pins (onnxruntime-genai)")


def select_logits_positions(graph_path: Path) -> bool:
    """Rewrite ``graph_path`` in place (the graph only; external weights untouched) so that it returns logits at
    ``logits_positions`` alone. False when it already does."""
    import onnx
    from onnx import TensorProto, helper

    path = Path(graph_path)
    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    if any(i.name == LOGITS_POSITIONS for i in g.input):
        return False
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if opset < 13:
        raise FactoryError(f"the text-generation graph has ONNX opset {opset}; selecting logits positions needs "
                           "13 or later. Fix: rebuild with the model builder this model-factory pins")
    hidden = _lm_head_input(g)
    if any(o.name == hidden for o in g.output):
        raise FactoryError(f"the graph also outputs {hidden!r}: its LM head input cannot be narrowed")
    pre = "/logits_positions/"
    picked = pre + "hidden"
    axes = helper.make_tensor(pre + "axes", TensorProto.INT64, [1], [2])
    starts = helper.make_tensor(pre + "starts", TensorProto.INT64, [1], [2])
    ends = helper.make_tensor(pre + "ends", TensorProto.INT64, [1], [3])
    g.initializer.extend([axes, starts, ends])
    new = [
        helper.make_node("Unsqueeze", [LOGITS_POSITIONS, axes.name], [pre + "index3"], name=pre + "Unsqueeze"),
        helper.make_node("Shape", [hidden], [pre + "hidden_shape"], name=pre + "ShapeHidden"),
        helper.make_node("Slice", [pre + "hidden_shape", starts.name, ends.name], [pre + "width"], name=pre + "Width"),
        helper.make_node("Shape", [LOGITS_POSITIONS], [pre + "index_shape"], name=pre + "ShapeIndex"),
        helper.make_node("Concat", [pre + "index_shape", pre + "width"], [pre + "target"], axis=0, name=pre + "Target"),
        helper.make_node("Expand", [pre + "index3", pre + "target"], [pre + "index"], name=pre + "Expand"),
        helper.make_node("GatherElements", [hidden, pre + "index"], [picked], axis=1, name=pre + "Gather"),
    ]
    first_use = None
    for i, node in enumerate(g.node):
        if hidden in node.input:
            first_use = i if first_use is None else first_use
            for j, name in enumerate(node.input):
                if name == hidden:
                    node.input[j] = picked
    nodes = list(g.node)
    g.ClearField("node")
    g.node.extend(nodes[:first_use] + new + nodes[first_use:])  # topological: after the norm, before its readers
    g.input.append(helper.make_tensor_value_info(LOGITS_POSITIONS, TensorProto.INT64, ["batch_size", "positions"]))
    for out in g.output:
        if out.name == LOGITS and len(out.type.tensor_type.shape.dim) == 3:
            dim = out.type.tensor_type.shape.dim[1]
            dim.ClearField("dim_value")
            dim.dim_param = "positions"
    with atomic_file(path, "wb") as f:  # a stage cut off here leaves the builder's graph, never half of this one
        f.write(model.SerializeToString())
    return True
