"""Activation-aware scaling for INT4 weights (AWQ-style), applied to the Hugging Face weights before the export.

A weight column that meets large activations costs more when rounded. Per linear group (the projections that
read one norm's output, and ``down_proj`` behind ``up_proj``) a per-input-channel scale ``s = mean|x| ** a`` is
searched on the calibration text's activations: ``a`` in a grid, each scored by the group's output error with
the weights scaled by ``s``, rounded block-wise to INT4 and scaled back. The best ``s`` is folded in exactly: the
weights' columns times ``s``, the op before them (the norm's weight, or ``up_proj``'s rows) divided by ``s``, so
the FP32 model is unchanged and only the rounding moves. The builder then rounds the scaled weights (RTN).
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


def _groups(layer: Any, family: str) -> list[tuple[str, Any, list[Any], Callable[[Any], None]]]:
    """(name, the module whose input is captured, the linears reading it, fold(s): divide the op before by s)."""
    attn, mlp = layer.self_attn, layer.mlp
    gemma = family == "gemma"

    def norm_fold(norm: Any) -> Callable[[Any], None]:
        def fold(s: Any) -> None:
            w = norm.weight.data
            norm.weight.data = ((1 + w) / s - 1) if gemma else (w / s)  # Gemma's norm multiplies by (1 + w)
        return fold

    if family == "phi3":
        qkv, mlp_in = [attn.qkv_proj], [mlp.gate_up_proj]

        def up_fold(s: Any) -> None:
            half = mlp.gate_up_proj.weight.shape[0] // 2
            mlp.gate_up_proj.weight.data[half:] /= s[:, None]
    else:
        qkv, mlp_in = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]

        def up_fold(s: Any) -> None:
            mlp.up_proj.weight.data /= s[:, None]
            if getattr(mlp.up_proj, "bias", None) is not None:
                mlp.up_proj.bias.data /= s
    return [("qkv", qkv[0], qkv, norm_fold(layer.input_layernorm)),
            ("mlp_in", mlp_in[0], mlp_in, norm_fold(layer.post_attention_layernorm)),
            ("down", mlp.down_proj, [mlp.down_proj], up_fold)]


def _error(x: Any, refs: Sequence[Any], weights: Sequence[Any]) -> float:
    """The group's relative output error with ``weights`` against its float outputs ``refs`` (``x @ W.T``)."""
    import torch

    num = den = 0.0
    for ref, w in zip(refs, weights):
        num += float(torch.sum((x @ w.T - ref) ** 2))
        den += float(torch.sum(ref ** 2))
    return num / max(den, 1e-30)


def search_scales(model: Any, family: str, token_batches: Sequence[Sequence[int]], block: int,
                  progress: Callable[[str], None] = lambda _m: None) -> list[GroupScale]:
    """Search and fold the scales of every layer's groups into ``model`` (in place); returns what was chosen."""
    import torch

    layers = model.model.layers
    captured: dict[tuple[int, str], list[Any]] = {}
    hooks = []
    for i, layer in enumerate(layers):
        for name, module, _, _ in _groups(layer, family):
            def hook(_m: Any, args: tuple, key: tuple[int, str] = (i, name)) -> None:
                kept = captured.setdefault(key, [])
                if sum(len(x) for x in kept) < MAX_ROWS:  # never more than the search reads
                    kept.append(args[0].detach().reshape(-1, args[0].shape[-1]).clone())
            hooks.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for ids in token_batches:
                model(torch.tensor([list(ids)]))
    finally:
        for h in hooks:
            h.remove()
    chosen: list[GroupScale] = []
    with torch.no_grad():
        for i, layer in enumerate(layers):
            for name, _, linears, fold in _groups(layer, family):
                x = torch.cat(captured.pop((i, name)))[:MAX_ROWS].float()
                mean_abs = x.abs().mean(dim=0).clamp(min=1e-8)
                refs = [x @ lin.weight.data.T for lin in linears]  # the float outputs: once per group, not per alpha
                base = _error(x, refs, [fake_quant(lin.weight.data, block) for lin in linears])
                best = (base, 0.0, None)
                for alpha in GRID[1:]:
                    s = mean_abs ** alpha
                    s = s / torch.sqrt(s.max() * s.min())
                    err = _error(x, refs, [fake_quant(lin.weight.data * s, block) / s for lin in linears])
                    if err < best[0]:
                        best = (err, alpha, s)
                if best[2] is not None:
                    for lin in linears:
                        lin.weight.data *= best[2]
                    fold(best[2])
                chosen.append(GroupScale(i, name, best[1], base, best[0]))
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
