"""One decode step's attention, one layer: ONNX Runtime's GroupQueryAttention against the factory's INT8-cache kernel
and the same attention in standard ops (issue 32: is there a faster CPU attention to put in the graph?).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_decode_attention.py [--shape llama|gemma3] [--rounds 5]
        [--variant NAME ...] [--baseline-source OLD/int8_kv_attention.cc] [--blocks] [--write]

``--shape llama`` (the default): bench_generate's Llama (SmolLM-135M's attention: 9 query heads, 3 KV heads, head
size 64, max_context 2048, 30 layers; 8 x 192, 32 x 192, 32 x 448). ``--shape gemma3``: Gemma 3 270M's (4 query heads
sharing 1 KV head, head size 256, separate query / key / value inputs as its graph has them (q_norm / k_norm before
the rotary), a sliding window of 512, max_context 512 as in bench_generate's build, 18 layers; 8 x 192, 32 x 192,
32 x 384). B rows decoding one token each over T cached tokens, the KV buffers of the backend's slot layout
(``[slots, kv_heads, max_context, head_size]``), 2 threads, each variant a session of its own. Every variant cycles
through one set of buffers per layer of the model, so that as in a served decode step its keys and values come from
memory, not from a CPU cache that still holds them (a single set, which for 32 x 192 tokens fits this EPYC's 32 MB
L3, flatters the grouped variants):

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
  tokens (``Slice``: a copy of the keys and values every step);
- ``kernel int8, AVX2``: the factory's operator compiled without AVX-512 (``int8_attention.library(isa="avx2")``:
  the path an AVX2-only CPU runs), only where this host has AVX-512;
- ``kernel int8, baseline``: with ``--baseline-source``, the operator compiled from another source (an earlier
  revision's ``kernels/int8_kv_attention.cc``, its ``ort_abi.h`` beside it), to time a change against it;
- ``kernel int8, blocks`` (and ``kernel int8, blocks, AVX2`` where the host has AVX-512; ``kernel int8, blocks in
  order``: each row's blocks consecutive in the pool, to tell the scatter's cost from the table's): with ``--blocks``, the
  operator reading and writing through a block table (``rewrite(model, block_size=16)``): each layer's cache one pool
  ``[B x max_context / 16 blocks, kv_heads, 16, head_size]``, each row's blocks a shuffled draw from it (a served
  pool's blocks are in no order), against ``kernel int8`` (and its AVX2 build) on the slot layout. ``--blocks`` runs
  only the kernel's variants (with ``--baseline-source`` also ``kernel int8, blocks, baseline``: that source through
  the same tables) and writes its own section (``<!-- decode_attention[_gemma3]_blocks:start -->``).

Gemma 3's layers are 5 sliding-window (512) to 1 global; at max_context 512 a window of 512 reads the same keys as a
global layer, so every gemma3 layer here is one node with ``local_window_size`` 512.

Median milliseconds per call over the rounds (each round 300 calls after a warm-up), the range in brackets, the
attention's arithmetic rate (2 x 2 x B x heads x T x head_size floating-point operations a call) and the rate at which
it reads the cached keys and values (2 x B x kv_heads x T x head_size values, one byte each in INT8, else four).
The section between ``<!-- decode_attention:start -->`` and ``<!-- decode_attention:end -->`` is replaced (``--shape
gemma3``: ``<!-- decode_attention_gemma3:start -->`` ... ``:end -->``).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from results_file import publish, say  # noqa: E402



@dataclass(frozen=True)
class Shape:
    """A model's attention as one decode step meets it."""

    name: str
    description: str
    heads: int
    kv_heads: int
    head: int
    max_context: int
    layers: int  # buffer sets a variant cycles through, one per layer: its KV bytes then exceed the caches
    cases: tuple[tuple[int, int], ...]  # (rows, cached tokens)
    window: int = -1  # local_window_size
    separate: bool = False  # query, key and value as three inputs (else packed in one)

    def markers(self, blocks: bool = False) -> tuple[str, str]:
        tag = "decode_attention" if self.name == "llama" else f"decode_attention_{self.name}"
        tag += "_blocks" if blocks else ""
        return f"<!-- {tag}:start -->", f"<!-- {tag}:end -->"


SHAPES = {
    "llama": Shape("llama", "bench_generate's Llama (SmolLM-135M)", 9, 3, 64, 2048, 30,
                   ((8, 192), (32, 192), (32, 448))),
    "gemma3": Shape("gemma3", "Gemma 3 270M (separate query / key / value inputs, local_window_size 512)", 4, 1, 256,
                    512, 18, ((8, 192), (32, 192), (32, 384)), window=512, separate=True),
}
CALLS = 300  # ten passes over the Llama's 30 buffer sets
BLOCK = 16  # --blocks: the block size (the prefix cache's)


THREADS = 2  # ONNX Runtime's intra-op threads (--threads)


def _session(model, library: str | None = None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = THREADS
    opts.log_severity_level = 3
    if library:
        opts.register_custom_ops_library(library)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _opsets():
    from onnx import helper

    return [helper.make_opsetid("", 22), helper.make_opsetid("com.microsoft", 1)]


def gqa_call(shape: Shape, rows: int, cached: int, int8: bool, rng: np.random.Generator, kernel: bool = False,
             isa: str = "native", source: str | None = None, blocks: bool = False, shuffled: bool = True):
    """A GroupQueryAttention decode call over the shared slot buffers, as a no-argument function; ``kernel``: the
    factory's INT8-cache operator instead (the node rewritten as the backend rewrites it), compiled for ``isa`` from
    ``source`` (the backend's own by default); ``blocks``: that operator through a block table over a pool of
    :data:`BLOCK`-token blocks, each row's a shuffled draw from the pool (``shuffled``; else each row's blocks in
    order, as a fresh pool hands them out)."""
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper

    heads, kv_heads, head, context = shape.heads, shape.kv_heads, shape.head, shape.max_context
    kv_type, kv_np = (TP.INT8, np.int8) if int8 else (TP.FLOAT, np.float32)
    inputs = ["q", "k", "v"] if shape.separate else ["qkv", "", ""]
    inputs += ["pk", "pv", "seqlens", "total", "cos", "sin"]
    attrs = dict(num_heads=heads, kv_num_heads=kv_heads, scale=head ** -0.5, do_rotary=1)
    if shape.window > 0:
        attrs["local_window_size"] = shape.window
    inits = []
    if int8:
        inputs += ["", "", "", "k_scale", "v_scale"]
        attrs.update(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8)
        scale = np.full(kv_heads * head, 0.02, np.float32)
        inits = [numpy_helper.from_array(scale, "k_scale"), numpy_helper.from_array(scale, "v_scale")]
    node = helper.make_node("GroupQueryAttention", inputs, ["out", "prk", "prv"], domain="com.microsoft", **attrs)
    kv_shape = [rows, kv_heads, context, head]
    widths = ({"q": heads * head, "k": kv_heads * head, "v": kv_heads * head} if shape.separate
              else {"qkv": (heads + 2 * kv_heads) * head})
    graph = helper.make_graph([node], "gqa", [
        *(helper.make_tensor_value_info(name, TP.FLOAT, [rows, 1, width]) for name, width in widths.items()),
        helper.make_tensor_value_info("pk", kv_type, kv_shape), helper.make_tensor_value_info("pv", kv_type, kv_shape),
        helper.make_tensor_value_info("seqlens", TP.INT32, [rows]), helper.make_tensor_value_info("total", TP.INT32, []),
        helper.make_tensor_value_info("cos", TP.FLOAT, [context, head // 2]),
        helper.make_tensor_value_info("sin", TP.FLOAT, [context, head // 2])],
        [helper.make_tensor_value_info("out", TP.FLOAT, [rows, 1, heads * head]),
         helper.make_tensor_value_info("prk", kv_type, kv_shape), helper.make_tensor_value_info("prv", kv_type, kv_shape)],
        inits)
    model = helper.make_model(graph, opset_imports=_opsets())
    library = None
    if kernel:
        from model_factory.backend.generation.int8_attention import SOURCE, library as kernel_library, rewrite

        rewrite(model, block_size=BLOCK if blocks else 0)
        library = str(kernel_library(Path(source) if source else SOURCE, isa=isa))
    sess = _session(model, library=library)
    angles = rng.standard_normal((context, head // 2))
    feeds = {name: rng.standard_normal((rows, 1, width), dtype=np.float32) for name, width in widths.items()}
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    bindings, buffers = [], []
    per_row = context // BLOCK
    if blocks:
        kv_shape = [rows * per_row, kv_heads, BLOCK, head]
    for _ in range(shape.layers):  # one layer's slot buffers each: zero pages beyond the cached tokens, as served
        pair = []
        order = rng.permutation(rows * per_row) if shuffled else np.arange(rows * per_row)
        table = order.reshape(rows, per_row).astype(np.int32)
        for _kind in ("key", "value"):
            buf = np.zeros(kv_shape, kv_np)
            if blocks:  # the blocks holding each row's cached tokens written, the rest zero pages (as slots)
                used = table[:, :-(-(cached + 1) // BLOCK)].reshape(-1)
                buf[used] = rng.integers(-127, 128, (len(used), *kv_shape[1:]), dtype=np.int8)
            else:
                buf[:, :, :cached + 1] = (rng.integers(-127, 128, (rows, kv_heads, cached + 1, head), dtype=np.int8)
                                          if int8 else rng.standard_normal((rows, kv_heads, cached + 1, head),
                                                                           dtype=np.float32))
            pair.append(buf)
        io = sess.io_binding()
        if blocks:
            io.bind_cpu_input("block_table", table)
        for name, value in feeds.items():
            io.bind_cpu_input(name, value)
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


def grouped_call(shape: Shape, rows: int, cached: int, slot_layout: bool, rng: np.random.Generator):
    """The grouped standard-op attention (module docstring), as a no-argument function."""
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper

    HEADS, KV_HEADS, HEAD, MAX_CONTEXT = shape.heads, shape.kv_heads, shape.head, shape.max_context  # noqa: N806
    group = HEADS // KV_HEADS
    total = cached + 1
    nodes, inits = [], []
    inputs = [helper.make_tensor_value_info("q", TP.FLOAT, [rows, KV_HEADS, group, HEAD]),
              helper.make_tensor_value_info("bias", TP.FLOAT, [rows, 1, 1, total])]
    if slot_layout:
        dims = [rows, KV_HEADS, MAX_CONTEXT, HEAD]
        inputs += [helper.make_tensor_value_info("k_slots", TP.FLOAT, dims),
                   helper.make_tensor_value_info("v_slots", TP.FLOAT, dims)]
        inits = [numpy_helper.from_array(np.array([0], np.int64), "start"),
                 numpy_helper.from_array(np.array([total], np.int64), "end"),
                 numpy_helper.from_array(np.array([2], np.int64), "axis")]
        nodes += [helper.make_node("Slice", ["k_slots", "start", "end", "axis"], ["k"]),
                  helper.make_node("Slice", ["v_slots", "start", "end", "axis"], ["v"])]
    else:
        dims = [rows, KV_HEADS, total, HEAD]
        inputs += [helper.make_tensor_value_info("k", TP.FLOAT, dims),
                   helper.make_tensor_value_info("v", TP.FLOAT, dims)]
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
    for _ in range(shape.layers):  # one layer's keys and values each
        feeds = {"q": q, "bias": bias}
        for name in names:
            feeds[name] = np.zeros(dims, np.float32)
            feeds[name][:, :, :total] = rng.standard_normal((rows, KV_HEADS, total, HEAD), dtype=np.float32)
        layers.append(feeds)
    turn = itertools.cycle(layers)

    def run() -> None:
        sess.run(None, next(turn))
    return run


VARIANTS = {
    "GQA fp32": lambda shape, b, t, rng, args: gqa_call(shape, b, t, False, rng),
    "GQA int8": lambda shape, b, t, rng, args: gqa_call(shape, b, t, True, rng),
    "kernel int8": lambda shape, b, t, rng, args: gqa_call(shape, b, t, True, rng, kernel=True),
    "kernel int8, AVX2": lambda shape, b, t, rng, args: gqa_call(shape, b, t, True, rng, kernel=True, isa="avx2"),
    "kernel int8, baseline": lambda shape, b, t, rng, args: gqa_call(shape, b, t, True, rng, kernel=True,
                                                                     source=args.baseline_source),
    "kernel int8, blocks": lambda shape, b, t, rng, args: gqa_call(shape, b, t, True, rng, kernel=True, blocks=True),
    "kernel int8, blocks, AVX2": lambda shape, b, t, rng, args: gqa_call(shape, b, t, True, rng, kernel=True,
                                                                         isa="avx2", blocks=True),
    "kernel int8, blocks, baseline": lambda shape, b, t, rng, args: gqa_call(shape, b, t, True, rng, kernel=True,
                                                                             source=args.baseline_source, blocks=True),
    "kernel int8, blocks in order": lambda shape, b, t, rng, args: gqa_call(shape, b, t, True, rng, kernel=True,
                                                                            blocks=True, shuffled=False),
    "grouped, token-major": lambda shape, b, t, rng, args: grouped_call(shape, b, t, False, rng),
    "grouped, slot layout": lambda shape, b, t, rng, args: grouped_call(shape, b, t, True, rng),
}


def time_call(run) -> tuple[float, float]:
    """Milliseconds per call, wall and CPU (every thread of the process): a warm-up, then CALLS calls."""
    run()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(CALLS):
        run()
    return (time.perf_counter() - start) / CALLS * 1000, (time.process_time() - cpu) / CALLS * 1000


def main() -> int:
    from benchmarks.harness.run_header import LoadReading, cpu_flags, run_header

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variant", action="append", help="a variant to run (repeat it; default: all that apply here)")
    ap.add_argument("--baseline-source", help="another kernel source to time as 'kernel int8, baseline'")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime's intra-op threads (2: as served)")
    ap.add_argument("--blocks", action="store_true",
                    help="the kernel through a block table against the kernel on the slot layout (its own section)")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    global THREADS
    THREADS = args.threads
    shape = SHAPES[args.shape]
    avx512 = "avx512f" in cpu_flags()
    if args.blocks:
        names = ["kernel int8", "kernel int8, blocks", "kernel int8, blocks in order"] + (
            ["kernel int8, AVX2", "kernel int8, blocks, AVX2"] if avx512 else []) + (
            ["kernel int8, blocks, baseline"] if args.baseline_source else [])
    else:
        names = [n for n in VARIANTS if (n != "kernel int8, AVX2" or avx512)
                 and (n != "kernel int8, baseline" or args.baseline_source) and "blocks" not in n]
    if args.variant:
        wanted = args.variant
        unknown = sorted(set(wanted) - set(VARIANTS))
        if unknown:
            ap.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
        names = [n for n in names if n in wanted]
    rng = np.random.default_rng(0)
    load = LoadReading.begin()
    ms: dict = {}
    cpu: dict = {}
    for case in shape.cases:  # one case's sessions and buffers at a time (a Gemma case's float buffers: ~0.6 GB each)
        calls = {name: VARIANTS[name](shape, *case, rng, args) for name in names}
        for name in calls:
            ms[(name, case)], cpu[(name, case)] = [], []
        for r in range(args.rounds):
            order = list(calls) if r % 2 == 0 else list(reversed(calls))  # the order alternates between rounds
            for name in order:
                wall, used = time_call(calls[name])
                ms[(name, case)].append(wall)
                cpu[(name, case)].append(used)
            say(f"{case[0]} x {case[1]} round {r + 1}: " + ", ".join(
                f"{n} {ms[(n, case)][-1]:.3f} ms (CPU {cpu[(n, case)][-1]:.3f})" for n in calls))
        del calls
        gc.collect()
    load = load.finish()

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})"

    heads, kv_heads, head = shape.heads, shape.kv_heads, shape.head
    rows = []
    for b, t in shape.cases:
        flops = 2 * 2 * b * heads * (t + 1) * head
        base = statistics.median(ms[(names[0], (b, t))])
        base_cpu = statistics.median(cpu[(names[0], (b, t))])

        def kv_rate(name: str) -> float:  # GB/s of cached keys and values read (one byte each in INT8, else four)
            kv_bytes = 2 * b * kv_heads * (t + 1) * head * (1 if "int8" in name else 4)
            return kv_bytes / statistics.median(ms[(name, (b, t))]) / 1e6

        def one(name: str) -> str:
            wall, used = statistics.median(ms[(name, (b, t))]), statistics.median(cpu[(name, (b, t))])
            text = (f"{cell(ms[(name, (b, t))])}; CPU {cell(cpu[(name, (b, t))])}; {flops / wall / 1e6:.0f} GFLOP/s, "
                    f"KV {kv_rate(name):.1f} GB/s; {base / wall:.2f}x, CPU {base_cpu / used:.2f}x")
            if args.blocks and "blocks" in name:  # the CPU per call over the slot layout's, round by round
                slots = name.replace(", blocks in order", "").replace(", blocks", "").replace(", baseline", "")
                ratios = [x / y for x, y in zip(cpu[(name, (b, t))], cpu[(slots, (b, t))])]
                text += f"; CPU / {slots}'s, paired by round: {cell(ratios)}"
            return text
        rows.append(f"| {b} x {t} | " + " | ".join(one(name) for name in names) + " |")
    start, end = shape.markers(args.blocks)
    group = heads // kv_heads
    title = ("Decode attention, one layer: GroupQueryAttention against the factory's INT8-cache kernel and standard "
             "ops" + ("" if shape.name == "llama" else f" at {shape.name}'s shape"))
    if args.blocks:
        title = ("Decode attention, one layer: the INT8-cache kernel through a block table against the slot layout"
                 + ("" if shape.name == "llama" else f" at {shape.name}'s shape"))
    blocks_note = ("" if not args.blocks else
                   f" Blocks: the same kernel reading and writing through a block table of {BLOCK}-token blocks, "
                   f"each layer's cache one pool of B x {shape.max_context // BLOCK} blocks, each row's blocks a "
                   "shuffled draw from it (`in order`: row r's blocks r x n ... r x n + n - 1, as a fresh pool hands "
                   "them out: the same reads without the scatter); its last figure is its CPU per call over the same ISA's slot-layout "
                   "variant's in the same round, the median (range) of the rounds' ratios.")
    section = "\n".join([
        start, f"## {title} (benchmarks/bench_decode_attention.py --shape {shape.name}"
               f"{' --blocks' if args.blocks else ''})", "",
        run_header("benchmarks/bench_decode_attention.py", load), "",
        f"One decode step's attention in one layer of {shape.description}: {heads} query heads, {kv_heads} KV "
        f"heads, head size {head}; B rows over T cached tokens, KV buffers of the backend's slot layout "
        f"(max_context {shape.max_context}), ONNX Runtime on {THREADS} thread{'s' if THREADS > 1 else ''} "
        f"({'spinning, as served' if THREADS > 1 else 'no spinning to count'}); each variant cycles through "
        f"{shape.layers} sets of buffers, one per layer of the model, so its keys and values come from memory as in "
        "a served step. " + ("" if args.blocks else "GQA: the packaged graphs' node (rotary and the in-place cache "
                             "write included), with the float and with the INT8 cache. ") +
        "Kernel int8: the INT8-cache node rewritten to the factory's operator "
        "(`Int8KVAttention`, compiled on this host), as the backend serves it; `AVX2`: the same compiled without "
        "AVX-512 (the path of an AVX2-only CPU)" + (". " if args.blocks else
                                                    "; `baseline`: compiled from the source named by --baseline-source. "
        f"Grouped: the {group} query heads of a KV head as the rows of one batched FusedMatMul / Softmax / MatMul, "
        "over keys and values already `[B, kv_heads, T, head_size]` (token-major: a cache layout the backend does "
        "not have; no rotary, no cache write) or sliced out of the slot layout's buffers every step. ") + "Per cell: "
        f"milliseconds per call, median of {args.rounds} rounds of {CALLS} calls (range in brackets); CPU "
        "milliseconds per call (every thread of the process, ONNX Runtime's spinning included), the same way; the "
        "attention's GFLOP/s and the cached keys and values it reads per second at the median wall time; the speed "
        f"relative to {names[0]}, by wall time and by CPU time.{blocks_note}", "",
        "| B x T | " + " | ".join(names) + " |", "|---|" + "---|" * len(names), *rows, "", end])
    publish(section, HERE / "RESULTS.md", start, end, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
