"""Build-engine stage: strongly typed TensorRT plans from the FP32/FP16/INT8 ONNX models.

This is the only module that imports ``tensorrt`` or ``tensorrt_rtx``, and only
inside functions. Datacenter TensorRT is preferred when installed; otherwise
TensorRT-RTX, whose builder compiles engines on a machine without a GPU (ahead
of time). Precision is never a builder flag: it comes from the ONNX graph
(FP16 casts, INT8 Q/DQ nodes) and the network is strongly typed.

One optimization profile per sequence bucket of the recipe: bucket ``i`` covers
batch ``1..max_batch`` and sequence lengths ``bucket[i-1]+1..bucket[i]``.

Every plan gets a metadata JSON beside it (flavour and version, the device it
was built on or "none (ahead-of-time build)", profiles, the input ONNX digest,
build time, precision). The timing cache is loaded before and saved (atomically)
after every build; TensorRT-RTX accepts the calls but ignores the cache (it
tunes at run time), which the metadata records.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import json
import shutil
import subprocess
import time
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from model_factory.backend.contract import plan_file
from model_factory.build_engines.export import check_onnx_file
from model_factory.build_engines.onnx_files import data_file
from model_factory.fileio import digest_path
from model_factory.errors import FactoryError
from model_factory.fileio import atomic_dir, atomic_file
from model_factory.progress import heartbeat
from model_factory.recipe import PRECISIONS, Recipe

FLAVOURS = ("tensorrt", "tensorrt_rtx")
INSTALL_HINT = ("install TensorRT-RTX with: pip install 'model-factory[tensorrt-rtx]' (it builds engines on a CPU-only "
                "machine), or run inside the NVIDIA TensorRT container (nvcr.io/nvidia/tensorrt), which ships tensorrt")
NO_GPU = "none (ahead-of-time build)"
# TensorRT-RTX's default targets when no compute capability is set (NVIDIA's CPU-only AOT documentation).
RTX_DEFAULT_TARGETS = "default: compute capability 8.0, 8.6, 8.9, 12.0 and later"


@dataclass(frozen=True)
class EngineResult:
    """One serialized engine and its metadata file."""

    precision: str
    plan_path: Path
    metadata_path: Path
    build_seconds: float
    size_bytes: int


@dataclass(frozen=True)
class Device:
    """The GPU visible at build time."""

    name: str
    compute_capability: str


# --------------------------------------------------------------------------- import


@lru_cache(maxsize=1)
def _load() -> tuple[Any, str] | None:
    for name in FLAVOURS:
        try:
            return importlib.import_module(name), name
        except (ImportError, OSError):  # OSError: the wheel is there but its shared libraries are not
            continue
    return None


def tensorrt_available() -> str | None:
    """The flavour that would build engines (``"tensorrt"`` or ``"tensorrt_rtx"``), or None."""
    loaded = _load()
    return loaded[1] if loaded else None


def _trt() -> tuple[Any, str]:
    loaded = _load()
    if loaded is None:
        raise FactoryError(f"building TensorRT engines needs tensorrt or tensorrt_rtx and neither imports. Fix: "
                           f"{INSTALL_HINT}; or set tensorrt.enabled = false in the recipe")
    return loaded


def _version(trt: Any) -> str:
    return str(getattr(trt, "__version__", "unknown"))


def _make_logger(trt: Any) -> Any:
    class _Logger(trt.ILogger):
        """Keeps warnings and errors so a failed build can say why."""

        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.messages: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            if int(severity) <= int(trt.ILogger.Severity.WARNING):
                self.messages.append(f"[{getattr(severity, 'name', severity)}] {msg}")

    return _Logger()


# --------------------------------------------------------------------------- device


def visible_device() -> Device | None:
    """The first GPU, via cuda-bindings when installed, else nvidia-smi; None on a CPU-only machine."""
    try:
        from cuda.bindings import runtime as cudart  # optional: model-factory[gpu]

        err, count = cudart.cudaGetDeviceCount()
        if int(err) == 0 and count > 0:
            err, props = cudart.cudaGetDeviceProperties(0)
            if int(err) == 0:
                name = props.name.decode(errors="replace").rstrip("\0") if isinstance(props.name, bytes) else str(props.name)
                return Device(name, f"{props.major}.{props.minor}")
        return None
    except ImportError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=name,compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    if "," not in line:
        return None
    name, cc = (s.strip() for s in line.rsplit(",", 1))
    return Device(name, cc)


# --------------------------------------------------------------------------- profiles


def profile_shapes(recipe: Recipe, input_dims: Mapping[str, tuple[int, ...]]) -> list[dict[str, Any]]:
    """One profile per sequence bucket: ``{"bucket", "inputs": {name: {"min", "opt", "max"}}}``.

    Axis 0 of an input, when dynamic, is the batch (1..max_batch, opt = the largest preferred batch size);
    any other dynamic axis is the sequence (previous bucket + 1 .. bucket, opt = bucket). Static axes stay.
    A model whose inputs are fixed apart from the batch (an image CNN) gets one profile: more would be
    identical copies.
    """
    shapes = recipe.shapes
    preferred = [b for b in recipe.batching.preferred_batch_sizes if b <= shapes.max_batch]
    opt_batch = max(preferred) if preferred else shapes.max_batch
    profiles = []
    prev = 0
    for bucket in shapes.sequence_buckets:
        per_input = {}
        for name, dims in input_dims.items():
            lo, opt, hi = [], [], []
            for axis, d in enumerate(dims):
                if d >= 0:
                    low, mid, high = d, d, d
                elif axis == 0:
                    low, mid, high = 1, opt_batch, shapes.max_batch
                else:
                    low, mid, high = prev + 1, bucket, bucket
                lo.append(low)
                opt.append(mid)
                hi.append(high)
            per_input[name] = {"min": lo, "opt": opt, "max": hi}
        profiles.append({"bucket": bucket, "sequence": [prev + 1, bucket], "inputs": per_input})
        prev = bucket
    if not any(d < 0 for dims in input_dims.values() for d in dims[1:]):
        return profiles[:1]
    return profiles


# --------------------------------------------------------------------------- build


def _parse(trt: Any, flavour: str, builder: Any, logger: Any, onnx_path: Path) -> tuple[Any, Any, bool]:
    flags = 0
    strongly_typed = hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED")
    if strongly_typed:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    elif hasattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH"):  # TensorRT 8.x
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)  # the network must outlive the parser: both are returned
    if not parser.parse_from_file(str(onnx_path)):
        problems = []
        for i in range(parser.num_errors):
            e = parser.get_error(i)
            where = f"node {e.node_name()!r} ({e.node_operator()})" if e.node() >= 0 and e.node_name() else "graph"
            problems.append(f"{where}: {e.desc()}")
        detail = "; ".join(problems[:5]) or "no detail from the parser"
        raise FactoryError(f"{flavour} {_version(trt)} cannot parse {onnx_path}: {detail}. Fix: this node is not "
                           "supported by this TensorRT version; re-export with another opset, replace the op, or "
                           "drop this precision")
    return network, parser, strongly_typed


def _apply_compat(trt: Any, flavour: str, config: Any, recipe: Recipe, device: Device | None) -> str:
    """Hardware compatibility as the flavour understands it; returns what was applied (for the metadata)."""
    level = recipe.tensorrt.hardware_compatibility
    if flavour == "tensorrt_rtx":
        if level == "same_compute_capability":
            if device is None:
                raise FactoryError("tensorrt.hardware_compatibility = \"same_compute_capability\" needs a GPU at "
                                   "build time with TensorRT-RTX, and none is visible. Fix: use \"none\" (portable to "
                                   "Ampere and later) or build on the target GPU")
            config.num_compute_capabilities = 1
            config.set_compute_capability(trt.ComputeCapability.CURRENT, 0)
            return f"compute capability {device.compute_capability} only"
        return RTX_DEFAULT_TARGETS
    if level != "none":
        config.hardware_compatibility_level = getattr(trt.HardwareCompatibilityLevel, level.upper())
    return level


def _load_cache(trt: Any, config: Any, cache_path: Path | None) -> tuple[Any, int]:
    data = cache_path.read_bytes() if cache_path is not None and cache_path.is_file() else b""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TensorRT-RTX: "timing cache operations are no-ops"
        cache = config.create_timing_cache(data)
        if cache is None or not config.set_timing_cache(cache, ignore_mismatch=False):
            # A cache from another device or version: start a fresh one rather than fail the build.
            cache = config.create_timing_cache(b"")
            config.set_timing_cache(cache, ignore_mismatch=False)
            data = b""
    return cache, len(data)


def _save_cache(config: Any, cache_path: Path | None) -> int:
    if cache_path is None:
        return 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        cache = config.get_timing_cache()
        if cache is None:
            return 0
        data = bytes(memoryview(cache.serialize()))
    with atomic_file(cache_path, "wb") as f:
        f.write(data)
    return len(data)


def _build_to_file(trt: Any, builder: Any, network: Any, config: Any, plan_path: Path) -> bool:
    """Build the plan straight into ``plan_path``; False when the build failed (the file is then removed).

    Where the flavour offers ``build_serialized_network_to_stream`` the plan is written as the builder
    produces it, so the serialized engine (the size of the model's weights) is never held in memory
    beside the builder's own copy; otherwise it is built in memory and written.
    """
    ok = False
    try:
        with plan_path.open("wb") as f:
            if hasattr(builder, "build_serialized_network_to_stream") and hasattr(trt, "IStreamWriter"):
                class _Writer(trt.IStreamWriter):
                    def __init__(self) -> None:
                        trt.IStreamWriter.__init__(self)
                        self.written = 0

                    def write(self, data: Any) -> int:
                        n = f.write(data)
                        self.written += n
                        return n

                writer = _Writer()
                ok = bool(builder.build_serialized_network_to_stream(network, config, writer)) and writer.written > 0
            else:
                serialized = builder.build_serialized_network(network, config)
                if serialized is not None and serialized.nbytes:
                    f.write(memoryview(serialized))
                    ok = True
    finally:
        if not ok:
            plan_path.unlink(missing_ok=True)
    return ok


def build_engine(precision: str, onnx_path: Path, plan_path: Path, recipe: Recipe,
                 timing_cache: Path | None = None, device: Device | None = None,
                 say: Callable[[str], None] = lambda _m: None,
                 profiles: Sequence[Mapping[str, Any]] | None = None) -> EngineResult:
    """Build one plan from one ONNX file and write ``plan_path`` plus ``plan_path + ".json"``.

    ``profiles`` (``[{"name", "inputs": {input: {"min", "opt", "max"}}}]``) replaces the one profile per sequence
    bucket (:func:`profile_shapes`): a text-generation graph's prefill and decode (``lm_tensorrt``)."""
    trt, flavour = _trt()
    onnx_path = Path(onnx_path)
    check_onnx_file(onnx_path)  # a broken file gets onnx's clear error before the parser sees it
    spec = recipe.tensorrt
    logger = _make_logger(trt)
    builder = trt.Builder(logger)
    network, parser, strongly_typed = _parse(trt, flavour, builder, logger, onnx_path)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, spec.workspace_mib << 20)
    config.builder_optimization_level = spec.optimization_level
    if not strongly_typed:  # old TensorRT: honour the graph's FP16 casts and Q/DQ through flags
        if precision == "fp16":
            config.set_flag(trt.BuilderFlag.FP16)
        if precision == "int8":
            config.set_flag(trt.BuilderFlag.INT8)
    if spec.version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    targets = _apply_compat(trt, flavour, config, recipe, device)
    _cache, loaded = _load_cache(trt, config, timing_cache)

    dims = {}
    io_in, io_out = [], []
    for i in range(network.num_inputs):
        t = network.get_input(i)
        dims[t.name] = tuple(int(d) for d in t.shape)
        io_in.append({"name": t.name, "dtype": str(t.dtype).split(".")[-1], "shape": list(dims[t.name])})
    for i in range(network.num_outputs):
        t = network.get_output(i)
        io_out.append({"name": t.name, "dtype": str(t.dtype).split(".")[-1], "shape": [int(d) for d in t.shape]})
    profiles = [dict(p) for p in profiles] if profiles is not None else profile_shapes(recipe, dims)
    if any(d < 0 for ds in dims.values() for d in ds):
        for p in profiles:
            prof = builder.create_optimization_profile()
            for name, s in p["inputs"].items():
                prof.set_shape(name, s["min"], s["opt"], s["max"])
            config.add_optimization_profile(prof)
    else:
        profiles = []  # a static network needs no profile

    say(f"building {precision} engine with {flavour} {_version(trt)} ({len(profiles)} profiles)")
    t0 = time.perf_counter()
    plan_path = Path(plan_path)
    with heartbeat(say, f"building the {precision} engine"):
        built = _build_to_file(trt, builder, network, config, plan_path)
    seconds = time.perf_counter() - t0
    if not built:
        errors = [m for m in logger.messages if m.startswith(("[ERROR]", "[INTERNAL_ERROR]"))] or logger.messages
        raise FactoryError(f"{flavour} {_version(trt)} failed to build the {precision} engine from {onnx_path}: "
                           f"{' | '.join(errors[-5:]) or 'no message'}. Fix: raise tensorrt.workspace_mib, lower "
                           "tensorrt.optimization_level, or drop this precision")
    saved = _save_cache(config, timing_cache)
    size = plan_path.stat().st_size
    meta = {
        "precision": precision,
        "flavour": flavour,
        "version": _version(trt),
        "plan": plan_path.name,
        "plan_bytes": size,
        "plan_sha256": digest_path(plan_path),
        "device": NO_GPU if device is None else {"name": device.name, "compute_capability": device.compute_capability},
        "targets": targets,
        "strongly_typed": strongly_typed,
        "profiles": profiles,
        "inputs": io_in,
        "outputs": io_out,
        "input_onnx": onnx_path.name,
        "input_onnx_sha256": digest_path(onnx_path),
        # The weights of a large model live beside the graph (ONNX external data): they shaped the plan too.
        "input_onnx_data_sha256": digest_path(data_file(onnx_path)) if data_file(onnx_path).is_file() else None,
        "build_seconds": round(seconds, 3),
        "built_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "workspace_mib": spec.workspace_mib,
        "optimization_level": spec.optimization_level,
        "hardware_compatibility": spec.hardware_compatibility,
        "version_compatible": spec.version_compatible,
        "timing_cache": {
            "path": str(timing_cache) if timing_cache else None,
            "loaded_bytes": loaded,
            "saved_bytes": saved,
            "used_by_builder": flavour != "tensorrt_rtx",
        },
    }
    meta_path = plan_path.with_name(plan_path.name + ".json")
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    del parser, network, config, builder
    return EngineResult(precision, plan_path, meta_path, seconds, size)


def build_engines(recipe: Recipe, models: Mapping[str, Path], out_dir: Path | None = None,
                  progress: Callable[[str], None] | None = None) -> list[EngineResult]:
    """Build ``model.<precision>.plan`` (+ ``.plan.json``) for every model, into ``out_dir`` atomically.

    ``models`` maps precision to ONNX file (as :func:`quantize_model` returns). ``out_dir`` defaults to
    ``recipe.work_dir / "engines"``; the timing cache to ``recipe.tensorrt.timing_cache`` or
    ``recipe.work_dir / "timing.cache"`` (outside ``out_dir``, so it survives rebuilds).
    """
    say = progress or (lambda _msg: None)
    _trt()  # fail before touching the output folder
    unknown = sorted(set(models) - set(PRECISIONS))
    if unknown:
        raise FactoryError(f"unknown precision(s) {unknown}. Fix: use {', '.join(PRECISIONS)}")
    for p, path in models.items():
        if not Path(path).is_file():
            raise FactoryError(f"the {p} model {path} does not exist. Fix: run the export and quantize stages first")
    out_dir = Path(out_dir or recipe.work_dir / "engines")
    cache = Path(recipe.tensorrt.timing_cache or recipe.work_dir / "timing.cache")
    device = visible_device()
    results = []
    with atomic_dir(out_dir) as tmp:
        for p in sorted(models, key=PRECISIONS.index):
            r = build_engine(p, Path(models[p]), tmp / plan_file(p), recipe, cache, device, say)
            say(f"{p}: {r.size_bytes / 2**20:.1f} MiB in {r.build_seconds:.1f}s")
            results.append(r)
    return [EngineResult(r.precision, out_dir / r.plan_path.name, out_dir / r.metadata_path.name, r.build_seconds,
                         r.size_bytes) for r in results]


def build_engines_existing(recipe: Recipe, progress: Callable[[str], None] | None = None) -> list[EngineResult]:
    """``model-factory build-engine``: build plans from the models already in the recipe's work dir (a
    text-generation recipe: ``lm_tensorrt.build_lm_engines_existing``)."""
    from model_factory.build_engines.quantize import quantized_models

    return build_engines(recipe, quantized_models(recipe), progress=progress)


# --------------------------------------------------------------------------- checks


def plan_header_problems(plan_path: Path) -> list[str] | None:
    """Problems TensorRT-RTX finds in a plan's header without a GPU; None when the flavour cannot check.

    A plan built on this machine has none; a truncated or foreign file reports ``MALFORMED_ENGINE``.
    Findings that only mean "no usable GPU here" (CUDA errors, old driver) are left out.
    """
    trt, _flavour = _trt()
    runtime = trt.Runtime(_make_logger(trt))
    if not hasattr(runtime, "get_engine_validity"):
        return None
    with Path(plan_path).open("rb") as f:
        header = f.read(int(runtime.engine_header_size))
    _validity, diagnostics = runtime.get_engine_validity(header)
    diag = trt.EngineInvalidityDiagnostics
    checks = ("MALFORMED_ENGINE", "VERSION_MISMATCH")
    return [name for name in checks if int(diagnostics) & int(getattr(diag, name))]


def deserialize_plan(plan_path: Path) -> dict[str, Any]:
    """Load a plan on the visible GPU and describe it (I/O tensors, profiles); needs a GPU."""
    trt, flavour = _trt()
    logger = _make_logger(trt)
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(Path(plan_path).read_bytes())
    if engine is None:
        raise FactoryError(f"{flavour} {_version(trt)} cannot load {plan_path} on this machine: "
                           f"{' | '.join(logger.messages[-3:]) or 'no message'}. Fix: load it on a GPU the plan "
                           "targets, with the same TensorRT version")
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    return {"tensors": names, "profiles": engine.num_optimization_profiles}
