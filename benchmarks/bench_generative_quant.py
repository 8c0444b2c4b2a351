"""INT4 methods measured against each other on a small TRAINED Llama: RTN, AWQ-style scaling, k-quant; INT8
(dynamic, its ladder, 8-bit against 7-bit weights; weight-only); and FP16 (the builder's FP16 graph, the TensorRT
graph in half precision).

Random weights say little about rounding (no outlier channels, perplexity near the vocabulary size), so this
trains a small Llama (hidden 128, 4 layers) on Debian's license texts for a few hundred steps first, then
builds each variant with the factory's own functions (``run_builder``, ``awq.write_scaled_model``) and scores it
with the quantize stage's gate (``lm_quantize.Scorer``): perplexity ratio vs FP32 on held-out license text the
model never trained on, and teacher-forced greedy agreement with FP32 on golden prompts up to the first near-tie.
Also ``accuracy_level`` 4 (activations quantized to int8 inside MatMulNBits, the CPU default) against 1 (float
activations).

    python benchmarks/bench_generative_quant.py [--write] [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
START, END = "<!-- bench_generative_quant:start -->", "<!-- bench_generative_quant:end -->"
SEQ = 128
TRAIN_SEQ = 64  # training chunks (8 per step): small enough for a shared 2-core machine


def train(folder: Path, steps: int, files: list[str], say) -> float:
    import torch
    import transformers

    torch.manual_seed(0)
    torch.set_num_threads(2)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    ids = []
    for f in files:
        ids += tok(Path(f).read_text(errors="replace"))["input_ids"]
    data = torch.tensor(ids[: len(ids) // TRAIN_SEQ * TRAIN_SEQ]).reshape(-1, TRAIN_SEQ)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    loss = float("nan")
    for step in range(steps):
        batch = data[torch.randint(0, len(data), (8,))]
        out = model(input_ids=batch, labels=batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        loss = float(out.loss.detach())
        if step % 25 == 0:
            say(f"step {step}: loss {loss:.3f}")
    model.eval()
    model.save_pretrained(folder)
    return loss


def batch_dependence(graph: Path, rows: list[list[int]], head_dim: int, new: int = 64) -> int:
    """How many of ``rows``' greedy continuations differ when decoded together (one batch, each row prefilled into
    its own KV slot) from the same row decoded alone: 0 for a precision whose rows never touch each other."""
    import numpy as np

    from model_factory.backend.contract import LOGITS_POSITIONS, past_name, present_name
    from model_factory.build_engines.ort_session import onnxruntime_session

    sess = onnxruntime_session(graph, threads=2)
    selects = any(i.name == LOGITS_POSITIONS for i in sess.get_inputs())

    def greedy(batch: list[list[int]]) -> list[list[int]]:
        pasts = [i for i in sess.get_inputs() if i.name.startswith("past_key_values") and i.name.endswith(".key")]
        ctx = max(map(len, batch)) + new + 1
        # the FP16 graph keeps an FP16 cache, a graph with quantization.kv_cache = "int8" an INT8 one
        dtype = {"tensor(float16)": np.float16, "tensor(int8)": np.int8}.get(pasts[0].type, np.float32)
        cache = {(i, k): np.zeros((len(batch), int(pasts[0].shape[1]), ctx, head_dim), dtype)
                 for i in range(len(pasts)) for k in ("key", "value")}

        def run(lo: int, hi: int, ids: np.ndarray, lens: list[int]) -> np.ndarray:
            mask = np.zeros((ids.shape[0], max(lens) + ids.shape[1]), np.int64)
            for r, ln in enumerate(lens):
                mask[r, :ln + ids.shape[1]] = 1
            io = sess.io_binding()
            io.bind_cpu_input("input_ids", ids)
            io.bind_cpu_input("attention_mask", mask)
            if selects:  # each row's last token only (the rows are unpadded)
                io.bind_cpu_input(LOGITS_POSITIONS, np.full((ids.shape[0], 1), ids.shape[1] - 1, np.int64))
            io.bind_output("logits", "cpu")
            for (layer, kind), buf in cache.items():
                v = buf[lo:hi]
                io.bind_input(past_name(layer, kind), "cpu", 0, dtype, list(v.shape), v.ctypes.data)
                io.bind_output(present_name(layer, kind), "cpu", 0, dtype, list(v.shape), v.ctypes.data)
            sess.run_with_iobinding(io)
            return io.get_outputs()[0].numpy().astype(np.float32)

        nxt = [int(run(r, r + 1, np.array([p]), [0])[0, -1].argmax()) for r, p in enumerate(batch)]
        out, lens = [[t] for t in nxt], [len(p) for p in batch]
        for _ in range(new - 1):
            logits = run(0, len(batch), np.array([[t] for t in nxt]), lens)
            nxt = [int(logits[r, -1].argmax()) for r in range(len(batch))]
            for r, t in enumerate(nxt):
                out[r].append(t)
            lens = [n + 1 for n in lens]
        return out

    together = greedy(rows)
    return sum(t != greedy([r])[0] for t, r in zip(together, rows))


def tensorrt_rows(src: Path, work: Path, golden, heldout, say) -> list[tuple]:
    """(graph, agreement, perplexity ratio, max abs logits error, weight bytes) of the TensorRT graph: FP32, FP16
    (``lm_tensorrt.half_precision``) and its weight-only INT8 / INT4 (blocks of 32 and 128)."""
    import math

    import numpy as np

    from model_factory.build_engines.lm_graph import teacher_forced_agreement
    from model_factory.build_engines.lm_quantize import weights_bytes
    from model_factory.build_engines.lm_tensorrt import ConcatRunner, _PrefillLogits, export_for_tensorrt, half_precision
    from model_factory.build_engines.lm_weight_only import weight_only_qdq

    graph, _model = export_for_tensorrt(src, work / "trt-fp32.onnx", 256, 8, say)

    def measure(path: Path) -> tuple[float, float, list]:
        run = _PrefillLogits(ConcatRunner(path))
        agree = compared = 0
        for c in golden:
            a, n = teacher_forced_agreement(run, c.prompt_ids, c.tokens, c.near_tie)
            agree, compared = agree + a, compared + n
        nll = count = 0.0
        for ids in heldout:
            logits = run.logits(ids)[:-1].astype(np.float64)
            top = logits.max(axis=-1, keepdims=True)
            logz = np.log(np.exp(logits - top).sum(axis=-1)) + top[:, 0]
            nll += float((logz - logits[np.arange(len(ids) - 1), np.asarray(ids[1:])]).sum())
            count += len(ids) - 1
        return agree / max(compared, 1), math.exp(nll / max(count, 1)), [run.logits(c.prompt_ids) for c in golden]

    base_agree, base_ppl, base_logits = measure(graph)
    rows = [("FP32", base_agree, 1.0, 0.0, weights_bytes(graph))]
    for label, precision, block in (("FP16", "fp16", 0), ("INT8 per channel", "int8", 32),
                                    ("INT4 block 32", "int4", 32), ("INT4 block 128", "int4", 128)):
        out = work / f"trt-{precision}-{block}.onnx"
        if precision == "fp16":
            half_precision(graph, out)
        else:
            weight_only_qdq(graph, out, precision, block)
        agree, ppl, logits = measure(out)
        err = max(float(np.abs(a - b).max()) for a, b in zip(logits, base_logits))
        rows.append((label, agree, ppl / base_ppl, err, weights_bytes(out)))
        say(f"tensorrt {label}: agreement {agree:.4f}")
    return rows


def main() -> None:
    from benchmarks.harness.run_header import LoadReading, run_header
    from benchmarks.results_file import publish, say
    from generative_models import corpus_files, make_causal_lm

    from model_factory.build_engines.awq import write_scaled_model
    from model_factory.build_engines.causal_lm import load_torch_model, prompt_ids, run_builder, torch_continuations
    from model_factory.build_engines.lm_quantize import Scorer, dynamic_int8, weights_bytes

    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    load = LoadReading.begin()
    work = Path(tempfile.mkdtemp(prefix="bench-genq-"))
    src = make_causal_lm("llama", work / "model", hidden=128, layers=4, heads=4, kv_heads=2, intermediate=384)
    files = corpus_files()
    t0 = time.perf_counter()
    final_loss = train(src, args.steps, files[:-2], say)
    train_s = time.perf_counter() - t0
    model, tok = load_torch_model(src)
    held_text = [ln for f in files[-2:] for ln in Path(f).read_text(errors="replace").splitlines() if len(ln) > 40]
    heldout = [prompt_ids(tok, t, SEQ) for t in held_text[:64]]
    golden, _ = torch_continuations(model, tok, held_text[64:72], (tok.eos_token_id,))
    calib = [prompt_ids(tok, ln, SEQ) for ln in Path(files[0]).read_text(errors="replace").splitlines()
             if len(ln) > 40][:32]
    fp32 = run_builder(src, work / "fp32", "fp32")
    # 16 held-out prompts of 16-55 tokens: batched with different lengths, as a server batches them.
    batch_rows = [prompt_ids(tok, t, 16 + (i * 7) % 40) for i, t in enumerate(held_text[:16])]
    fp32_dependence = batch_dependence(fp32, batch_rows, 32)
    scorer = Scorer(fp32, 32, heldout, golden)
    variants = [("fp16", "the builder's FP16 graph", {}), ("int8", "dynamic", {}),
                ("int8", "dynamic, down_proj float", {"keep": ("down_proj",)}),
                ("int8", "dynamic, down/o_proj float", {"keep": ("down_proj", "o_proj")}),
                ("int8", "dynamic, 8-bit weights (not built: wrong without VNNI)", {"eight": True}),
                ("int8", "weight_only", {"accuracy_level": 1}), ("int4", "rtn", {"accuracy_level": 4}),
                ("int4", "rtn", {"accuracy_level": 1}), ("int4", "k_quant", {"accuracy_level": 4, "algo_config": "k_quant"}),
                ("int4", "awq", {"accuracy_level": 4}), ("int4", "rtn + int8 lm_head",
                                                          {"accuracy_level": 4, "matmul_mixed_precision": "last_matmul:int8"}),
                ("int4", "awq + int8 lm_head", {"accuracy_level": 4, "matmul_mixed_precision": "last_matmul:int8"}),
                # Block 128 (recipe int4_block_size = 128): fewer scales, a faster kernel at batch 1
                # (bench_generate_graphs); here a row of the attention projections (K = 128) is one block.
                ("int4", "rtn, block 128", {"accuracy_level": 4, "block_size": 128}),
                ("int4", "awq, block 128", {"accuracy_level": 4, "block_size": 128}),
                # quantization.kv_cache = "int8" (build_engines/kv_int8.py): scales per channel fitted on the
                # calibration lines through the FP32 graph; FP32 weights first (the cache's own error alone).
                ("fp32", "FP32 weights, kv int8", {"kv": True}), ("int8", "dynamic, kv int8", {"kv": True}),
                ("int4", "awq, kv int8", {"accuracy_level": 4, "kv": True})]
    from model_factory.build_engines.kv_int8 import fit_kv_scales, quantize_kv_cache

    kv_scales = fit_kv_scales(fp32, 32, calib)
    awq_src: dict[int, Path] = {}
    rows = []
    for precision, method, opts in variants:
        source = src
        block = int(opts.get("block_size", 32))
        if method.startswith("awq"):
            if block not in awq_src:
                awq_src[block], _ = write_scaled_model(src, work / f"awq-model-{block}", "llama", calib, block, say)
            source = awq_src[block]
        say(f"{precision} {method} {opts}")
        out = work / f"{precision}-{len(rows)}"
        if method.startswith("dynamic"):
            graph = dynamic_int8(fp32, out, opts.get("keep", ()), seven_bit=not opts.get("eight"))
        elif precision in ("fp16", "fp32"):
            graph = run_builder(source, out, precision)
        else:
            graph = run_builder(source, out, precision,
                                {k: v for k, v in {**opts, "block_size": block}.items() if k != "kv"})
        if opts.get("kv"):
            quantize_kv_cache(graph, kv_scales)
        agree, ppl, err, n = scorer.score(graph)
        rows.append((precision, method, opts.get("accuracy_level"), agree, ppl / scorer.ppl_fp32, err, n,
                     weights_bytes(graph), batch_dependence(graph, batch_rows, 32)))
    trt_rows = tensorrt_rows(src, work, golden, heldout, say)
    load = load.finish()
    lines = [START, "## FP16, INT8 and INT4 methods on a trained Llama (benchmarks/bench_generative_quant.py)", "",
             run_header("benchmarks/bench_generative_quant.py", load), "",
             f"Llama hidden 128, 4 layers, 2k BPE vocabulary, trained {args.steps} steps on Debian license texts "
             f"({train_s:.0f} s, final loss {final_loss:.2f}); held-out: {len(heldout)} lines of two license files "
             f"it never trained on (FP32 perplexity {scorer.ppl_fp32:.2f}); agreement: {len(golden)} prompts x 64 "
             "greedy tokens, teacher-forced, up to the first near-tie. Block 32 unless said, symmetric, MatMulNBits on ONNX "
             "Runtime CPU; awq calibrated on 32 lines of a third license file. INT8 dynamic: ONNX Runtime's "
             "dynamic quantization of the FP32 graph (weights per output channel, 7-bit unless said; activations "
             "per tensor at run time), with the named projections left in float. kv int8: the graph's KV cache in "
             "INT8 (`quantization.kv_cache = \"int8\"`, build_engines/kv_int8.py: a scale per channel fitted on "
             "the FP32 graph's cache of the same 32 calibration lines). Batched: of 16 held-out prompts "
             "(16-55 tokens), how many greedy 64-token continuations differ when the 16 decode together (one KV "
             f"slot each) from the same prompt decoded alone (FP32: {fp32_dependence} of 16).", "",
             "| precision | method | accuracy_level | agreement | perplexity ratio | max abs logits err | weights (KiB) "
             "| batched differs |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for precision, method, level, agree, ratio, err, n, wb, dep in rows:
        lines.append(f"| {precision} | {method} | {level or '-'} | {agree:.4f} | {ratio:.4f} | {err:.3g} | {wb / 1024:.0f} "
                     f"| {dep} of 16 |")
    if trt_rows:
        lines += ["", "TensorRT's graph (the standard-op `torch.onnx` export `lm_tensorrt` builds plans from) in half "
                  "precision (`lm_tensorrt.half_precision`: weights, activations, KV cache and logits FP16) and in the "
                  "weight-only Q/DQ form of `lm_weight_only` (round to nearest, symmetric; activations FP32), run "
                  "through ONNX Runtime as the build checks it; the same golden prompts and held-out text, the "
                  "perplexity ratio against that graph's FP32 and the logits error against its FP32 prefill:", "",
                  "| graph | agreement | perplexity ratio | max abs logits err | weights (KiB) |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for name, agree, ratio, err, wb in trt_rows:
            lines.append(f"| {name} | {agree:.4f} | {ratio:.4f} | {err:.3g} | {wb / 1024:.0f} |")
    lines.append(END)
    publish("\n".join(lines), ROOT / "benchmarks" / "RESULTS.md", START, END, args.write)


if __name__ == "__main__":
    main()
