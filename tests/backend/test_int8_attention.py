"""The factory's attention over an INT8 KV cache (backends/python_backend/generation/int8_attention.py and its kernel,
kernels/int8_kv_attention.cc): the same outputs and cache bytes as ONNX Runtime's GroupQueryAttention with its INT8
cache, node for node and in a whole text-generation graph; the graph rewrite and its refusals; where no compiler is,
the packaged graph runs and says why."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from model_factory.backend.generation import int8_attention as ia

needs_compiler = pytest.mark.skipif(ia.compile_problem() is not None, reason=str(ia.compile_problem()))
POSITIONS = 128


def _node_graph(heads: int, kv_heads: int, head_dim: int, rotary_dim: int, max_context: int, *, kernel: bool,
                window: int = -1, softcap: float = 0.0, interleaved: int = 0, separate: bool = False,
                isa: str = "native", block_size: int = 0):
    """A session of one attention node as the factory's graphs have it (packed QKV, or separate query, key and value
    as Qwen3's; rotary inside, INT8 cache); ``block_size``: the kernel's paged layout (a pool and a block table)."""
    import onnxruntime as ort
    from onnx import TensorProto as TP
    from onnx import helper

    kv = ["B", kv_heads, max_context, head_dim]
    if separate:
        qkv = [helper.make_tensor_value_info("qkv", TP.FLOAT, ["B", "S", heads * head_dim]),
               helper.make_tensor_value_info("k", TP.FLOAT, ["B", "S", kv_heads * head_dim]),
               helper.make_tensor_value_info("v", TP.FLOAT, ["B", "S", kv_heads * head_dim])]
    else:
        qkv = [helper.make_tensor_value_info("qkv", TP.FLOAT, ["B", "S", (heads + 2 * kv_heads) * head_dim])]
    inputs = [*qkv, helper.make_tensor_value_info("pk", TP.INT8, kv), helper.make_tensor_value_info("pv", TP.INT8, kv),
              helper.make_tensor_value_info("seqlens", TP.INT32, ["B"]),
              helper.make_tensor_value_info("total", TP.INT32, []),
              helper.make_tensor_value_info("cos", TP.FLOAT, [POSITIONS, rotary_dim // 2]),
              helper.make_tensor_value_info("sin", TP.FLOAT, [POSITIONS, rotary_dim // 2]),
              helper.make_tensor_value_info("ks", TP.FLOAT, [kv_heads * head_dim]),
              helper.make_tensor_value_info("vs", TP.FLOAT, [kv_heads * head_dim])]
    outputs = [helper.make_tensor_value_info("out", TP.FLOAT, ["B", "S", heads * head_dim]),
               helper.make_tensor_value_info("prk", TP.INT8, kv), helper.make_tensor_value_info("prv", TP.INT8, kv)]
    node = helper.make_node(
        "GroupQueryAttention", ["qkv", "k" if separate else "", "v" if separate else "", "pk", "pv", "seqlens", "total", "cos", "sin", "", "", "", "ks", "vs"],
        ["out", "prk", "prv"], name="attn", domain="com.microsoft", num_heads=heads, kv_num_heads=kv_heads,
        scale=head_dim ** -0.5, local_window_size=window, softcap=softcap, do_rotary=1, rotary_interleaved=interleaved,
        k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8)
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    if kernel:
        assert ia.rewrite(model, block_size=block_size) == 1
        opts.register_custom_ops_library(str(ia.library(isa=isa)))
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _run(session, qkv, cache, seqlens, total, cos, sin, ks, vs, heads=None, kv_heads=None, table=None):
    """One call with the caches bound in place (as the backend binds its KV slots); returns the attention output.
    With ``heads`` and ``kv_heads`` the packed ``qkv`` is handed over as separate query, key and value; with
    ``table`` the caches are the paged layout's pools and ``table`` its block table."""
    io = session.io_binding()
    if table is not None:
        io.bind_cpu_input(ia.BLOCK_TABLE, np.ascontiguousarray(table, dtype=np.int32))
    io.bind_output("out", "cpu")
    if heads is not None:
        head_dim = qkv.shape[2] // (heads + 2 * kv_heads)
        q, k, v = np.split(qkv, [heads * head_dim, (heads + kv_heads) * head_dim], axis=2)
        io.bind_cpu_input("k", np.ascontiguousarray(k))
        io.bind_cpu_input("v", np.ascontiguousarray(v))
        qkv = np.ascontiguousarray(q)
    for name, value in dict(qkv=qkv, seqlens=seqlens, total=np.array(total, np.int32), cos=cos, sin=sin, ks=ks,
                            vs=vs).items():
        io.bind_cpu_input(name, value)
    for past, present, buf in (("pk", "prk", cache[0]), ("pv", "prv", cache[1])):
        io.bind_input(past, "cpu", 0, np.int8, list(buf.shape), buf.ctypes.data)
        io.bind_output(present, "cpu", 0, np.int8, list(buf.shape), buf.ctypes.data)
    session.run_with_iobinding(io)
    return io.get_outputs()[0].numpy()


@needs_compiler
@pytest.mark.parametrize("heads, kv_heads, head_dim, rotary_dim, options", [
    (9, 3, 64, 64, {}),                       # SmolLM's attention (the specialized head size 64 path)
    (9, 3, 64, 64, {"window": 4}),            # a sliding window (local_window_size)
    (9, 3, 64, 64, {"softcap": 5.0}),         # Gemma-2's logit soft-capping
    (9, 3, 64, 32, {"interleaved": 1}),       # interleaved pairs, rotary over half the head
    (8, 2, 128, 128, {}),                     # head size 128, 4 query heads a KV head (Llama-3-8B's)
    (4, 2, 16, 16, {"window": 3}),            # any other head size: the general path
    (8, 4, 64, 64, {"separate": True}),       # separate query, key and value inputs (Qwen3's graphs)
    (4, 1, 256, 256, {"separate": True}),     # Gemma 3's attention: head size 256, 4 query heads a KV head (wide)
    (4, 1, 256, 256, {"separate": True, "window": 6}),  # ... its sliding-window layers
    (6, 2, 192, 128, {"softcap": 5.0}),       # the wide-head path at 3 query heads a KV head, partial rotary
])
def test_the_kernel_matches_onnxruntimes_attention_over_an_int8_cache(heads, kv_heads, head_dim, rotary_dim,
                                                                      options) -> None:
    """A right-padded first prompt of 4 rows, then 5 one-token decode steps, each on the same buffers: the kernel's
    outputs equal ONNX Runtime's to float rounding, and the cache bytes it writes are the same bytes."""
    _compare(heads, kv_heads, head_dim, rotary_dim, options, lengths=np.array([5, 17, 9, 1]), continuation=0)


@needs_compiler
@pytest.mark.parametrize("heads, kv_heads, head_dim, options", [
    (9, 3, 64, {}),                           # the specialized head size 64 path
    (8, 2, 128, {"window": 4}),               # head size 128
    (4, 1, 256, {"separate": True, "window": 6}),  # Gemma 3's (the wide-head path)
    (4, 2, 16, {}),                           # head size 16: the wide-head path at AVX2's 8 floats a vector
])
def test_the_kernels_avx2_path_matches_too(heads, kv_heads, head_dim, options) -> None:
    """The library compiled without AVX-512 (the path an AVX2-only CPU such as AMD's EPYC compiles) against ONNX
    Runtime's kernel, run here even where the host has AVX-512."""
    _compare(heads, kv_heads, head_dim, head_dim, options, lengths=np.array([5, 17, 9, 1]), continuation=0,
             isa="avx2")


@needs_compiler
def test_a_continued_prompt_matches_too() -> None:
    """One row: a first prompt, a 3-token continuation (its positions follow the cached ones; ONNX Runtime takes
    these one row at a time), then decode steps."""
    _compare(9, 3, 64, 64, {}, lengths=np.array([6]), continuation=3)


def _compare(heads, kv_heads, head_dim, rotary_dim, options, lengths, continuation, isa="native") -> None:
    rng = np.random.default_rng(7)
    max_context, batch = 48, len(lengths)
    angles = np.outer(np.arange(POSITIONS), 1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    ks = (rng.uniform(0.5, 1.5, kv_heads * head_dim) * 3 / 127).astype(np.float32)
    vs = (rng.uniform(0.5, 1.5, kv_heads * head_dim) * 3 / 127).astype(np.float32)
    width = (heads + 2 * kv_heads) * head_dim
    steps = [(rng.standard_normal((batch, int(lengths.max()), width)).astype(np.float32), lengths - 1,
              int(lengths.max()))]  # the first prompt: total == S
    seen = lengths + continuation
    if continuation:
        steps.append((rng.standard_normal((batch, continuation, width)).astype(np.float32), seen - 1,
                      int(seen.max())))
    for _ in range(5):
        seen = seen + 1
        steps.append((rng.standard_normal((batch, 1, width)).astype(np.float32), seen - 1, int(seen.max())))
    results = []
    for kernel in (False, True):
        session = _node_graph(heads, kv_heads, head_dim, rotary_dim, max_context, kernel=kernel, isa=isa, **options)
        cache = (np.zeros((batch, kv_heads, max_context, head_dim), np.int8),
                 np.zeros((batch, kv_heads, max_context, head_dim), np.int8))
        split = (heads, kv_heads) if options.get("separate") else (None, None)
        outs = [_run(session, qkv, cache, seqlens.astype(np.int32), total, cos, sin, ks, vs, *split)
                for qkv, seqlens, total in steps]
        results.append((outs, cache))
    (ref, ref_cache), (got, got_cache) = results
    for i, (a, b) in enumerate(zip(ref, got)):
        if i == 0:  # padding tokens of the first prompt are never read
            valid = np.arange(a.shape[1])[None, :] < lengths[:, None]
            a, b = a[valid], b[valid]
        assert np.abs(a - b).max() <= 1e-5 * max(1.0, float(np.abs(a).max())), f"call {i}"
    for r, g in zip(ref_cache, got_cache):
        for row in range(batch):
            n = int(seen[row])
            assert np.array_equal(r[row, :, :n], g[row, :, :n])


def test_a_float_cache_graph_is_left_as_packaged_with_the_reason() -> None:
    from onnx import helper

    node = helper.make_node("GroupQueryAttention", ["qkv", "", "", "pk", "pv", "s", "t", "cos", "sin"], ["o", "k", "v"],
                            name="attn", domain="com.microsoft", num_heads=4, kv_num_heads=2, do_rotary=1)
    model = helper.make_model(helper.make_graph([node], "g", [], []))
    before = model.SerializeToString()
    with pytest.raises(ia.KernelUnavailable, match="attn: k_quant_type is None, the kernel needs 'PER_CHANNEL'"):
        ia.rewrite(model)
    assert model.SerializeToString() == before
    with pytest.raises(ia.KernelUnavailable, match="no GroupQueryAttention"):
        ia.rewrite(helper.make_model(helper.make_graph([], "g", [], [])))


def test_a_node_with_position_ids_is_refused_by_name() -> None:
    from onnx import helper

    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "s", "t", "cos", "sin", "pos", "", "",
                                                    "ks", "vs"], ["o", "pk2", "pv2"], name="layer0", domain="com.microsoft",
                            num_heads=4, kv_num_heads=2, do_rotary=1, k_quant_type="PER_CHANNEL",
                            v_quant_type="PER_CHANNEL", kv_cache_bit_width=8)
    with pytest.raises(ia.KernelUnavailable, match=r"layer0: input 9 \(pos\) is not implemented by the kernel"):
        ia.rewrite(helper.make_model(helper.make_graph([node], "g", [], [])))


def test_without_a_compiler_the_reason_names_the_fix(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++, no c++
    with pytest.raises(ia.KernelUnavailable, match=r"no C\+\+ compiler on this host \(g\+\+ or \$CXX\); install g\+\+"):
        ia.library()
    monkeypatch.setenv("CXX", str(tmp_path / "missing-g++"))
    with pytest.raises(ia.KernelUnavailable, match="does not run"):
        ia.library()


def test_a_cpu_without_avx2_keeps_onnxruntimes_attention(monkeypatch) -> None:
    monkeypatch.setattr(ia, "_cpu_flags", lambda: "fpu sse sse2 ssse3 sse4_1 sse4_2")
    with pytest.raises(ia.KernelUnavailable, match="this CPU has no AVX2"):
        ia.library()


@needs_compiler
def test_the_library_is_compiled_once_per_source_and_host(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("MF_KERNEL_CACHE", str(tmp_path / "cache"))
    first = ia.library()
    assert first.is_file() and first.parent.parent == tmp_path / "cache"
    stamp = first.stat().st_mtime_ns
    assert ia.library() == first and first.stat().st_mtime_ns == stamp  # cached, not rebuilt
    shutil.copytree(ia.SOURCE.parent, tmp_path / "kernels")
    changed = tmp_path / "kernels" / ia.SOURCE.name
    changed.write_text(ia.SOURCE.read_text() + "\n// another source\n")
    assert ia.library(changed).parent != first.parent
    assert ia.library(isa="avx2").parent != first.parent  # the AVX2 path: other flags, another library
    with pytest.raises(ValueError, match="isa must be one of"):
        ia.library(isa="sse2")
    assert [p.name for p in first.parent.iterdir()] == [ia.LIBRARY_NAME]  # no partial build left behind
    first.parent.chmod(0o777)  # a folder others may write to: its library is not loaded
    with pytest.raises(ia.KernelUnavailable, match="is writable by group or others .*Fix: chmod go-w"):
        ia.library()
    first.parent.chmod(0o700)
    first.chmod(0o666)
    with pytest.raises(ia.KernelUnavailable, match=f"{ia.LIBRARY_NAME} is writable by group or others"):
        ia.library()


@needs_compiler
def test_a_source_that_does_not_compile_is_refused_with_the_compilers_words(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("MF_KERNEL_CACHE", str(tmp_path / "cache"))
    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++\n")
    with pytest.raises(ia.KernelUnavailable, match="failed to compile broken.cc"):
        ia.library(broken)
    assert not any(p.suffix == ".so" for p in (tmp_path / "cache").rglob("*"))


def decode_logits(model, prompts: list, views: dict, steps: int = 6) -> list:
    """``prompts`` prefilled together on ``views``, then ``steps`` batched greedy decode steps: each launch's logits."""
    logits = [model.prefill(prompts, views)]
    lengths = [len(p) for p in prompts]
    for _ in range(steps):
        tokens = [int(t) for t in logits[-1].argmax(-1)]
        logits.append(model.decode(tokens, lengths, views))
        lengths = [n + 1 for n in lengths]
    return logits


def _views(batch: int, layers: int = 2, kv_heads: int = 2, max_context: int = 64, head_dim: int = 16,
           dtype=np.int8):
    return {f"past_key_values.{i}.{kind}": np.zeros((batch, kv_heads, max_context, head_dim), dtype)
            for i in range(layers) for kind in ("key", "value")}


@needs_compiler
def test_a_text_generation_graph_decodes_the_same_on_the_kernel(tiny_llm_int8_cache) -> None:
    """Three prompts of mixed lengths prefilled together, then 6 batched decode steps: the logits of the graph on
    the kernel equal those of the packaged graph within float rounding, every greedy token the same."""
    from model_factory.backend.generation.causal_lm import CausalLM

    packaged = CausalLM(tiny_llm_int8_cache, threads=2, int8_attention="onnxruntime")
    kernel = CausalLM(tiny_llm_int8_cache, threads=2, int8_attention="kernel")
    assert packaged.attention == "onnxruntime GroupQueryAttention"
    assert kernel.attention.startswith("model-factory Int8KVAttention (2 nodes")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 2000, n).tolist() for n in (7, 23, 2)]
    runs = [decode_logits(model, prompts, _views(len(prompts))) for model in (packaged, kernel)]
    for a, b in zip(*runs):
        assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max()
        assert np.array_equal(a.argmax(-1), b.argmax(-1))


def test_auto_falls_back_to_the_packaged_graph_and_kernel_refuses_where_none_builds(tiny_llm_int8_cache, monkeypatch,
                                                                                  tmp_path) -> None:
    from model_factory.backend.generation.causal_lm import CausalLM
    from model_factory.backend.engines.base import EngineError

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("MF_KERNEL_CACHE", str(tmp_path / "cache"))  # nothing compiled earlier to reuse
    auto = CausalLM(tiny_llm_int8_cache, threads=1, int8_attention="auto")
    assert auto.attention.startswith("onnxruntime GroupQueryAttention (the INT8-cache kernel is not used: no C++ "
                                     "compiler on this host")
    assert auto.prefill([[5, 6, 7]], _views(1)).shape[0] == 1  # the packaged graph runs
    with pytest.raises(EngineError, match=r'int8_attention = "kernel" but the kernel cannot be used: no C\+\+ compiler'):
        CausalLM(tiny_llm_int8_cache, threads=1, int8_attention="kernel")


@needs_compiler
def test_auto_keeps_the_packaged_graph_when_onnxruntime_refuses_the_library_or_the_session(tiny_llm_int8_cache,
                                                                                           monkeypatch, tmp_path) -> None:
    """A library ONNX Runtime will not load, or a session on the rewritten graph that fails: ``auto`` serves the
    packaged graph and says why; ``kernel`` fails the load naming the fix."""
    from model_factory.backend.generation.causal_lm import CausalLM
    from model_factory.backend.engines.base import EngineError

    junk = tmp_path / ia.LIBRARY_NAME
    junk.write_bytes(b"not a shared library")
    monkeypatch.setattr(ia, "library", lambda *a, **k: junk)
    auto = CausalLM(tiny_llm_int8_cache, threads=1, int8_attention="auto")
    assert auto.attention.startswith("onnxruntime GroupQueryAttention (the INT8-cache kernel is not used:")
    assert auto.prefill([[5, 6, 7]], _views(1)).shape[0] == 1
    with pytest.raises(EngineError, match="does not load .*Fix: delete that file"):
        CausalLM(tiny_llm_int8_cache, threads=1, int8_attention="kernel")
    monkeypatch.undo()
    real = ia.library()
    monkeypatch.setattr(ia, "prepare", lambda source, block_size=0: ia.Prepared(b"not a graph", real, 2))
    auto = CausalLM(tiny_llm_int8_cache, threads=1, int8_attention="auto")
    assert "a session on it failed" in auto.attention
    assert auto.prefill([[5, 6, 7]], _views(1)).shape[0] == 1


# The paged layout: the kernel reading and writing through a block table, against its own contiguous layout (itself
# checked against ONNX Runtime's kernel above).
def _rope(rotary_dim: int) -> tuple[np.ndarray, np.ndarray]:
    angles = np.outer(np.arange(POSITIONS), 1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _gathered(pool: np.ndarray, table: np.ndarray, row: int, tokens: int) -> np.ndarray:
    """Row ``row``'s first ``tokens`` cached tokens read out of a pool through its table: ``[kv_heads, tokens,
    head_dim]``, the contiguous layout's row."""
    blocks = [pool[int(b)] for b in table[row]]  # each [kv_heads, block_size, head_dim]
    return np.concatenate(blocks, axis=1)[:, :tokens]


def _assert_close(a: np.ndarray, b: np.ndarray, what: str) -> None:
    assert np.abs(a - b).max() <= 1e-6 * max(1.0, float(np.abs(a).max())), what


@needs_compiler
@pytest.mark.parametrize("heads, kv_heads, head_dim, options, block_size, isa", [
    (9, 3, 64, {}, 16, "native"),                               # head 64, 3 query heads a KV head
    (9, 3, 64, {"window": 6}, 16, "native"),                     # a sliding window starting mid-block
    (8, 2, 128, {}, 16, "native"),                               # head 128, 4 a KV head
    (4, 1, 256, {"separate": True}, 16, "native"),               # Gemma 3's (the wide-head path)
    (4, 1, 256, {"separate": True, "window": 11}, 16, "native"),  # ... its sliding-window layers
    (6, 2, 192, {"softcap": 5.0}, 16, "native"),                 # the wide-head path at 3 a KV head
    (4, 2, 16, {"window": 3}, 4, "native"),                      # the general path, blocks of 4
    (9, 3, 64, {"window": 6}, 16, "avx2"),                       # the AVX2 build
    (8, 2, 128, {}, 16, "avx2"),
    (4, 1, 256, {"separate": True, "window": 11}, 16, "avx2"),
    (4, 1, 256, {"separate": True}, 4, "avx2"),                   # blocks shorter than the wide path's rows a step
    (9, 3, 64, {"window": 6, "in_order": True}, 16, "native"),    # each row's blocks in order: read as one run
    (4, 1, 256, {"separate": True, "in_order": True}, 16, "avx2"),
])
def test_the_kernel_through_a_block_table_matches_its_contiguous_layout(heads, kv_heads, head_dim, options,
                                                                       block_size, isa) -> None:
    """Each row's blocks scattered over a shuffled pool whose other blocks hold junk (``in_order``: row r's blocks
    consecutive, which the kernel reads as one run): a right-padded first prompt, a continued prompt of 3 tokens, then
    5 decode steps give the contiguous layout's outputs, and each row's cache read back through its table holds the
    contiguous layout's bytes."""
    options = dict(options)
    in_order = options.pop("in_order", False)
    rng = np.random.default_rng(11)
    max_context, lengths, continuation = 64, np.array([5, 37, 20, 1]), 3
    batch, max_blocks = len(lengths), 64 // block_size
    cos, sin = _rope(head_dim)
    ks = (rng.uniform(0.5, 1.5, kv_heads * head_dim) * 3 / 127).astype(np.float32)
    vs = (rng.uniform(0.5, 1.5, kv_heads * head_dim) * 3 / 127).astype(np.float32)
    width = (heads + 2 * kv_heads) * head_dim
    steps = [(rng.standard_normal((batch, int(lengths.max()), width)).astype(np.float32), lengths - 1,
              int(lengths.max()))]
    seen = lengths + continuation
    steps.append((rng.standard_normal((batch, continuation, width)).astype(np.float32), seen - 1, int(seen.max())))
    for _ in range(5):
        seen = seen + 1
        steps.append((rng.standard_normal((batch, 1, width)).astype(np.float32), seen - 1, int(seen.max())))
    split = (heads, kv_heads) if options.get("separate") else (None, None)
    # The contiguous layout.
    flat = _node_graph(heads, kv_heads, head_dim, head_dim, max_context, kernel=True, isa=isa, **options)
    cache = (np.zeros((batch, kv_heads, max_context, head_dim), np.int8),
             np.zeros((batch, kv_heads, max_context, head_dim), np.int8))
    ref = [_run(flat, qkv, cache, lens.astype(np.int32), total, cos, sin, ks, vs, *split) for qkv, lens, total in steps]
    # The paged layout: a pool of junk with 5 spare blocks, each row's blocks a shuffled draw from it.
    paged = _node_graph(heads, kv_heads, head_dim, head_dim, max_context, kernel=True, isa=isa, block_size=block_size,
                        **options)
    num_blocks = batch * max_blocks + 5
    pools = tuple(rng.integers(-128, 128, (num_blocks, kv_heads, block_size, head_dim), dtype=np.int8)
                  for _ in range(2))
    order = np.arange(5, num_blocks) if in_order else rng.permutation(num_blocks)[:batch * max_blocks]
    table = order.reshape(batch, max_blocks).astype(np.int32)
    got = [_run(paged, qkv, pools, lens.astype(np.int32), total, cos, sin, ks, vs, *split, table=table)
           for qkv, lens, total in steps]
    for i, (a, b) in enumerate(zip(ref, got)):
        if i == 0:  # padding tokens of the first prompt are never read
            valid = np.arange(a.shape[1])[None, :] < lengths[:, None]
            a, b = a[valid], b[valid]
        _assert_close(a, b, f"call {i}")
    for flat_cache, pool in zip(cache, pools):
        for row in range(batch):
            n = int(seen[row])
            assert np.array_equal(flat_cache[row, :, :n], _gathered(pool, table, row, n)), f"row {row}"


@needs_compiler
@pytest.mark.parametrize("heads, kv_heads, head_dim, options, isa", [
    (9, 3, 64, {}, "native"),
    (8, 2, 128, {"window": 20}, "native"),
    (4, 1, 256, {"separate": True}, "native"),
    (4, 1, 256, {"separate": True, "window": 20}, "avx2"),
    (9, 3, 64, {}, "avx2"),
])
def test_two_rows_read_one_prefix_from_the_same_blocks(heads, kv_heads, head_dim, options, isa) -> None:
    """Row 1's prompt starts with row 0's first 32 tokens. Contiguous: both prompts prefilled whole, each row its own
    copy. Paged: row 0 prefilled, then row 1's table names row 0's two prefix blocks and only its own tokens are
    prefilled (a continued prompt, as a prefix-cache hit); then both decode. The outputs are the contiguous ones, and
    the shared blocks are not written after row 0's prompt."""
    rng = np.random.default_rng(5)
    block, prefix, max_context = 16, 32, 64
    lengths = np.array([40, 45])
    cos, sin = _rope(head_dim)
    ks = (rng.uniform(0.5, 1.5, kv_heads * head_dim) * 3 / 127).astype(np.float32)
    vs = (rng.uniform(0.5, 1.5, kv_heads * head_dim) * 3 / 127).astype(np.float32)
    width = (heads + 2 * kv_heads) * head_dim
    split = (heads, kv_heads) if options.get("separate") else (None, None)
    prompts = rng.standard_normal((2, int(lengths.max()), width)).astype(np.float32)
    prompts[1, :prefix] = prompts[0, :prefix]
    decodes = [rng.standard_normal((2, 1, width)).astype(np.float32) for _ in range(4)]

    flat = _node_graph(heads, kv_heads, head_dim, head_dim, max_context, kernel=True, isa=isa, **options)
    cache = tuple(np.zeros((2, kv_heads, max_context, head_dim), np.int8) for _ in range(2))
    ref_prompt = _run(flat, prompts, cache, (lengths - 1).astype(np.int32), int(lengths.max()), cos, sin, ks, vs,
                      *split)
    ref_decode = []
    for i, qkv in enumerate(decodes):
        seen = lengths + i + 1
        ref_decode.append(_run(flat, qkv, cache, (seen - 1).astype(np.int32), int(seen.max()), cos, sin, ks, vs,
                               *split))

    paged = _node_graph(heads, kv_heads, head_dim, head_dim, max_context, kernel=True, isa=isa, block_size=block,
                        **options)
    pools = tuple(rng.integers(-128, 128, (12, kv_heads, block, head_dim), dtype=np.int8) for _ in range(2))
    table = np.array([[7, 2, 9, 0], [7, 2, 4, 11]], np.int32)  # blocks 7 and 2: the shared prefix
    first = _run(paged, np.ascontiguousarray(prompts[:1, :lengths[0]]), pools, np.array([lengths[0] - 1], np.int32),
                 int(lengths[0]), cos, sin, ks, vs, *split, table=table[:1])
    shared = [pool[[7, 2]].copy() for pool in pools]
    second = _run(paged, np.ascontiguousarray(prompts[1:, prefix:lengths[1]]), pools,
                  np.array([lengths[1] - 1], np.int32), int(lengths[1]), cos, sin, ks, vs, *split, table=table[1:])
    _assert_close(ref_prompt[0, :lengths[0]], first[0], "row 0's prompt")
    _assert_close(ref_prompt[1, prefix:lengths[1]], second[0], "row 1's own tokens after the shared prefix")
    for i, qkv in enumerate(decodes):
        seen = lengths + i + 1
        out = _run(paged, qkv, pools, (seen - 1).astype(np.int32), int(seen.max()), cos, sin, ks, vs, *split,
                   table=table)
        _assert_close(ref_decode[i], out, f"decode step {i}")
    for pool, before, flat_cache in zip(pools, shared, cache):
        assert np.array_equal(pool[[7, 2]], before)
        for row in range(2):
            n = int(lengths[row]) + len(decodes)
            assert np.array_equal(flat_cache[row, :, :n], _gathered(pool, table, row, n))


@needs_compiler
def test_a_block_table_naming_a_block_outside_the_pool_is_refused() -> None:
    session = _node_graph(9, 3, 64, 64, 64, kernel=True, block_size=16)
    cos, sin = _rope(64)
    pools = tuple(np.zeros((4, 3, 16, 64), np.int8) for _ in range(2))
    scale = np.full(3 * 64, 0.02, np.float32)
    qkv = np.zeros((1, 1, 15 * 64), np.float32)
    with pytest.raises(Exception, match=r"block_table\[0\]\[1\] = 4 is not a block of the pool \(4 blocks\)"):
        _run(session, qkv, pools, np.array([20], np.int32), 21, cos, sin, scale, scale, table=np.array([[0, 4, 1, 2]]))
    with pytest.raises(Exception, match="a token's position is past the cache"):  # 2 blocks of 16 hold 32 tokens
        _run(session, qkv, pools, np.array([40], np.int32), 41, cos, sin, scale, scale, table=np.array([[0, 1]]))
