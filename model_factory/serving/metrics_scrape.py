"""What the served backends say about themselves, read once from the metrics port."""

from __future__ import annotations

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
