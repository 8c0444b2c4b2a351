"""Choosing and loading the engine for one model instance.

``engine`` (config parameter) decides:

- ``tensorrt``: the TensorRT plan, or the model does not load;
- ``torch``: the torch program (``model.pt2``; a TorchScript trace in repositories built
  before) on the instance's device (``cuda:<id>`` for a GPU
  instance, ``cpu`` for a CPU instance), or the model does not load;
- ``onnxruntime``: the ONNX model with ONNX Runtime: on a GPU instance its CUDA provider
  (``onnxruntime-gpu``), on a CPU instance the CPU provider;
- ``auto`` (default): on a GPU instance TensorRT (a plan that loads), then ONNX Runtime
  CUDA, then torch (a torch program and torch with CUDA), each skip recorded with its
  reason in ``info`` (``fallback_from_tensorrt``, ``fallback_from_onnxruntime_cuda``,
  ``fallback_from_torch``); on a CPU instance ONNX Runtime on the CPU.

A GPU instance never computes on the CPU by surprise: when no GPU engine loads (or
``engine=onnxruntime`` finds no CUDA provider), the model is refused with every reason,
unless the configuration parameter ``cpu_fallback`` is ``true`` (recipe
``[repository] allow_cpu_fallback = true``); then ONNX Runtime runs on the CPU and ``info``
says so (``cpu_fallback``). ``info["device"]`` is where the engine computes (``cpu``,
``cuda:<id>``).

On the CPU, an INT8 model runs on ONNX Runtime's integer kernels on its 8-bit weights where the CPU has
integer dot products (VNNI, AMX, Arm dot product); elsewhere on the 7-bit weights of ``model.int8.w7.onnx``
when the package has them (8-bit ones would saturate there); else, with ``auto``, the FP32 model packaged beside
it for that case, else with Q/DQ simulated in float (``cpu_features``; parameter ``int8_kernels``, environment
``MODEL_FACTORY_INT8_KERNELS``); ``info["int8_kernels"]`` and ``info["int8_weights"]`` say which (``fp32`` for
the FP32 model), ``info["file"]`` the file loaded.
The CPU instances split the cores as ONNX Runtime threads (``cpu_threads`` overrides), spinning off
when the instances' threads outnumber the cores (``settings.cpu_spinning``); ``info["threads"]``. With
the cores split, an instance also borrows every core for a lone request while the others are idle
(``idle_cores``; parameter ``lend_idle_cores``); ``info["wide_threads"]`` (0: it never borrows).

Every engine serves the configuration's ``precision`` (the recipe's ``repository.serve``) and
nothing else: ``plan_file`` is that precision's plan, ``onnx_file`` its ONNX model (with its
external-data file ``<onnx_file>.data`` when it has one, copied while hashed into a private folder
and loaded from there), and the
torch program, which is FP32, is used only when the precision is fp32.

When the server was started for one GPU product (``serve --gpu-product``, which sets
``MODEL_FACTORY_GPU_PRODUCT``; the Helm chart does it for every pod), only plans whose
``.plan.json`` says they were built on that product count as plans: a plan built
for another product (or ahead of time without a GPU) is skipped as if absent.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..contract import BACKEND_OUTPUTS, Files
from ..integrity import IntegrityError, copy_checked, read_checked, verified_digests
from .cpu_features import Int8Refused, choose_int8_kernels
from ..settings import Settings, SettingsError, cpu_spinning, cpu_threads_per_instance


DATA_SUFFIX = Files.DATA_SUFFIX  # an ONNX file's external data (build_engines/onnx_files.py writes it)
GPU_PRODUCT_ENV = "MODEL_FACTORY_GPU_PRODUCT"


def product_label(device_name: str) -> str:
    """A GPU's name as the ``nvidia.com/gpu.product`` node label spells it ("NVIDIA H100 80GB HBM3" -> "NVIDIA-H100-80GB-HBM3")."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", device_name.strip()).strip("-")


def _built_for(model_dir: Path, relpath: str, digests: dict[str, str] | None) -> str | None:
    """The GPU product a plan was built on, from its (signed) ``.plan.json``; None when it names none."""
    if not (model_dir / relpath).is_file():
        return None
    try:
        meta = json.loads(read_checked(model_dir, relpath, digests))
    except ValueError:
        return None
    device = meta.get("device") if isinstance(meta, dict) else None
    return product_label(device["name"]) if isinstance(device, dict) and device.get("name") else None


def _gpu_plan(version_dir: Path, settings: Settings,
              digests: dict[str, str] | None = None) -> tuple[Path | None, list[str]]:
    """The served precision's plan (never another precision's) and, when a GPU product is set, the plan
    skipped as built for another one."""
    product = os.environ.get(GPU_PRODUCT_ENV, "").strip()
    skipped: list[str] = []
    if not settings.plan_file:
        return None, skipped
    plan = version_dir / settings.plan_file
    if not plan.is_file():
        return None, skipped
    if product:
        built_for = _built_for(version_dir.parent, f"{version_dir.name}/{plan.name}{Files.PLAN_METADATA_SUFFIX}", digests)
        if built_for != product_label(product):
            skipped.append(f"{plan.name} (built for {built_for or 'no GPU product'})")
            return None, skipped
    return plan, skipped


def _load_onnxruntime(version_dir: Path, settings: Settings, digests: dict[str, str] | None,
                      device_id: int | None = None, server_instance: bool = False):
    """ONNX Runtime on the CPU, or with ``device_id`` its CUDA provider on that GPU."""
    from .onnxruntime import OnnxRuntimeCudaEngine, OnnxRuntimeEngine

    model_dir, version = version_dir.parent, version_dir.name
    onnx_name = settings.onnx_file
    info: dict = {}
    # INT8 on the CPU: ONNX Runtime's integer kernels where they compute right (8-bit weights with integer dot
    # products, the 7-bit form elsewhere), else Q/DQ simulated in float, as the accuracy gate scored it.
    if settings.precision == "int8" and device_id is None:
        def packaged(name: str) -> bool:
            return (version_dir / name).is_file() if digests is None else f"{version}/{name}" in digests

        seven = Files.INT8_7BIT
        has_seven = packaged(seven)
        try:
            kernels, weights, why = choose_int8_kernels(settings.int8_kernels, seven_bit=has_seven,
                                                        fp32=packaged(Files.ONNX))
        except Int8Refused as exc:
            raise SettingsError(str(exc)) from exc
        except ValueError as exc:
            raise SettingsError(f"{exc}: fix serve --int8-kernels or the recipe's [repository] int8_kernels") from exc
        info["int8_kernels"], info["int8_weights"], info["int8_kernels_why"] = kernels, weights, why
        if weights == "7-bit":
            onnx_name = seven
        elif weights == "fp32":  # auto on a CPU without dot products and no 7-bit form: the FP32 model is faster
            onnx_name = Files.ONNX
    path = version_dir / onnx_name
    if not path.is_file():
        raise SettingsError(f"{path} is missing: repackage the model")
    data_name = onnx_name + DATA_SUFFIX
    has_data = (version_dir / data_name).is_file() or (digests is not None and f"{version}/{data_name}" in digests)
    info = {"flavour": "onnxruntime", "file": path.name, "verified": digests is not None,
            "device": "cpu" if device_id is None else f"cuda:{int(device_id)}", **info}
    cpus = available_cpus()
    threads = cpu_threads_per_instance(settings, cpus)
    wide = None
    if device_id is None:
        info["threads"] = threads
        wide, info["lend_idle_cores"] = (_lending(version_dir, settings, cpus, threads, data_name) if server_instance
                                         else (None, "not an instance of a running server"))
        info["wide_threads"] = wide or 0

    def make(source: Path | bytes):
        if device_id is None:
            ledger = None
            if wide:
                from ..batching.idle_cores import BusyLedger, ledger_path

                ledger = BusyLedger(ledger_path())
            return OnnxRuntimeEngine(source, threads=threads, spinning=cpu_spinning(settings, cpus, threads),
                                     int8=info.get("int8_kernels"), wide_threads=wide, ledger=ledger)
        return OnnxRuntimeCudaEngine(source, device_id=device_id, settings=settings)

    if device_id is not None:
        info["provider"] = "CUDAExecutionProvider"
    if has_data:
        info["external_data"] = data_name
    return load_verified_onnx(version_dir, onnx_name, digests, make), info


def load_verified_onnx(version_dir: Path, onnx_file: str, digests: dict[str, str] | None, make):
    """``make(source)`` on the ONNX file's verified bytes, or on a private verified copy of it and its data.

    A model with external data (past protobuf's 2 GB limit) is loaded from a path. The graph and its
    data are copied, hashed on the way, into a private folder and loaded from there: the bytes loaded
    are the bytes checked, and a large file is never held in memory twice. The copies go after loading.
    Without verification (``digests`` None) ONNX Runtime reads the weights beside the graph itself.
    """
    model_dir, version = version_dir.parent, version_dir.name
    data_name = onnx_file + DATA_SUFFIX
    has_data = (version_dir / data_name).is_file() or (digests is not None and f"{version}/{data_name}" in digests)
    if not has_data:
        return make(read_checked(model_dir, f"{version}/{onnx_file}", digests))
    if digests is None:
        return make(version_dir / onnx_file)
    private = Path(tempfile.mkdtemp(prefix="mf-verified-"))
    try:
        (private / onnx_file).write_bytes(read_checked(model_dir, f"{version}/{onnx_file}", digests))
        copy_checked(model_dir, f"{version}/{data_name}", digests, private / data_name)
        return make(private / onnx_file)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _lending(version_dir: Path, settings: Settings, cpus: int, threads: int, data_name: str) -> tuple[int | None, str]:
    """``(wide threads or None, why)`` for a CPU instance (idle_cores.lending_plan)."""
    from .onnxruntime import FOLD_LIMIT_BYTES
    from ..batching.idle_cores import lending_plan

    if not settings.lend_idle_cores:
        return None, "off (lend_idle_cores = false)"
    size = sum(p.stat().st_size for p in (version_dir / settings.onnx_file, version_dir / data_name) if p.is_file())
    return lending_plan(cpus, threads, settings.cpu_instances, bool(settings.cpu_threads), size, FOLD_LIMIT_BYTES)


def available_cpus(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The cores this process may use: its affinity mask (a cpuset), capped by a cgroup v2 CPU quota.

    A pod with ``limits.cpu: 2`` on a 64-core node sees 64 cores but is throttled to two: a thread
    per visible core would only be throttled.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota here
    return cores


def instance_device(instance_kind: str, device_id: int) -> str:
    """The torch device of an instance: ``cuda:<id>`` for a GPU instance, else ``cpu``."""
    return f"cuda:{int(device_id)}" if instance_kind == "GPU" else "cpu"


def torch_file(version_dir: Path, settings: Settings) -> Path:
    """The torch engine's file: the ExportedProgram (``model.pt2``) when the version has one and the
    configuration names no other file, else the configured one (a TorchScript trace from before)."""
    from .torch import EXPORTED_PROGRAM_FILE, TORCHSCRIPT_FILE

    program = version_dir / EXPORTED_PROGRAM_FILE
    if settings.torchscript_file == TORCHSCRIPT_FILE and program.is_file():
        return program
    return version_dir / settings.torchscript_file


def _load_torch(version_dir: Path, settings: Settings, device: str, digests: dict[str, str] | None):
    from .torch import TorchEngine

    model_dir, version = version_dir.parent, version_dir.name
    file = torch_file(version_dir, settings).name
    data = read_checked(model_dir, f"{version}/{file}", digests)
    engine_inputs = [i.name for i in settings.inputs if i.data_type != "TYPE_STRING"]
    engine = TorchEngine(data, device, vocab_size=settings.vocab_size, exported_program=file.endswith(".pt2"))
    # The names come from the file (written by the export); they must fit the model configuration.
    if settings.inputs:
        unknown = [n for n in engine.input_names if n not in engine_inputs]
        # truncated_tokens and precision are the backend's own outputs (long_inputs, degrade), not the engine's.
        missing = [o.name for o in settings.outputs if o.name not in engine.output_names and o.name not in BACKEND_OUTPUTS]
        if unknown or missing:
            engine.close()
            raise SettingsError(
                f"{file} takes {list(engine.input_names)} and returns "
                f"{list(engine.output_names)}, which does not fit config.pbtxt (inputs not declared: "
                f"{unknown or 'none'}, outputs not produced: {missing or 'none'}): repackage the model")
    info = {"flavour": "torch", "file": file, "device": device, "verified": digests is not None,
            "format": engine.format}
    if engine.allocator_backend:
        info["allocator"] = engine.allocator_backend
    return engine, info


_FROM_ENV = object()


def load_engine(version_dir: Path, settings: Settings, instance_kind: str, device_id: int,
                digests: Any = _FROM_ENV, server_instance: bool = False):
    """Return ``(engine, info)`` as the module docstring describes.

    ``server_instance``: loaded by a model instance inside Triton (its ``initialize()``), where a CPU
    instance may borrow the other instances' idle cores (``idle_cores``); ``accept``, ``build``'s check and
    the queue bound's timing load without.

    The engine is built from bytes read once and checked against the verified
    digests (by default those ``serve`` handed to the server, see ``integrity``;
    ``model-factory accept`` passes its own), never re-read from disk.
    """
    version_dir = Path(version_dir)
    model_dir, version = version_dir.parent, version_dir.name
    if digests is _FROM_ENV:
        digests = verified_digests(model_dir.name, version)
    gpu = instance_kind == "GPU"
    torchscript = torch_file(version_dir, settings)
    if settings.engine == "torch":
        if settings.precision != "fp32":
            raise SettingsError(f"engine=torch serves the FP32 torch program, but precision={settings.precision}: "
                                "repackage with repository.serve = \"fp32\" or engine = \"auto\"")
        if not torchscript.is_file():
            raise SettingsError(f"engine=torch but {torchscript.parent / 'model.pt2'} is missing: repackage the model with "
                                "export.torchscript = true in its recipe (or use engine=auto)")
        return _load_torch(version_dir, settings, instance_device(instance_kind, device_id), digests)
    fallback: dict[str, str] = {}
    plan, skipped = _gpu_plan(version_dir, settings, digests)
    if skipped and plan is None and gpu:
        fallback["fallback_from_tensorrt"] = (f"no plan built for GPU product {os.environ[GPU_PRODUCT_ENV]!r}: "
                                              f"skipped {', '.join(skipped)}")
    want_trt = settings.engine == "tensorrt" or (settings.engine == "auto" and gpu and plan)
    if want_trt:
        if plan is None:
            raise SettingsError(f"engine=tensorrt but {version_dir} has no {settings.precision} plan "
                                f"({settings.plan_file or 'none was built'})"
                                + (f" built for this GPU product ({fallback['fallback_from_tensorrt']})"
                                   if skipped else ": build engines for it, or use engine=auto"))
        data = read_checked(model_dir, f"{version}/{plan.name}", digests)
        try:
            from .tensorrt import TensorRTEngine

            engine = TensorRTEngine(data, device_id=device_id, settings=settings)
            return engine, {"flavour": "tensorrt", "file": plan.name, "device": f"cuda:{int(device_id)}",
                            "verified": digests is not None, "precision": settings.precision}
        except Exception as exc:  # no TensorRT here, or a plan this GPU/TensorRT cannot run
            if settings.engine == "tensorrt":
                raise
            # engine=auto: a plan built for another GPU or flavour (TensorRT-RTX refuses compute
            # capability 9.0) must not take the model down when another engine can serve it.
            fallback["fallback_from_tensorrt"] = f"{type(exc).__name__}: {exc}"
    elif settings.engine == "auto" and gpu and "fallback_from_tensorrt" not in fallback:
        fallback["fallback_from_tensorrt"] = f"no {settings.precision} plan in the version folder"
    if gpu and settings.engine in ("auto", "onnxruntime"):
        from .onnxruntime import cuda_provider_unavailable_reason

        why = cuda_provider_unavailable_reason()
        if why is None:  # checked before any bytes are read
            try:
                engine, info = _load_onnxruntime(version_dir, settings, digests, device_id)
                return engine, {**info, "precision": settings.precision, **fallback}
            except (SettingsError, IntegrityError):
                raise
            except Exception as exc:  # no CUDA libraries, no GPU: the next engine may still serve
                why = f"{type(exc).__name__}: {exc}"
        fallback["fallback_from_onnxruntime_cuda"] = why
    if settings.engine == "auto" and gpu:
        if settings.precision != "fp32":
            fallback["fallback_from_torch"] = (f"the torch program is FP32 and this deployment serves "
                                               f"{settings.precision}")
        elif not torchscript.is_file():
            fallback["fallback_from_torch"] = (f"no model.pt2 (or {settings.torchscript_file}) in the version folder (package with "
                                               "export.torchscript = true to serve with torch on the GPU)")
        else:
            from .torch import cuda_unavailable_reason

            why = cuda_unavailable_reason(device_id)
            if why is None:
                try:
                    engine, info = _load_torch(version_dir, settings, instance_device(instance_kind, device_id),
                                               digests)
                    return engine, {**info, "precision": settings.precision, **fallback}
                except (SettingsError, IntegrityError):
                    raise  # a file changed after verification, or a package that does not fit its config
                except Exception as exc:  # torch cannot load this file here: ONNX Runtime still can serve
                    why = f"{type(exc).__name__}: {exc}"
            fallback["fallback_from_torch"] = why
    if gpu and not settings.cpu_fallback:
        reasons = "; ".join(f"{k[len('fallback_from_'):]}: {v}" for k, v in fallback.items())
        raise SettingsError(
            f"GPU instance of {settings.model_name}: no GPU engine loads here and this model does not allow "
            f"serving on the CPU instead ({reasons}). Fix: install the engine the model was built for (TensorRT "
            "bindings matching the plan, onnxruntime-gpu, or torch with CUDA), or set [repository] "
            "allow_cpu_fallback = true in the recipe, or give the model a KIND_CPU instance group")
    engine, info = _load_onnxruntime(version_dir, settings, digests, server_instance=server_instance)
    info = {**info, "precision": settings.precision, **fallback}
    if gpu:
        info["cpu_fallback"] = "allowed by the recipe (allow_cpu_fallback = true)"
    return engine, info


def text_inputs(settings: Settings) -> tuple[str, ...]:
    """The model's text inputs (``text``, or ``query`` + ``passage``), tokenized by the backend."""
    from ..requests.items import TEXT_INPUTS

    return tuple(i.name for i in settings.inputs if i.data_type == "TYPE_STRING" and i.name in TEXT_INPUTS)


def load_for_serving(version_dir: Path, settings: Settings, instance_kind: str, device_id: int,
                     digests: Any = _FROM_ENV, server_instance: bool = False):
    """``(engine, info, tokenizer or None)``: :func:`load_engine`, the tokenizer of a text model, and a warm-up.

    The one load path of the backend's ``initialize()``, ``model-factory accept`` and ``build``'s check of the
    packaged model: what passes here loads in Triton. A failing warm-up closes the engine and raises
    :class:`~.samples.WarmupError`.
    """
    from ..batching.grouping import profile_for_length
    from ..requests.samples import warm_up

    if digests is _FROM_ENV:
        digests = verified_digests(Path(version_dir).parent.name, Path(version_dir).name)
    engine, info = load_engine(version_dir, settings, instance_kind, device_id, digests, server_instance)
    try:
        tokenizer = None
        if text_inputs(settings):
            from ..requests.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(Path(version_dir), settings.max_sequence_length, digests)
        warm_up(engine, settings, profile_for_length)
    except BaseException:
        engine.close()
        raise
    return engine, info, tokenizer
