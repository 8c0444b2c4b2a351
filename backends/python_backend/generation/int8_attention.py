"""Attention over an INT8 KV cache nearer memory speed: the factory's custom operator for ONNX Runtime's CPU provider.

A text-generation graph with ``quantization.kv_cache = "int8"`` keeps its cache in ``com.microsoft.GroupQueryAttention``
with per-channel INT8 scales. ONNX Runtime's CPU kernel for it reads that cache at 2-3 GB/s (compute-bound), slower
than its float cache; at 32 streams attention is about half of a decode step (docs/generation.md). The operator in
``kernels/int8_kv_attention.cc`` computes the same attention (the same inputs, attributes and in-place cache write;
checked against ONNX Runtime's kernel in ``tests/backend/test_int8_attention.py``) reading each cached row once per KV
head.

The packaged graph keeps the standard node (it is what was gated, signed, and what any ONNX Runtime runs). At load,
on a CPU instance, :func:`prepare` rewrites its attention nodes to the factory's operator in memory and names the
library for the session; the library is compiled on this host (``g++ -O3 -march=native``: the host's own vector
instructions, AVX2 or AVX-512) from the source shipped, signed, in the version folder, and kept in a cache keyed by
the source, the flags, the compiler and the CPU. Where it cannot be used (a CPU without AVX2, no compiler, no
``onnx`` to edit the graph, a node with features it lacks, ``int8_attention = "onnxruntime"``) the graph runs as
packaged and the reason is logged (``int8_attention = "kernel"``: the load fails with it instead).

The operator also reads and writes its cache through a block table (``rewrite(model, block_size=16)``): each layer's
past key and value are then one pool of blocks ``[num_blocks, kv_heads, block_size, head_dim]`` shared by the rows,
and the graph takes :data:`BLOCK_TABLE` (int32 ``[batch, max_blocks]``, one row of block ids per sequence, the same
ids in every layer's pool), so two sequences holding the same prefix can name the same blocks.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).resolve().parent / "kernels" / "int8_kv_attention.cc"
DOMAIN = "ai.model_factory"
OP_TYPE = "Int8KVAttention"
LIBRARY_NAME = "libmf_int8_kv_attention.so"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-fPIC", "-shared",
         "-fvisibility=hidden", "-Wno-psabi")
COMPILE_TIMEOUT_S = 120
# The instruction sets a library may be compiled for: the host's own (what serving uses), or AVX2 without AVX-512 and
# AMX (the kernel's path on an AVX2-only CPU such as AMD's EPYC up to Zen 3, which a test and bench_decode_attention
# force on an AVX-512 host to run and time it there too).
ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")}
GQA = "GroupQueryAttention"
# The standard node's inputs the operator takes, in its order (the query, or query, key and value packed; the key
# and value when separate; past key and value; seqlens_k; total_sequence_length; cos and sin caches; k_scale and
# v_scale). Inputs 9 (position_ids), 10 (attention_bias) and 11 (head_sink) must be absent.
_KEPT_INPUTS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 13)
_OPTIONAL_INPUTS = (1, 2)  # both or neither
_ABSENT_INPUTS = (9, 10, 11)
_KEPT_ATTRIBUTES = ("num_heads", "kv_num_heads", "scale", "softcap", "local_window_size", "rotary_interleaved")
_REQUIRED = {"k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL", "kv_cache_bit_width": 8, "do_rotary": 1}
_DEFAULT_ZERO = ("smooth_softmax", "qk_output")
# The paged layout's graph input (the operator's input 11) and its pools' symbolic dimensions.
BLOCK_TABLE = "block_table"
MAX_BLOCKS_DIM = "max_blocks"
NUM_BLOCKS_DIM = "num_blocks"


class KernelUnavailable(RuntimeError):
    """The operator cannot be used here; the message says why (the graph then runs as packaged)."""


@dataclass(frozen=True)
class Prepared:
    """A graph rewritten to the factory's operator: its bytes, the library to register, and (for a graph whose
    weights are external) the folder ONNX Runtime reads them from."""

    model: bytes
    library: Path
    nodes: int
    weights_folder: Path | None = None


def cache_dir() -> Path:
    """Where compiled libraries are kept: ``$MF_KERNEL_CACHE``, else ``$XDG_CACHE_HOME`` (``~/.cache``)/model-factory."""
    explicit = os.environ.get("MF_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "model-factory" / "kernels"


def _cpu_flags() -> str:
    """The first CPU's instruction-set flags (``-march=native`` compiles for them)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def compiler() -> str:
    """The C++ compiler: ``$CXX``, else ``g++``, else ``c++``; :class:`KernelUnavailable` naming the fix if none."""
    found = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not found:
        raise KernelUnavailable("no C++ compiler on this host (g++ or $CXX); install g++ (Debian: apt-get install "
                                "g++) for the INT8-cache attention kernel")
    return found


def compile_problem() -> str | None:
    """Why the factory's kernels cannot be compiled on this host, else None: a CPU without AVX2 (their plain C path runs
    slower than what they replace), or no C++ compiler found (whether it runs, :func:`library` finds out)."""
    if "avx2" not in _cpu_flags().split():
        return ("this CPU has no AVX2: the kernel's plain C path runs slower than ONNX Runtime's attention, so ONNX "
                "Runtime's is kept")
    try:
        compiler()
    except KernelUnavailable as e:
        return str(e)
    return None


def library(source: Path = SOURCE, isa: str = "native", name: str = LIBRARY_NAME) -> Path:
    """The compiled operator library for this host, compiled on first use (a few seconds) and cached. ``isa``
    "avx2" compiles the AVX2 path on a host that has AVX-512 too (:data:`ISA_FLAGS`). ``source`` and ``name``: another
    of the factory's kernels (``int8_matmul``) built by the same rules."""
    source = Path(source)
    if isa not in ISA_FLAGS:
        raise ValueError(f"isa must be one of {sorted(ISA_FLAGS)}, not {isa!r}")
    flags = (*FLAGS, *ISA_FLAGS[isa])
    problem = compile_problem()
    if problem:
        raise KernelUnavailable(problem)
    if not source.is_file():
        raise KernelUnavailable(f"the kernel source {source} is missing (a backend copied without kernels/)")
    cxx = compiler()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"the C++ compiler {cxx} does not run: {e}") from e
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # ort_abi.h, included beside it
    key = hashlib.sha256("\0".join([source.read_text(), *headers, " ".join(flags), cxx, version,
                                     _cpu_flags()]).encode())
    folder = cache_dir() / key.hexdigest()[:24]
    built = folder / name
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise KernelUnavailable(f"the kernel cache {folder} cannot be created ({e}); set MF_KERNEL_CACHE to a "
                                "writable folder") from e
    _check_private(folder)
    if built.is_file():
        _check_private(built)
        return built
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([cxx, *flags, "-o", tmp, str(source)], capture_output=True, text=True,
                              timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            raise KernelUnavailable(f"{cxx} failed to compile {source.name} (exit {done.returncode}): "
                                    f"{done.stderr.strip()[-600:]}")
        os.replace(tmp, built)  # atomic: a concurrent instance compiles the same bytes and one rename wins
    except subprocess.TimeoutExpired as e:
        raise KernelUnavailable(f"{cxx} took over {COMPILE_TIMEOUT_S} s to compile {source.name}") from e
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return built


def _check_private(path: Path) -> None:
    """A cached library is loaded into the server: only this user may have written it or its folder (as ssh
    treats its keys); :class:`KernelUnavailable` naming the fix otherwise."""
    st = path.stat()
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise KernelUnavailable(f"{path} belongs to another user (uid {st.st_uid}): a library loaded into the server "
                                "must be this user's own. Fix: set MF_KERNEL_CACHE to a folder of this user's")
    if st.st_mode & 0o022:
        raise KernelUnavailable(f"{path} is writable by group or others (mode {st.st_mode & 0o777:o}): a library "
                                f"loaded into the server must be this user's alone. Fix: chmod go-w {path}")


def _attribute_values(node: Any) -> dict[str, Any]:
    from onnx import helper

    values = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        values[a.name] = v.decode() if isinstance(v, bytes) else v
    return values


def unsupported(node: Any) -> str | None:
    """Why the operator cannot stand in for this ``GroupQueryAttention`` node, else None."""
    attrs = _attribute_values(node)
    for name, want in _REQUIRED.items():
        if attrs.get(name) != want:
            return f"{node.name}: {name} is {attrs.get(name)!r}, the kernel needs {want!r}"
    for name in _DEFAULT_ZERO:
        if attrs.get(name, 0):
            return f"{node.name}: {name} = {attrs[name]} is not implemented by the kernel"
    inputs = list(node.input) + [""] * (14 - len(node.input))
    if len(inputs) > 14 and any(inputs[14:]):
        return f"{node.name}: inputs past k_scale / v_scale are not implemented by the kernel"
    for i in _ABSENT_INPUTS:
        if inputs[i]:
            return f"{node.name}: input {i} ({inputs[i]}) is not implemented by the kernel"
    for i in _KEPT_INPUTS:
        if not inputs[i] and i not in _OPTIONAL_INPUTS:
            return f"{node.name}: input {i} is absent"
    if bool(inputs[1]) != bool(inputs[2]):
        return f"{node.name}: one of key and value is given without the other"
    if len(node.output) > 3 and any(node.output[3:]):
        return f"{node.name}: its attention-scores output is not implemented by the kernel"
    return None


def rewrite(model: Any, block_size: int = 0) -> int:
    """Replace every ``GroupQueryAttention`` node of ``model`` (an ``onnx.ModelProto``, edited in place) by the
    factory's operator; returns how many. :class:`KernelUnavailable` (and ``model`` untouched) if any cannot be.
    ``block_size`` > 0: the paged layout (module docstring): every node reads :data:`BLOCK_TABLE`, added as a graph
    input, and the graph's past inputs and present outputs are declared as pools ``[num_blocks, kv_heads,
    block_size, head_dim]``."""
    from onnx import helper

    nodes = [n for n in model.graph.node if n.op_type == GQA and n.domain == "com.microsoft"]
    if not nodes:
        raise KernelUnavailable("the graph has no GroupQueryAttention node")
    for node in nodes:
        why = unsupported(node)
        if why:
            raise KernelUnavailable(why)
    block_size = int(block_size)
    if block_size < 0:
        raise ValueError(f"block_size must be 0 (slots) or positive, not {block_size}")
    for node in nodes:
        attrs = _attribute_values(node)
        inputs = list(node.input) + [""] * (14 - len(node.input))
        kept = {k: attrs[k] for k in _KEPT_ATTRIBUTES if k in attrs}
        paged = [BLOCK_TABLE] if block_size else []
        if block_size:
            kept["block_size"] = block_size
        replacement = helper.make_node(OP_TYPE, [inputs[i] for i in _KEPT_INPUTS] + paged, list(node.output[:3]),
                                       name=node.name, domain=DOMAIN, **kept)
        node.CopyFrom(replacement)
    if block_size:
        _declare_pools(model, nodes, block_size)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return len(nodes)


def _declare_pools(model: Any, nodes: list, block_size: int) -> None:
    """The paged graph's interface: :data:`BLOCK_TABLE` as an input (its batch dimension the past's), and each
    node's past inputs and present outputs that the graph exposes as pools ``[num_blocks, kv_heads, block_size,
    head_dim]`` (kv_heads and head_dim as declared before)."""
    from onnx import TensorProto, helper

    graph = model.graph
    inputs = {i.name: i for i in graph.input}
    outputs = {o.name: o for o in graph.output}
    batch: Any = "batch_size"
    for node in nodes:
        for name, where in ((node.input[3], inputs), (node.input[4], inputs), (node.output[1], outputs),
                            (node.output[2], outputs)):
            value = where.get(name)
            if value is None:
                continue
            dims = value.type.tensor_type.shape.dim
            if len(dims) != 4:
                raise KernelUnavailable(f"{name} is declared with {len(dims)} dimensions, not [batch, kv_heads, "
                                        "max_context, head_dim]")
            if where is inputs and dims[0].dim_param:
                batch = dims[0].dim_param
            dims[0].Clear()
            dims[0].dim_param = NUM_BLOCKS_DIM
            dims[2].Clear()
            dims[2].dim_value = block_size
    if BLOCK_TABLE not in inputs:
        graph.input.append(helper.make_tensor_value_info(BLOCK_TABLE, TensorProto.INT32, [batch, MAX_BLOCKS_DIM]))


def prepare(source: Path | bytes, block_size: int = 0) -> Prepared:
    """``source`` (the graph's bytes, or its path when its weights are external) rewritten to the operator, with the
    library compiled for this host; ``block_size`` > 0: the paged layout (:func:`rewrite`). :class:`KernelUnavailable`
    says why not."""
    try:
        import onnx
    except ImportError as e:
        raise KernelUnavailable("the onnx package is not installed (pip install 'model-factory[serve]')") from e
    lib = library()
    if isinstance(source, (bytes, bytearray)):
        model = onnx.load_from_string(bytes(source))
        folder = None
    else:
        model = onnx.load(str(source), load_external_data=False)
        folder = Path(source).resolve().parent
    count = rewrite(model, block_size)
    return Prepared(model.SerializeToString(), lib, count, folder)


def register(prepared: Prepared, options: Any) -> None:
    """Make ONNX Runtime session ``options`` run ``prepared``: its library registered, and the folder of its external
    weights named. :class:`KernelUnavailable` where ONNX Runtime will not load the library."""
    try:
        options.register_custom_ops_library(str(prepared.library))
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own types: a library it will not load
        raise KernelUnavailable(f"ONNX Runtime does not load {prepared.library}: {e}. Fix: delete that file (it is "
                                "rebuilt)") from e
    if prepared.weights_folder is not None:
        options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                         str(prepared.weights_folder))
