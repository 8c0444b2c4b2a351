"""What the served backends say about themselves, read once from the metrics port."""

from __future__ import annotations

from typing import Mapping

from model_factory.errors import FactoryError


def engine_info_from_metrics(metrics_url: str, timeout: float = 2.0) -> dict[str, dict[str, str]]:
    """model -> the labels of its ``model_factory_engine_info`` (precision, int8_kernels, threads, wide_threads),
    from one instance; {} when the scrape fails."""
    from model_factory.measure.bench import scrape_metrics

    info: dict[str, dict[str, str]] = {}
    try:
        for sample in scrape_metrics(metrics_url, timeout=timeout):
            model = sample.labels.get("model")
            if sample.name == "model_factory_engine_info" and model is not None and model not in info:
                info[model] = dict(sample.labels)
    except FactoryError:
        pass
    return info


def engine_description(labels: Mapping[str, str] | None, parameters: Mapping[str, str], instance_kind: str) -> str:
    """What a loaded model computes on, for ``serve``'s banner: its ``model_factory_engine_info`` labels where it
    published them (an encoder's instance), else its served contract: a text-generation model runs its graph on
    ONNX Runtime (its metrics carry no engine label), any other model on the engine its parameters name.

    ``parameters``: the served ``config.pbtxt``'s string parameters; ``instance_kind``: its instance group's kind
    (``KIND_CPU``, ``KIND_GPU``).
    """
    if labels and labels.get("engine"):
        return f"{labels['engine']} on {labels.get('device', '?')}"
    from model_factory.backend.contract import TEXT_GENERATION

    gpu = instance_kind == "KIND_GPU"
    precision = parameters.get("precision") or "fp32"
    if parameters.get("task") == TEXT_GENERATION:
        where = ("a GPU (ONNX Runtime's CUDA provider" + (", the CPU where it cannot load there" if
                                                          parameters.get("cpu_fallback") == "true" else "") + ")"
                 if gpu else "cpu")
        return f"onnxruntime on {where} (text generation, {precision})"
    engine = parameters.get("engine") or "auto"
    engine = "onnxruntime or tensorrt, chosen at load" if engine == "auto" else engine
    return f"{engine} on {'a GPU' if gpu else 'cpu'} ({precision}, from its config: no engine label in the metrics)"


def serving_notes(info: dict[str, dict[str, str]]) -> dict[str, str]:
    """model -> what its operator should know about how it computes here (from :func:`engine_info_from_metrics`).

    INT8 simulated in float is said plainly: on a CPU without integer dot products FP32 is the faster choice.
    """
    notes: dict[str, str] = {}
    for model, labels in info.items():
        if labels.get("int8_kernels") == "simulated":
            notes[model] = ("INT8 runs with Q/DQ simulated in float on this CPU, so FP32 is the faster choice here "
                            "(benchmarks/RESULTS.md, \"INT8 on the CPU\"). "
                            "Fix: package it with [repository] serve = \"fp32\" for this machine, rebuild it with a "
                            "model-factory that writes model.int8.w7.onnx (integer kernels on 7-bit weights, safe "
                            "here) or use --int8-kernels auto, or serve it on a CPU with VNNI, AMX or Arm dot "
                            "products (integer kernels)")
    return notes
