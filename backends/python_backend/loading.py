"""Choosing and loading the engine for one model instance."""

from __future__ import annotations

from pathlib import Path

from .settings import Settings, SettingsError


def _gpu_plan(version_dir: Path) -> Path | None:
    # Prefer the lowest precision that was built: INT8, then FP16, then FP32.
    for precision in ("int8", "fp16", "fp32"):
        plan = version_dir / f"model.{precision}.plan"
        if plan.is_file():
            return plan
    return None


def load_engine(version_dir: Path, settings: Settings, instance_kind: str, device_id: int):
    """Return ``(engine, info)``: TensorRT on a GPU instance with a plan, else ONNX Runtime."""
    plan = _gpu_plan(version_dir)
    want_trt = settings.engine == "tensorrt" or (settings.engine == "auto" and instance_kind == "GPU" and plan)
    if want_trt:
        if plan is None:
            raise SettingsError(f"engine=tensorrt but {version_dir} has no model.<precision>.plan")
        from .engines.tensorrt import TensorRTEngine

        engine = TensorRTEngine(plan, device_id=device_id, settings=settings)
        return engine, {"flavour": "tensorrt", "file": plan.name}
    from .engines.onnxruntime import OnnxRuntimeEngine

    path = version_dir / settings.onnx_file
    if not path.is_file():
        raise SettingsError(f"{path} is missing: repackage the model")
    return OnnxRuntimeEngine(path), {"flavour": "onnxruntime", "file": path.name}
