"""SmoothQuant-style smoothing of ``down_proj``'s input, folded exactly into the FP32 graph (dynamic INT8's ladder).

Dynamic INT8 quantizes a MatMul's activations with one scale per tensor as each step runs. ``down_proj`` reads
``act(gate(x)) * up(x)``, whose few outlier channels set that scale and flatten every other channel: on Gemma 3
270M all-INT8 dynamic missed the gate (perplexity ratio 1.29) and the ladder kept the 18 ``down_proj`` in float.
Per input channel ``j`` of ``down_proj`` a scale ``s_j = max|X_j| ** a / max|W_j| ** (1 - a)`` moves the range from
the activation into the weight: ``up_proj``'s output column ``j`` (its weight's column and bias) divided by ``s_j``,
so ``X_j`` is, and ``down_proj``'s weight row ``j`` multiplied by it. In float this is an identity (checked: the
smoothed FP32 graph's logits on a calibration sample equal the original's up to float rounding, else the build
stops); only the INT8 rounding moves. Valid where ``down_proj``'s input is ``up``'s output times something that
does not depend on it (a gated MLP: :func:`down_folds` reads that on the graph, :func:`awq._down_group` on the
module); GPT-2's ``act(fc1)`` or Nemotron's ``relu²(up)`` have no such fold, and the ladder has no smoothed step
there.

The activations are read on the calibration text by AWQ's machinery (:func:`awq.capture_inputs`: the layer's
groups found on its module graph); ``a`` is searched per layer (:data:`ALPHAS`) on the INT8 output error of
``down_proj`` simulated as ONNX Runtime computes it (7-bit weights per output channel, uint8 activations per
tensor, a calibration sample a tensor), a layer whose error no ``a`` lowers left as it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

# The ladder's marker for the step (in DYNAMIC_STEPS beside the parts kept in float; never a node name).
SMOOTH_DOWN = "smooth:down_proj"
ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
SEARCH_ROWS = 1024  # rows of the captured activations the search simulates (the maxima read every row)
DOWN = re.compile(r"^/model/layers\.(\d+)/mlp/down_proj/MatMul$")


@dataclass(frozen=True)
class DownFold:
    """Where one layer's scale goes in the builder's graph: ``down_proj``'s weight ``[inter, hidden]`` (rows times
    ``s``) and ``up_proj``'s ``[hidden, inter]`` (columns divided by ``s``, its bias too where it has one)."""

    layer: int
    down_weight: str
    up_weight: str
    up_bias: str | None = None


@dataclass(frozen=True)
class LayerSmoothing:
    """What the search chose for one layer: ``alpha`` None where no scale lowered the error (left unscaled)."""

    layer: int
    alpha: float | None
    error_before: float  # relative output error of down_proj in dynamic INT8, unscaled
    error_after: float


def down_folds(graph: Any) -> tuple[dict[int, DownFold], str]:
    """Each layer's fold in an ONNX ``ModelProto`` (the builder's names), and why a graph has none ("" where every
    ``down_proj`` has one): ``down_proj``'s input is a ``Mul`` whose one input is ``up_proj``'s output (through its
    bias ``Add`` where it has one), the other not, each tensor read by that one node only."""
    inits = {t.name: t for t in graph.graph.initializer}
    producer = {o: n for n in graph.graph.node for o in n.output}
    readers: dict[str, int] = {}
    for n in graph.graph.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    folds: dict[int, DownFold] = {}
    downs = [n for n in graph.graph.node if n.op_type == "MatMul" and DOWN.match(n.name)]
    if not downs:
        return {}, "no /model/layers.N/mlp/down_proj/MatMul in the graph (an MLP that is not gated: act(fc1) -> fc2)"
    for down in downs:
        layer = int(DOWN.match(down.name).group(1))  # type: ignore[union-attr]
        mul = producer.get(down.input[0])
        if down.input[1] not in inits or mul is None or mul.op_type != "Mul" or readers.get(down.input[0]) != 1:
            return {}, f"layer {layer}'s down_proj does not read a product of two tensors (not a gated MLP)"
        found = None
        for k, t in enumerate(mul.input):
            node, bias = producer.get(t), None
            if node is not None and node.op_type == "Add" and readers.get(t) == 1:
                bias = next((i for i in node.input if i in inits), None)
                other = [i for i in node.input if i != bias]
                node = producer.get(other[0]) if bias is not None and len(other) == 1 else None
            if node is not None and node.op_type == "MatMul" and node.name.endswith("/mlp/up_proj/MatMul") \
                    and node.input[1] in inits and readers.get(node.output[0]) == 1 and readers.get(t) == 1 \
                    and mul.input[1 - k] != t:
                found = DownFold(layer, down.input[1], node.input[1], bias)
        if found is None:
            return {}, f"layer {layer}'s down_proj input is not up_proj's output times a gate (act(up) is not foldable)"
        folds[layer] = found
    return folds, ""


def _int8_error(x: Any, w: Any, rows: int, refs: Sequence[Any]) -> float:
    """Relative output error of ``x @ w`` (torch, ``w`` ``[in, out]``; ``refs``: the float products of each tensor,
    which no fold changes) computed as ONNX Runtime's dynamic INT8 does: ``w`` symmetric 7-bit per output column,
    ``x`` uint8 with a zero point per tensor of ``rows`` rows."""
    import torch

    ws = w.abs().amax(dim=0, keepdim=True).clamp(min=1e-12) / 64
    wq = torch.clamp(torch.round(w / ws), -64, 64) * ws
    num = den = 0.0
    for chunk, ref in zip(torch.split(x, rows), refs):
        lo, hi = min(float(chunk.min()), 0.0), max(float(chunk.max()), 0.0)
        scale = (hi - lo) / 255 or 1.0
        zp = round(-lo / scale)
        xq = (torch.clamp(torch.round(chunk / scale) + zp, 0, 255) - zp) * scale
        num += float(torch.sum((xq @ wq - ref) ** 2))
        den += float(torch.sum(ref ** 2))
    return num / max(den, 1e-30)


def scale_of(x_max: Any, w_max: Any, alpha: float) -> Any:
    """SmoothQuant's ``s = max|X| ** a / max|W| ** (1 - a)`` per input channel (a channel never seen: 1)."""
    s = x_max.clamp(min=1e-5) ** alpha / w_max.clamp(min=1e-5) ** (1 - alpha)
    return s.where(x_max > 0, s.new_ones(()))


def search_smoothing(source: Path, fp32_graph: Any, token_batches: Sequence[Sequence[int]],
                     alphas: Sequence[float] = ALPHAS, rows_per_tensor: int = 128,
                     progress: Callable[[str], None] = lambda _m: None) -> tuple[dict[int, np.ndarray],
                                                                                 list[LayerSmoothing]]:
    """Per layer the scale of ``down_proj``'s input channels (layer -> ``s``), chosen on the calibration text's
    activations read from the Hugging Face model in ``source`` (the FP32 graph's weights: ``fp32_graph``, a loaded
    ``ModelProto``); a fixed ``alpha`` where ``alphas`` holds one (no search)."""
    import torch
    from onnx import numpy_helper

    from model_factory.build_engines.awq import capture_inputs
    from model_factory.build_engines.causal_lm import load_torch_model

    folds, why = down_folds(fp32_graph)
    if not folds:
        return {}, []
    model, _tok = load_torch_model(source)
    groups, captured, _ = capture_inputs(model, token_batches, max_rows=None, keep=lambda g: g.name == "down")
    del model
    inits = {t.name: t for t in fp32_graph.graph.initializer}
    scales: dict[int, np.ndarray] = {}
    chosen: list[LayerSmoothing] = []
    with torch.no_grad():
        for layer, fold in sorted(folds.items()):
            if (layer, "down") not in captured:  # the module graph disagrees (no gated MLP there): left as is
                continue
            x = torch.cat(captured.pop((layer, "down"))).float()
            w = torch.from_numpy(numpy_helper.to_array(inits[fold.down_weight]).astype(np.float32))
            x_max, w_max = x.abs().amax(dim=0), w.abs().amax(dim=1)
            xs = x[:SEARCH_ROWS]
            refs = [chunk @ w for chunk in torch.split(xs, rows_per_tensor)]
            before = _int8_error(xs, w, rows_per_tensor, refs)
            best: tuple[float, float | None, Any] = (before, None, None)
            for alpha in alphas:
                s = scale_of(x_max, w_max, alpha)
                err = _int8_error(xs / s, w * s[:, None], rows_per_tensor, refs)
                if err < best[0] or len(alphas) == 1:
                    best = (err, alpha, s)
            if best[2] is not None:
                scales[layer] = best[2].numpy().astype(np.float32)
            chosen.append(LayerSmoothing(layer, best[1], before, best[0]))
    gained = sum(c.error_before for c in chosen) / max(sum(c.error_after for c in chosen), 1e-30)
    progress(f"[quantize] int8 dynamic: down_proj smoothed in {len(scales)} of {len(folds)} layers, its INT8 "
             f"output error {gained:.2f}x lower on the calibration activations")
    return scales, chosen


def smooth_graph(fp32: Path, out: Path, scales: Mapping[int, np.ndarray], head_dim: int,
                 check_ids: Sequence[int] | None = None) -> Path:
    """Write ``out/model.onnx`` (+ ``.data``): ``fp32`` with ``scales`` folded into each layer's up_proj and
    down_proj; with ``check_ids``, the two graphs' logits on them compared (a fold that is not exact stops here)."""
    import onnx
    from onnx import numpy_helper

    from model_factory.backend.contract import Files
    from model_factory.errors import FactoryError

    model = onnx.load(str(fp32))
    folds, why = down_folds(model)
    missing = sorted(set(scales) - set(folds))
    if missing:
        raise FactoryError(f"cannot smooth down_proj of layers {missing} in {fp32}: {why or 'no fold found there'}. "
                           "Fix: leave int8_method = \"dynamic\" to its other steps (mixed_precision)")
    inits = {t.name: t for t in model.graph.initializer}

    def rewrite(name: str, fn: Callable[[np.ndarray], np.ndarray]) -> None:
        t = inits[name]
        new = numpy_helper.from_array(fn(numpy_helper.to_array(t)).astype(np.float32), name)
        t.ClearField("external_data")
        t.data_location = onnx.TensorProto.DEFAULT
        t.CopyFrom(new)

    for layer, s in scales.items():
        fold = folds[layer]
        rewrite(fold.down_weight, lambda w, s=s: w * s[:, None])
        rewrite(fold.up_weight, lambda w, s=s: w / s[None, :])
        if fold.up_bias is not None:
            rewrite(fold.up_bias, lambda b, s=s: b / s)
    out.mkdir(parents=True, exist_ok=True)
    graph = out / Files.ONNX
    data = graph.name + Files.DATA_SUFFIX
    (out / data).unlink(missing_ok=True)
    onnx.save(model, str(graph), save_as_external_data=True, all_tensors_to_one_file=True, location=data,
              size_threshold=1024)
    del model
    if check_ids:
        drift = logits_drift(fp32, graph, head_dim, check_ids)
        if drift > 1e-3:
            raise FactoryError(f"smoothing down_proj changed the FP32 graph's logits by {drift:.3g} of their scale: "
                               "a scale was folded where it is not exact. Fix: report the family to the factory's "
                               "maintainers; quantization.mixed_precision keeps down_proj in float instead")
    return graph


def logits_drift(a: Path, b: Path, head_dim: int, ids: Sequence[int]) -> float:
    """The largest difference between two graphs' prefill logits on ``ids``, relative to the first's largest."""
    from model_factory.build_engines.lm_graph import DecoderRunner

    ref = DecoderRunner(a, len(ids), head_dim).logits(ids)
    got = DecoderRunner(b, len(ids), head_dim).logits(ids)
    return float(np.max(np.abs(got - ref))) / max(float(np.max(np.abs(ref))), 1e-30)


def smoothed_fp32(source: Path, fp32: Path, out: Path, token_batches: Sequence[Sequence[int]], head_dim: int,
                  alphas: Sequence[float] = ALPHAS,
                  progress: Callable[[str], None] = lambda _m: None) -> tuple[Path, list[LayerSmoothing]]:
    """The FP32 graph with down_proj's input smoothed (:func:`search_smoothing`, :func:`smooth_graph`, the fold's
    identity checked on the first calibration sample), ready for :func:`lm_quantize.dynamic_int8`."""
    import onnx

    scales, chosen = search_smoothing(source, onnx.load(str(fp32)), token_batches, alphas, progress=progress)
    return smooth_graph(fp32, out, scales, head_dim, token_batches[0] if token_batches else None), chosen


def smoothable(fp32: Path) -> str:
    """Why the FP32 graph's down_proj cannot be smoothed ("" where every layer's can)."""
    import onnx

    return down_folds(onnx.load(str(fp32), load_external_data=False))[1]
