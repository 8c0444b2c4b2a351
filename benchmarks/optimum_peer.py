"""optimum's ``ORTModelForCausalLM``, in-process: the peer ``bench_generate_graphs.py --optimum-python`` runs.

Runs inside its own venv (``pip install torch==2.13.0 'optimum-onnx[onnxruntime]'``: optimum-onnx pins a
transformers of its own), never the factory's. Exports the HF folder once
(``optimum-cli export onnx --task text-generation-with-past``: one graph with past key/values inputs, the cache
growing by concatenation each step), loads it with ONNX Runtime on ``--threads`` threads, then answers one JSON
line per JSON line read on stdin (``{"rows": [[ids]...], "new": N}``): the prefill's seconds and the decode
tokens/s of the ``N - 1`` greedy steps after it, all rows together, timed as ``bench_generate_graphs`` times the
others.

    python benchmarks/optimum_peer.py --folder HF_DIR --export OUT_DIR --threads 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", required=True)
    ap.add_argument("--export", required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    out = Path(args.export)
    if not (out / "model.onnx").is_file():
        cli = Path(sys.executable).parent / "optimum-cli"
        subprocess.run([str(cli), "export", "onnx", "--model", args.folder, "--task", "text-generation-with-past",
                        str(out)], check=True, stdout=sys.stderr, stderr=sys.stderr)
    import onnxruntime as ort
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM

    torch.set_num_threads(args.threads)
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    model = ORTModelForCausalLM.from_pretrained(str(out), session_options=options, provider="CPUExecutionProvider")
    print(json.dumps({"ready": True, "onnxruntime": ort.__version__}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        ids = torch.tensor(ask["rows"], dtype=torch.int64)
        mask = torch.ones_like(ids)
        with torch.no_grad():
            t0 = time.perf_counter()
            res = model(input_ids=ids, attention_mask=mask, use_cache=True)
            prefill = time.perf_counter() - t0
            past, nxt = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)
            t0 = time.perf_counter()
            for _ in range(ask["new"] - 1):
                mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
                res = model(input_ids=nxt, attention_mask=mask, past_key_values=past, use_cache=True)
                past, nxt = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)
            seconds = time.perf_counter() - t0
        print(json.dumps({"prefill": prefill, "tps": ids.shape[0] * (ask["new"] - 1) / seconds}), flush=True)


if __name__ == "__main__":
    main()
