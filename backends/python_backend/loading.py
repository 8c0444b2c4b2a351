"""Choosing and loading the engine for one model instance.

``engine`` (config parameter) decides:

- ``tensorrt``: the TensorRT plan, or the model does not load;
- ``torch``: the TorchScript file on the instance's device (``cuda:<id>`` for a GPU
  instance, ``cpu`` for a CPU instance), or the model does not load;
- ``onnxruntime``: the ONNX model on the CPU;
- ``auto`` (default): on a GPU instance the TensorRT plan if there is one and it
  loads, else the TorchScript file if there is one and torch has CUDA, else ONNX
  Runtime, with the reasons in ``info`` (``fallback_from_tensorrt``,
  ``fallback_from_torch``); on a CPU instance ONNX Runtime.

When the server was started for one GPU product (``serve --gpu-product``, which sets
``MODEL_FACTORY_GPU_PRODUCT``; the Helm chart does it for every pod), only plans whose
``.plan.json`` says they were built on that product count as plans: a plan built
for another product (or ahead of time without a GPU) is skipped as if absent.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .integrity import IntegrityError, read_checked, verified_digests
from .settings import Settings, SettingsError


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


def _gpu_plan(version_dir: Path, digests: dict[str, str] | None = None) -> tuple[Path | None, list[str]]:
    """The plan to load and, when a GPU product is set, the plans skipped as built for another one."""
    product = os.environ.get(GPU_PRODUCT_ENV, "").strip()
    skipped: list[str] = []
    # Prefer the lowest precision that was built: INT8, then FP16, then FP32.
    for precision in ("int8", "fp16", "fp32"):
        plan = version_dir / f"model.{precision}.plan"
        if not plan.is_file():
            continue
        if product:
            built_for = _built_for(version_dir.parent, f"{version_dir.name}/{plan.name}.json", digests)
            if built_for != product_label(product):
                skipped.append(f"{plan.name} (built for {built_for or 'no GPU product'})")
                continue
        return plan, skipped
    return None, skipped


def instance_device(instance_kind: str, device_id: int) -> str:
    """The torch device of an instance: ``cuda:<id>`` for a GPU instance, else ``cpu``."""
    return f"cuda:{int(device_id)}" if instance_kind == "GPU" else "cpu"


def _load_torch(version_dir: Path, settings: Settings, device: str, digests: dict[str, str] | None):
    from .engines.torch import TorchEngine

    model_dir, version = version_dir.parent, version_dir.name
    data = read_checked(model_dir, f"{version}/{settings.torchscript_file}", digests)
    engine_inputs = [i.name for i in settings.inputs if i.data_type != "TYPE_STRING"]
    engine = TorchEngine(data, device, vocab_size=settings.vocab_size)
    # The names come from the file (written by the export); they must fit the model configuration.
    if settings.inputs:
        unknown = [n for n in engine.input_names if n not in engine_inputs]
        missing = [o.name for o in settings.outputs if o.name not in engine.output_names]
        if unknown or missing:
            engine.close()
            raise SettingsError(
                f"{settings.torchscript_file} takes {list(engine.input_names)} and returns "
                f"{list(engine.output_names)}, which does not fit config.pbtxt (inputs not declared: "
                f"{unknown or 'none'}, outputs not produced: {missing or 'none'}): repackage the model")
    info = {"flavour": "torch", "file": settings.torchscript_file, "device": device,
            "verified": digests is not None}
    if engine.allocator_backend:
        info["allocator"] = engine.allocator_backend
    return engine, info


def load_engine(version_dir: Path, settings: Settings, instance_kind: str, device_id: int):
    """Return ``(engine, info)`` as the module docstring describes.

    The engine is built from bytes read once and checked against the verified
    digests (when the server was started with verification), never re-read from disk.
    """
    version_dir = Path(version_dir)
    model_dir, version = version_dir.parent, version_dir.name
    digests = verified_digests(model_dir.name, version)
    gpu = instance_kind == "GPU"
    torchscript = version_dir / settings.torchscript_file
    if settings.engine == "torch":
        if not torchscript.is_file():
            raise SettingsError(f"engine=torch but {torchscript} is missing: repackage the model with "
                                "export.torchscript = true in its recipe (or use engine=auto)")
        return _load_torch(version_dir, settings, instance_device(instance_kind, device_id), digests)
    fallback: dict[str, str] = {}
    plan, skipped = _gpu_plan(version_dir, digests)
    if skipped and plan is None and gpu:
        fallback["fallback_from_tensorrt"] = (f"no plan built for GPU product {os.environ[GPU_PRODUCT_ENV]!r}: "
                                              f"skipped {', '.join(skipped)}")
    want_trt = settings.engine == "tensorrt" or (settings.engine == "auto" and gpu and plan)
    if want_trt:
        if plan is None:
            raise SettingsError(f"engine=tensorrt but {version_dir} has no model.<precision>.plan"
                                + (f" built for this GPU product ({fallback['fallback_from_tensorrt']})"
                                   if skipped else ""))
        data = read_checked(model_dir, f"{version}/{plan.name}", digests)
        try:
            from .engines.tensorrt import TensorRTEngine

            engine = TensorRTEngine(data, device_id=device_id, settings=settings)
            return engine, {"flavour": "tensorrt", "file": plan.name, "verified": digests is not None}
        except Exception as exc:  # no TensorRT here, or a plan this GPU/TensorRT cannot run
            if settings.engine == "tensorrt":
                raise
            # engine=auto: a plan built for another GPU or flavour (TensorRT-RTX refuses compute
            # capability 9.0) must not take the model down when another engine can serve it.
            fallback["fallback_from_tensorrt"] = f"{type(exc).__name__}: {exc}"
    if settings.engine == "auto" and gpu:
        if not torchscript.is_file():
            fallback["fallback_from_torch"] = (f"no {settings.torchscript_file} in the version folder (package with "
                                               "export.torchscript = true to serve with torch on the GPU)")
        else:
            from .engines.torch import cuda_unavailable_reason

            why = cuda_unavailable_reason(device_id)
            if why is None:
                try:
                    engine, info = _load_torch(version_dir, settings, instance_device(instance_kind, device_id),
                                               digests)
                    return engine, {**info, **fallback}
                except (SettingsError, IntegrityError):
                    raise  # a file changed after verification, or a package that does not fit its config
                except Exception as exc:  # torch cannot load this file here: ONNX Runtime still can serve
                    why = f"{type(exc).__name__}: {exc}"
            fallback["fallback_from_torch"] = why
    from .engines.onnxruntime import OnnxRuntimeEngine

    path = version_dir / settings.onnx_file
    if not path.is_file():
        raise SettingsError(f"{path} is missing: repackage the model")
    data = read_checked(model_dir, f"{version}/{settings.onnx_file}", digests)
    info = {"flavour": "onnxruntime", "file": path.name, "verified": digests is not None, **fallback}
    return OnnxRuntimeEngine(data), info
