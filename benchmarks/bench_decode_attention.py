"""One decode step's attention, one layer: ONNX Runtime's GroupQueryAttention against the factory's INT8-cache kernel
and the same attention in standard ops (issue 32: is there a faster CPU attention to put in the graph?).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_decode_attention.py [--rounds 5] [--write]

The shapes of bench_generate's Llama (SmolLM-135M's attention: 9 query heads, 3 KV heads, head size 64), B rows
decoding one token each over T cached tokens, the KV buffers of the backend's slot layout (``[slots, kv_heads,
max_context, head_size]``, max_context 2048), 2 threads, each variant a session of its own. Every variant cycles
through ``LAYERS`` (30) sets of buffers, one per layer of the model, so that as in a served decode step its keys and
values come from memory, not from a CPU cache that still holds them (a single set, which for 32 x 192 tokens fits
this EPYC's 32 MB L3, flatters the grouped variants):

- ``GQA fp32``: the graph's own node (``com.microsoft.GroupQueryAttention``, rotary applied, the new token written in
  place into the shared buffer, as the packaged graphs run it);
- ``GQA int8``: the same with the INT8 cache (``k_quant_type`` / ``v_quant_type`` PER_CHANNEL, 8 bits:
  ``quantization.kv_cache = "int8"``);
- ``kernel int8``: the INT8-cache node rewritten to the factory's operator (``Int8KVAttention``,
  backends/python_backend/generation/int8_attention.py, compiled for this host), as the backend rewrites it at load;
- ``grouped, token-major``: the 3 query heads that share a KV head as 3 rows of one batched product
  (``FusedMatMul`` transB, a mask bias, ``Softmax``, ``MatMul``) over keys and values handed over as ``[B, kv_heads,
  T, head_size]``: what a cache laid out with the first T tokens of every slot contiguous would allow (no rotary,
  no cache write: a lower bound on its cost);
- ``grouped, slot layout``: the same from the slot layout's buffers, which must first be sliced to the T cached
  tokens (``Slice``: a copy of the keys and values every step).

Median milliseconds per call over the rounds (each round 300 calls after a warm-up), the range in brackets, the
attention's arithmetic rate (2 x 2 x B x heads x T x head_size floating-point operations a call) and the rate at which
it reads the cached keys and values (2 x B x kv_heads x T x head_size values, one byte each in INT8, else four).
The section between ``<!-- decode_attention:start -->`` and ``<!-- decode_attention:end -->`` is replaced.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from results_file import publish, say  # noqa: E402

START, END = "<!-- decode_attention:start -->", "<!-- decode_attention:end -->"
HEADS, KV_HEADS, HEAD, MAX_CONTEXT = 9, 3, 64, 2048
LAYERS = 30  # buffer sets a variant cycles through, one per layer of the model: its KV bytes then exceed the caches
SHAPES = ((8, 192), (32, 192), (32, 448))  # (rows, cached tokens)
CALLS = 300  # ten passes over the LAYERS buffer sets


def _session(model, threads: int = 2, library: str | None = None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    if library:
        opts.register_custom_ops_library(library)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _opsets():
    from onnx import helper

    return [helper.make_opsetid("", 22), helper.make_opsetid("com.microsoft", 1)]


def gqa_call(rows: int, cached: int, int8: bool, rng: np.random.Generator, kernel: bool = False):
    """A GroupQueryAttention decode call over the shared slot buffers, as a no-argument function; ``kernel``: the
    factory's INT8-cache operator instead (the node rewritten as the backend rewrites it)."""
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper

    kv_type, kv_np = (TP.INT8, np.int8) if int8 else (TP.FLOAT, np.float32)
    inputs = ["qkv", "", "", "pk", "pv", "seqlens", "total", "cos", "sin"]
    attrs = dict(num_heads=HEADS, kv_num_heads=KV_HEADS, scale=HEAD ** -0.5, do_rotary=1)
    inits = []
    if int8:
        inputs += ["", "", "", "k_scale", "v_scale"]
        attrs.update(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8)
        scale = np.full(KV_HEADS * HEAD, 0.02, np.float32)
        inits = [numpy_helper.from_array(scale, "k_scale"), numpy_helper.from_array(scale, "v_scale")]
    node = helper.make_node("GroupQueryAttention", inputs, ["out", "prk", "prv"], domain="com.microsoft", **attrs)
    kv_shape = [rows, KV_HEADS, MAX_CONTEXT, HEAD]
    graph = helper.make_graph([node], "gqa", [
        helper.make_tensor_value_info("qkv", TP.FLOAT, [rows, 1, (HEADS + 2 * KV_HEADS) * HEAD]),
        helper.make_tensor_value_info("pk", kv_type, kv_shape), helper.make_tensor_value_info("pv", kv_type, kv_shape),
        helper.make_tensor_value_info("seqlens", TP.INT32, [rows]), helper.make_tensor_value_info("total", TP.INT32, []),
        helper.make_tensor_value_info("cos", TP.FLOAT, [MAX_CONTEXT, HEAD // 2]),
        helper.make_tensor_value_info("sin", TP.FLOAT, [MAX_CONTEXT, HEAD // 2])],
        [helper.make_tensor_value_info("out", TP.FLOAT, [rows, 1, HEADS * HEAD]),
         helper.make_tensor_value_info("prk", kv_type, kv_shape), helper.make_tensor_value_info("prv", kv_type, kv_shape)],
        inits)
    model = helper.make_model(graph, opset_imports=_opsets())
    library = None
    if kernel:
        from model_factory.backend.generation.int8_attention import library as kernel_library, rewrite

        rewrite(model)
        library = str(kernel_library())
    sess = _session(model, library=library)
    angles = rng.standard_normal((MAX_CONTEXT, HEAD // 2))
    qkv = rng.standard_normal((rows, 1, (HEADS + 2 * KV_HEADS) * HEAD), dtype=np.float32)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    bindings, buffers = [], []
    for _ in range(LAYERS):  # one layer's slot buffers each: zero pages beyond the cached tokens, as served
        pair = []
        for _kind in ("key", "value"):
            buf = np.zeros(kv_shape, kv_np)
            buf[:, :, :cached + 1] = (rng.integers(-127, 128, (rows, KV_HEADS, cached + 1, HEAD), dtype=np.int8)
                                      if int8 else rng.standard_normal((rows, KV_HEADS, cached + 1, HEAD),
                                                                       dtype=np.float32))
            pair.append(buf)
        io = sess.io_binding()
        io.bind_cpu_input("qkv", qkv)
        io.bind_cpu_input("cos", cos)
        io.bind_cpu_input("sin", sin)
        # The same cached length every call (the new token overwrites position `cached` each time).
        io.bind_cpu_input("seqlens", np.full(rows, cached, np.int32))
        io.bind_cpu_input("total", np.array(cached + 1, np.int32))
        for past, present, buf in (("pk", "prk", pair[0]), ("pv", "prv", pair[1])):
            io.bind_input(past, "cpu", 0, kv_np, kv_shape, buf.ctypes.data)
            io.bind_output(present, "cpu", 0, kv_np, kv_shape, buf.ctypes.data)
        io.bind_output("out", "cpu")
        bindings.append(io)
        buffers.append(pair)
    turn = itertools.cycle(bindings)

    def run() -> None:
        sess.run_with_iobinding(next(turn))
    run.buffers = buffers  # the bindings point into them: kept alive with the call
    return run


def grouped_call(rows: int, cached: int, slot_layout: bool, rng: np.random.Generator):
    """The grouped standard-op attention (module docstring), as a no-argument function."""
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper

    group = HEADS // KV_HEADS
    total = cached + 1
    nodes, inits = [], []
    inputs = [helper.make_tensor_value_info("q", TP.FLOAT, [rows, KV_HEADS, group, HEAD]),
              helper.make_tensor_value_info("bias", TP.FLOAT, [rows, 1, 1, total])]
    if slot_layout:
        shape = [rows, KV_HEADS, MAX_CONTEXT, HEAD]
        inputs += [helper.make_tensor_value_info("k_slots", TP.FLOAT, shape),
                   helper.make_tensor_value_info("v_slots", TP.FLOAT, shape)]
        inits = [numpy_helper.from_array(np.array([0], np.int64), "start"),
                 numpy_helper.from_array(np.array([total], np.int64), "end"),
                 numpy_helper.from_array(np.array([2], np.int64), "axis")]
        nodes += [helper.make_node("Slice", ["k_slots", "start", "end", "axis"], ["k"]),
                  helper.make_node("Slice", ["v_slots", "start", "end", "axis"], ["v"])]
    else:
        shape = [rows, KV_HEADS, total, HEAD]
        inputs += [helper.make_tensor_value_info("k", TP.FLOAT, shape), helper.make_tensor_value_info("v", TP.FLOAT, shape)]
    nodes += [helper.make_node("FusedMatMul", ["q", "k"], ["scores"], domain="com.microsoft", transB=1,
                               alpha=HEAD ** -0.5),
              helper.make_node("Add", ["scores", "bias"], ["masked"]),
              helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
              helper.make_node("MatMul", ["probs", "v"], ["out"])]
    graph = helper.make_graph(nodes, "grouped", inputs,
                              [helper.make_tensor_value_info("out", TP.FLOAT, [rows, KV_HEADS, group, HEAD])], inits)
    sess = _session(helper.make_model(graph, opset_imports=_opsets()))
    q = rng.standard_normal((rows, KV_HEADS, group, HEAD), dtype=np.float32)
    bias = np.zeros((rows, 1, 1, total), np.float32)
    names = ("k_slots", "v_slots") if slot_layout else ("k", "v")
    layers = []
    for _ in range(LAYERS):  # one layer's keys and values each
        feeds = {"q": q, "bias": bias}
        for name in names:
            feeds[name] = np.zeros(shape, np.float32)
            feeds[name][:, :, :total] = rng.standard_normal((rows, KV_HEADS, total, HEAD), dtype=np.float32)
        layers.append(feeds)
    turn = itertools.cycle(layers)

    def run() -> None:
        sess.run(None, next(turn))
    return run


VARIANTS = {
    "GQA fp32": lambda b, t, rng: gqa_call(b, t, False, rng),
    "GQA int8": lambda b, t, rng: gqa_call(b, t, True, rng),
    "kernel int8": lambda b, t, rng: gqa_call(b, t, True, rng, kernel=True),
    "grouped, token-major": lambda b, t, rng: grouped_call(b, t, False, rng),
    "grouped, slot layout": lambda b, t, rng: grouped_call(b, t, True, rng),
}


def time_call(run) -> float:
    """Milliseconds per call: a warm-up, then CALLS calls."""
    run()
    start = time.perf_counter()
    for _ in range(CALLS):
        run()
    return (time.perf_counter() - start) / CALLS * 1000


def main() -> int:
    from benchmarks.harness.run_header import LoadReading, run_header

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    calls = {(name, shape): make(*shape, rng) for shape in SHAPES for name, make in VARIANTS.items()}
    load = LoadReading.begin()
    ms: dict = {key: [] for key in calls}
    for r in range(args.rounds):
        keys = list(calls) if r % 2 == 0 else list(reversed(calls))  # the order alternates between rounds
        for key in keys:
            ms[key].append(time_call(calls[key]))
        say(f"round {r + 1}: " + ", ".join(f"{k[0]} {k[1]} {ms[k][-1]:.3f} ms" for k in calls))
    load = load.finish()

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})"

    rows = []
    for b, t in SHAPES:
        flops = 2 * 2 * b * HEADS * (t + 1) * HEAD
        base = statistics.median(ms[("GQA fp32", (b, t))])

        def kv_rate(name: str) -> float:  # GB/s of cached keys and values read (one byte each in INT8, else four)
            kv_bytes = 2 * b * KV_HEADS * (t + 1) * HEAD * (1 if "int8" in name else 4)
            return kv_bytes / statistics.median(ms[(name, (b, t))]) / 1e6
        rows.append(f"| {b} x {t} | " + " | ".join(
            f"{cell(ms[(name, (b, t))])}; {flops / statistics.median(ms[(name, (b, t))]) / 1e6:.0f} GFLOP/s, "
            f"KV {kv_rate(name):.1f} GB/s; {base / statistics.median(ms[(name, (b, t))]):.2f}x" for name in VARIANTS)
            + " |")
    section = "\n".join([
        START, "## Decode attention, one layer: GroupQueryAttention against the factory's INT8-cache kernel and "
        "standard ops (benchmarks/bench_decode_attention.py)", "",
        run_header("benchmarks/bench_decode_attention.py", load), "",
        f"One decode step's attention in one layer of bench_generate's Llama ({HEADS} query heads, {KV_HEADS} KV "
        f"heads, head size {HEAD}), B rows over T cached tokens, KV buffers of the backend's slot layout "
        f"(max_context {MAX_CONTEXT}), ONNX Runtime on 2 threads; each variant cycles through {LAYERS} sets of buffers, one "
        "per layer of the model, so its keys and values come from memory as in a served step. GQA: the packaged graphs' node (rotary and the "
        "in-place cache write included), with the float and with the INT8 cache. Kernel int8: the INT8-cache node "
        "rewritten to the factory's operator (`Int8KVAttention`, compiled on this host), as the backend serves it. "
        "Grouped: the 3 query heads of a "
        "KV head as the rows of one batched FusedMatMul / Softmax / MatMul, over keys and values already "
        "`[B, kv_heads, T, head_size]` (token-major: a cache layout the backend does not have; no rotary, no cache "
        "write) or sliced out of the slot layout's buffers every step. Per cell: milliseconds per call, median "
        f"of {args.rounds} rounds of {CALLS} calls (range in brackets); the attention's GFLOP/s and the cached keys "
        "and values it reads per second; the speed relative to GQA fp32.", "",
        "| B x T | " + " | ".join(VARIANTS) + " |", "|---|" + "---|" * len(VARIANTS), *rows, "", END])
    publish(section, HERE / "RESULTS.md", START, END, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
