"""Activation-aware scaling for INT4 weights (AWQ-style), applied to the Hugging Face weights before the export.

A weight column that meets large activations costs more when rounded. Per linear group (the projections that
read one norm's output, found in each layer's module graph: :func:`find_groups`; and ``down_proj`` behind
``up_proj``) a per-input-channel scale ``s = mean|x| ** a`` is
searched on the calibration text's activations: ``a`` in a grid, each scored by the group's output error with
the weights scaled by ``s``, rounded block-wise to INT4 and scaled back. The best ``s`` is folded in exactly: the
weights' columns times ``s``, the op before them (the norm's weight, or ``up_proj``'s rows) divided by ``s``, so
the FP32 model is unchanged and only the rounding moves (checked: the logits on the first calibration sample must
not move). The builder then rounds the scaled weights (RTN).

The groups were a list of names: the MLP's scale went into ``post_attention_layernorm``, which in Gemma 2/3 normalises
attention's output (the MLP reads ``pre_feedforward_layernorm``), and ``gemma3_text``'s norms were taken as ``w``
where they multiply by ``1 + w``: INT4 awq of Gemma 3 270M came out with perplexity 3481x FP32's. Each group's norm
and the form of its weight are now found on the model itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

GRID = tuple(i / 10 for i in range(11))
MAX_ROWS = 512  # calibration activations kept per group (tokens): the search costs rows x weights x grid


@dataclass(frozen=True)
class GroupScale:
    """The scale chosen for one group and what it bought (output error, relative, before and after)."""

    layer: int
    group: str
    alpha: float
    error_rtn: float
    error_scaled: float


def fake_quant(w: Any, block: int, bits: int = 4) -> Any:
    """Symmetric block-wise round-to-nearest along the input axis, back to float (as MatMulNBits stores it)."""
    import torch

    out_f, in_f = w.shape
    pad = (-in_f) % block
    wp = torch.nn.functional.pad(w, (0, pad)).reshape(out_f, -1, block)
    qmax = 2 ** (bits - 1) - 1
    scale = wp.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / qmax
    q = torch.clamp(torch.round(wp / scale), -qmax - 1, qmax) * scale
    return q.reshape(out_f, -1)[:, :in_f]


@dataclass(frozen=True)
class Group:
    """One group of linears that read the same input, and how a scale is folded into the op before them."""

    name: str
    linears: tuple[Any, ...]
    fold: Callable[[Any], None]


def _norm_form(norm: Any, x: Any) -> str | None:
    """How ``norm`` applies its weight, found by trying it on ``x`` (an input it had): ``"w"`` (output times w),
    ``"1+w"`` (Gemma's RMSNorm: times 1 + w), or None where neither divides its output exactly (no weight, or a
    form this does not know: that group is left unscaled)."""
    import torch

    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        return None
    bias = getattr(norm, "bias", None)
    probe = torch.linspace(0.5, 2.0, weight.shape[0], dtype=weight.dtype)
    w0 = weight.data.clone()
    b0 = bias.data.clone() if isinstance(bias, torch.Tensor) else None
    try:
        with torch.no_grad():
            want = norm(x) / probe
            for form in ("w", "1+w"):
                weight.data = w0 / probe if form == "w" else (1 + w0) / probe - 1
                if b0 is not None:
                    bias.data = b0 / probe
                got = norm(x)
                scale = float(want.abs().max()) or 1.0
                if float((got - want).abs().max()) <= 1e-4 * scale:
                    return form
    finally:
        weight.data = w0
        if b0 is not None:
            bias.data = b0
    return None


def _norm_fold(norm: Any, form: str) -> Callable[[Any], None]:
    def fold(s: Any) -> None:
        w = norm.weight.data
        norm.weight.data = (w / s) if form == "w" else ((1 + w) / s - 1)
        if getattr(norm, "bias", None) is not None:
            norm.bias.data = norm.bias.data / s
    return fold


def _down_group(mlp: Any) -> Group | None:
    """``down_proj`` behind a gated MLP (``act(gate(x)) * up(x)``): its input scales with ``up``'s rows."""
    down = getattr(mlp, "down_proj", None)
    if down is None:
        return None
    up, fused = getattr(mlp, "up_proj", None), getattr(mlp, "gate_up_proj", None)
    if up is not None and getattr(mlp, "gate_proj", None) is None:
        return None  # act(up(x)) (Nemotron's relu²): down's input does not scale with up's rows
    if up is not None:
        def fold(s: Any) -> None:
            up.weight.data /= s[:, None]
            if getattr(up, "bias", None) is not None:
                up.bias.data /= s
    elif fused is not None:  # Phi-3: [gate; up] in one linear, up the second half
        def fold(s: Any) -> None:
            half = fused.weight.shape[0] // 2
            fused.weight.data[half:] /= s[:, None]
    else:
        return None
    return Group("down", (down,), fold)


def find_groups(layer: Any, sample: Any) -> list[Group]:
    """The layer's scalable groups, read from its module graph on one forward of ``sample`` (the layer's input
    hidden states and the keyword arguments it was called with), never from a list of names: every norm whose
    output is what some linears read (the same tensor: Llama's ``input_layernorm`` → q/k/v and
    ``post_attention_layernorm`` → gate/up, Gemma 2/3's ``pre_feedforward_layernorm`` → gate/up while their
    ``post_attention_layernorm`` feeds no linear) with the form its weight is applied in, plus ``down_proj`` behind
    a gated MLP. Linears whose input no norm produced (OLMo 2's attention reads the residual stream) form no group."""
    import torch

    outputs: dict[int, Any] = {}
    inputs: dict[int, Any] = {}
    readers: dict[int, list[Any]] = {}
    held: list[Any] = []  # every tensor whose id is a key, kept alive so that no later tensor reuses its id
    hooks = []
    for module in layer.modules():
        if isinstance(module, torch.nn.Linear):
            def pre(m: Any, args: tuple) -> None:
                held.append(args[0])
                readers.setdefault(id(args[0]), []).append(m)
            hooks.append(module.register_forward_pre_hook(pre))
        elif "norm" in type(module).__name__.lower() and not list(module.children()):
            def post(m: Any, args: tuple, out: Any) -> None:
                if isinstance(out, torch.Tensor):
                    outputs[id(m)] = out
                    inputs[id(m)] = args[0].detach()
            hooks.append(module.register_forward_hook(post))
    try:
        with torch.no_grad():
            args, kwargs = sample
            layer(*args, **{k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value")})
    finally:
        for h in hooks:
            h.remove()
    groups = []
    for module in layer.modules():
        out = outputs.get(id(module))
        linears = readers.get(id(out)) if out is not None else None
        if not linears:
            continue
        form = _norm_form(module, inputs[id(module)])
        if form is None:
            continue
        name = next((n for n, m in layer.named_modules() if m is module), "norm")
        groups.append(Group(name, tuple(dict.fromkeys(linears)), _norm_fold(module, form)))
    mlp = getattr(layer, "mlp", None)
    down = _down_group(mlp) if mlp is not None else None
    return groups + ([down] if down is not None else [])


def _error(x: Any, refs: Sequence[Any], weights: Sequence[Any]) -> float:
    """The group's relative output error with ``weights`` against its float outputs ``refs`` (``x @ W.T``)."""
    import torch

    num = den = 0.0
    for ref, w in zip(refs, weights):
        num += float(torch.sum((x @ w.T - ref) ** 2))
        den += float(torch.sum(ref ** 2))
    return num / max(den, 1e-30)


def capture_inputs(model: Any, token_batches: Sequence[Sequence[int]], max_rows: int | None = MAX_ROWS,
                   keep: Callable[[Group], bool] = lambda _g: True) -> tuple[dict[int, list[Group]],
                                                                            dict[tuple[int, str], list[Any]], Any]:
    """Each layer's groups (:func:`find_groups`) and the inputs their linears read on the calibration text.

    Returns (layer -> groups, (layer, group name) -> the input rows of each batch ``[tokens, in]`` up to
    ``max_rows`` in all (None: every row), the logits of the first batch before anything is folded: the check that a
    fold is exact). ``keep`` picks the groups whose inputs are kept (the others are found, not captured)."""
    import torch

    layers = model.model.layers
    samples: dict[int, tuple[tuple, dict]] = {}

    def keep_sample(i: int) -> Callable[..., None]:
        def hook(_m: Any, args: tuple, kwargs: dict) -> None:
            samples.setdefault(i, (args, kwargs))
        return hook

    hooks = [layer.register_forward_pre_hook(keep_sample(i), with_kwargs=True) for i, layer in enumerate(layers)]
    first = torch.tensor([list(token_batches[0])]) if token_batches else None
    try:
        with torch.no_grad():
            before = model(first, use_cache=False).logits if first is not None else None
    finally:
        for h in hooks:
            h.remove()
    groups = {i: find_groups(layer, samples[i]) for i, layer in enumerate(layers) if i in samples}
    samples.clear()
    captured: dict[tuple[int, str], list[Any]] = {}
    hooks = []
    for i, found in groups.items():
        for g in found:
            if not keep(g):
                continue

            def hook(_m: Any, args: tuple, key: tuple[int, str] = (i, g.name)) -> None:
                kept = captured.setdefault(key, [])
                if max_rows is None or sum(len(x) for x in kept) < max_rows:  # never more than the caller reads
                    kept.append(args[0].detach().reshape(-1, args[0].shape[-1]).clone())
            hooks.append(g.linears[0].register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for ids in token_batches:
                model(torch.tensor([list(ids)]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return groups, captured, before


def search_scales(model: Any, family: str, token_batches: Sequence[Sequence[int]], block: int,
                  progress: Callable[[str], None] = lambda _m: None) -> list[GroupScale]:
    """Search and fold the scales of every layer's groups into ``model`` (in place); returns what was chosen.

    ``family`` is kept for the callers; the groups come from each layer's module graph (:func:`find_groups`)."""
    import torch

    from model_factory.errors import FactoryError

    groups, captured, before = capture_inputs(model, token_batches)
    first = torch.tensor([list(token_batches[0])]) if token_batches else None
    chosen: list[GroupScale] = []
    with torch.no_grad():
        for i, found in groups.items():
            for g in found:
                x = torch.cat(captured.pop((i, g.name)))[:MAX_ROWS].float()
                mean_abs = x.abs().mean(dim=0).clamp(min=1e-8)
                refs = [x @ lin.weight.data.T for lin in g.linears]  # the float outputs: once per group, not per alpha
                base = _error(x, refs, [fake_quant(lin.weight.data, block) for lin in g.linears])
                best = (base, 0.0, None)
                for alpha in GRID[1:]:
                    s = mean_abs ** alpha
                    s = s / torch.sqrt(s.max() * s.min())
                    err = _error(x, refs, [fake_quant(lin.weight.data * s, block) / s for lin in g.linears])
                    if err < best[0]:
                        best = (err, alpha, s)
                if best[2] is not None:
                    for lin in g.linears:
                        lin.weight.data *= best[2]
                    g.fold(best[2])
                chosen.append(GroupScale(i, g.name, best[1], base, best[0]))
        if before is not None:  # the fold is exact: the FP32 model must answer as before
            after = model(first, use_cache=False).logits
            drift = float((after - before).abs().max()) / max(float(before.abs().max()), 1e-30)
            if drift > 1e-3:
                raise FactoryError(f"awq's scales changed the FP32 model's logits by {drift:.3g} of their scale "
                                   f"({family}): a scale was folded where it is not exact. Fix: use "
                                   "quantization.int4_method = \"rtn\" and report the family to the factory's "
                                   "maintainers")
    gained = sum(c.error_rtn for c in chosen) / max(sum(c.error_scaled for c in chosen), 1e-30)
    progress(f"[quantize] awq: {len(chosen)} groups scaled, INT4 output error {gained:.2f}x lower than RTN "
             "on the calibration activations")
    return chosen


def write_scaled_model(folder: Path, out: Path, family: str, token_batches: Sequence[Sequence[int]], block: int,
                       progress: Callable[[str], None] = lambda _m: None) -> tuple[Path, list[GroupScale]]:
    """A copy of the Hugging Face folder with the AWQ scales folded into its weights (config and tokenizer kept)."""
    import shutil

    from model_factory.build_engines.causal_lm import load_torch_model

    model, _tok = load_torch_model(folder)
    chosen = search_scales(model, family, token_batches, block, progress)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for p in Path(folder).iterdir():  # everything but the weights and config: tokenizer, generation config
        if p.is_file() and not p.name.endswith((".safetensors", ".bin")) and p.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copyfile(p, out / p.name)
    shutil.copyfile(Path(folder) / "config.json", out / "config.json")
    return out, chosen
