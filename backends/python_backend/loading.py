"""Choosing and loading the engine for one model instance."""

from __future__ import annotations

from pathlib import Path

from .integrity import read_checked, verified_digests
from .settings import Settings, SettingsError


def _gpu_plan(version_dir: Path) -> Path | None:
    # Prefer the lowest precision that was built: INT8, then FP16, then FP32.
    for precision in ("int8", "fp16", "fp32"):
        plan = version_dir / f"model.{precision}.plan"
        if plan.is_file():
            return plan
    return None


def load_engine(version_dir: Path, settings: Settings, instance_kind: str, device_id: int):
    """Return ``(engine, info)``: TensorRT on a GPU instance with a plan, else ONNX Runtime.

    The engine is built from bytes read once and checked against the verified
    digests (when the server was started with verification), never re-read from disk.
    """
    version_dir = Path(version_dir)
    model_dir, version = version_dir.parent, version_dir.name
    digests = verified_digests(model_dir.name, version)
    plan = _gpu_plan(version_dir)
    want_trt = settings.engine == "tensorrt" or (settings.engine == "auto" and instance_kind == "GPU" and plan)
    if want_trt:
        if plan is None:
            raise SettingsError(f"engine=tensorrt but {version_dir} has no model.<precision>.plan")
        data = read_checked(model_dir, f"{version}/{plan.name}", digests)
        try:
            from .engines.tensorrt import TensorRTEngine

            engine = TensorRTEngine(data, device_id=device_id, settings=settings)
            return engine, {"flavour": "tensorrt", "file": plan.name, "verified": digests is not None}
        except Exception as exc:  # no TensorRT here, or a plan this GPU/TensorRT cannot run
            if settings.engine == "tensorrt":
                raise
            # engine=auto: a plan built for another GPU or flavour (TensorRT-RTX refuses compute
            # capability 9.0) must not take the model down when the ONNX model can serve it.
            fallback_reason = f"{type(exc).__name__}: {exc}"
    else:
        fallback_reason = None
    from .engines.onnxruntime import OnnxRuntimeEngine

    path = version_dir / settings.onnx_file
    if not path.is_file():
        raise SettingsError(f"{path} is missing: repackage the model")
    data = read_checked(model_dir, f"{version}/{settings.onnx_file}", digests)
    info = {"flavour": "onnxruntime", "file": path.name, "verified": digests is not None}
    if fallback_reason:
        info["fallback_from_tensorrt"] = fallback_reason
    return OnnxRuntimeEngine(data), info
