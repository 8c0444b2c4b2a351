"""Precision ``gguf`` on Gemma 3 270M: the GGUF's own blocks carried into MatMulNBits, beside FP32 and INT8
weight-only, scored as the gate scores, and llama.cpp's perplexity of the original file on the same token ids.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_gguf_carry.py --work WORK --heldout HELDOUT.txt \
        [--gguf FILE.gguf --llama-python /work/peers/llamacpp/bin/python] [--rounds 2] [--write]

``WORK``: the work folder of a built ``[source] kind = "gguf"`` recipe with precisions fp32, int8 and gguf
(``<repository>/../build/<name>``: ``source/`` the folder read from the GGUF, ``export/model.onnx``,
``quantize/model.int8.onnx`` and ``model.gguf.onnx``); ``HELDOUT``: that recipe's held-out text. The gate's own
``Scorer`` (held-out perplexity over 128-token windows, teacher-forced agreement with the export's golden
continuations); decode in process (``DecoderRunner``, 2 threads, one stream, 48 greedy tokens after the first
golden prompt), the graphs interleaved round by round, CPU time per token read beside the wall clock (another
process's load moves it less). With ``--llama-python`` (a Python with ``llama-cpp-python``), llama.cpp evaluates
the same windows' token ids on the GGUF itself (``Llama(logits_all=True)``) and its perplexity is set beside the
graphs'. The section between ``<!-- gguf_carry:start -->`` and ``<!-- gguf_carry:end -->`` of
benchmarks/RESULTS.md is replaced with ``--write``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

START, END = "<!-- gguf_carry:start -->", "<!-- gguf_carry:end -->"
TOKENS = 48

# Run by the llama-cpp-python interpreter: NLL of ids[1:] given their prefixes, per window, as token_nll computes it.
LLAMA_SCRIPT = r"""
import json, math, sys
import numpy as np
from llama_cpp import Llama
path, windows_file, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
windows = json.load(open(windows_file))
n_ctx = max(len(w) for w in windows) + 8
llm = Llama(model_path=path, logits_all=True, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, verbose=False)
total = count = 0.0
for ids in windows:
    llm.reset()
    llm.eval(ids)
    logits = np.array(llm.scores[:len(ids) - 1], dtype=np.float64)
    top = logits.max(axis=-1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(axis=-1)) + top[:, 0]
    total += float((logz - logits[np.arange(len(ids) - 1), np.asarray(ids[1:])]).sum())
    count += len(ids) - 1
print(json.dumps({"nll": total, "tokens": count, "perplexity": math.exp(total / count)}))
"""


def llama_cpp_perplexity(python: str, gguf: Path, windows: list[list[int]], threads: int = 2) -> dict:
    """llama.cpp's perplexity of ``windows`` on ``gguf``, or {"error": why} (not installed, failed)."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "w.json").write_text(json.dumps(windows))
        (Path(tmp) / "s.py").write_text(LLAMA_SCRIPT)
        out = subprocess.run([python, str(Path(tmp) / "s.py"), str(gguf), str(Path(tmp) / "w.json"), str(threads)],
                             capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["exit status %d" % out.returncode])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def decode(runner, prompt, tokens: int = TOKENS) -> tuple[float, float]:
    """(tokens/s by the wall clock, CPU ms per token) of ``tokens`` greedy tokens after ``prompt`` (prefill out)."""
    runner.greedy(prompt, 1)
    w0, c0 = time.perf_counter(), time.process_time()
    runner.greedy(prompt, 1)
    w1, c1 = time.perf_counter(), time.process_time()
    runner.greedy(prompt, tokens + 1)
    w2, c2 = time.perf_counter(), time.process_time()
    wall, cpu = (w2 - w1) - (w1 - w0), (c2 - c1) - (c1 - c0)
    return tokens / max(wall, 1e-9), 1000 * cpu / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--heldout", type=Path, required=True)
    ap.add_argument("--gguf", type=Path, help="the GGUF the build read (llama.cpp evaluates it)")
    ap.add_argument("--llama-python", default="/work/peers/llamacpp/bin/python")
    ap.add_argument("--graph", action="append", default=[], metavar="NAME=PATH",
                    help="another graph to score and time beside them (a carried variant)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    from benchmarks.harness.run_header import LoadReading, run_header
    from benchmarks.results_file import publish, say
    from model_factory.build_engines.causal_lm import prompt_ids, read_reference
    from model_factory.build_engines.lm_graph import DecoderRunner, head_dim_of
    from model_factory.build_engines.lm_quantize import PPL_TOKENS, Scorer
    from model_factory.recipe import read_hf_config

    load = LoadReading.begin()
    work = args.work
    record = json.loads((work / "source" / "gguf_source.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(str(work / "export" / "tokenizer"))
    texts = [t for t in args.heldout.read_text().splitlines() if t.strip()]
    windows = [list(prompt_ids(tok, t, PPL_TOKENS)) for t in texts]
    reference = read_reference(work / "export")
    head_dim = head_dim_of(read_hf_config(work / "source"))
    graphs = {"fp32": work / "export" / "model.onnx", "int8": work / "quantize" / "model.int8.onnx",
              "gguf": work / "quantize" / "model.gguf.onnx"}
    graphs = {p: g for p, g in graphs.items() if g.is_file()}  # int8 where the recipe built it
    graphs.update({k: Path(v) for k, v in (g.split("=", 1) for g in args.graph)})
    say("scoring FP32 (the gate's Scorer)")
    scorer = Scorer(graphs["fp32"], head_dim, windows, reference)
    scores = {"fp32": (1.0, scorer.ppl_fp32, 0.0)}
    for p in [p for p in graphs if p != "fp32"]:
        say(f"scoring {p}")
        agree, ppl, err, _n = scorer.score(graphs[p])
        scores[p] = (agree, ppl, err)
    speeds: dict[str, list[tuple[float, float]]] = {p: [] for p in graphs}
    runners = {p: DecoderRunner(g, scorer.context + TOKENS + 2, head_dim, threads=2) for p, g in graphs.items()}
    prompt = reference[0].prompt_ids
    for r in range(args.rounds):
        for p, runner in runners.items():
            say(f"decode round {r + 1}: {p}")
            speeds[p].append(decode(runner, prompt))
    llama = None
    if args.gguf and args.llama_python and Path(args.llama_python).is_file():
        say("llama.cpp on the same windows")
        llama = llama_cpp_perplexity(args.llama_python, args.gguf, windows)
    load = load.finish()
    carried = json.loads((work / "quantize" / "gguf_carry.json").read_text())
    lines = [START, f"## gguf_carry: the GGUF's own blocks as the graph's weights ({record['file']})", "",
             run_header("bench_gguf_carry.py", load), "",
             f"Source: `{record['file']}` (sha256 `{record['sha256'][:16]}...`; "
             + ", ".join(f"{n} {t}" for t, n in record["tensor_types"].items()) + f"). Held-out: {len(windows)} "
             f"windows of up to {PPL_TOKENS} tokens of `{args.heldout.name}`; agreement on {len(reference)} golden "
             "prompts (the gate's Scorer).", "",
             "| GGUF type | MatMuls | form | exact | max abs error vs gguf.quants.dequantize |", "| --- | --- | --- | --- | --- |"]
    for t, v in carried["by_type"].items():
        lines.append(f"| {t} | {v['matmuls']} | {v['form']} | {'yes' if v['exact'] else 'no'} | {v['max_abs_error']:.3g} |")
    lines += ["", "| graph | agreement | perplexity | ratio to FP32 | max abs logits error | tokens/s (wall) | CPU ms/token |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for p in graphs:
        agree, ppl, err = scores[p]
        wall = ", ".join(f"{s[0]:.1f}" for s in speeds[p])
        cpu = ", ".join(f"{s[1]:.1f}" for s in speeds[p])
        lines.append(f"| {p} | {agree:.4f} | {ppl:.3f} | {ppl / scorer.ppl_fp32:.4f} | {err:.3g} | {wall} | {cpu} |")
    if llama is not None and "error" in llama:
        lines += ["", f"llama.cpp: not measured ({args.llama_python}: {llama['error']})."]
    elif llama is not None:
        lines += ["", f"llama.cpp (`llama-cpp-python`, the same {int(llama['tokens'])} token ids, the GGUF itself): "
                  f"perplexity {llama['perplexity']:.3f}; the gguf graph's is {scores['gguf'][1] / llama['perplexity']:.4f}x "
                  f"it, FP32's (the GGUF dequantized) {scorer.ppl_fp32 / llama['perplexity']:.4f}x."]
    else:
        lines += ["", "llama.cpp: not measured (no `llama-cpp-python` at --llama-python)."]
    lines.append(END)
    publish("\n".join(lines), ROOT / "benchmarks" / "RESULTS.md", START, END, args.write)


if __name__ == "__main__":
    main()
