"""What the served backends say about themselves, read once from the metrics port."""

from __future__ import annotations

from model_factory.errors import FactoryError


def engines_from_metrics(metrics_url: str, timeout: float = 2.0) -> dict[str, str]:
    """model -> ``engine on device`` from the backend's metric labels (one scrape; {} when it fails)."""
    from model_factory.measure.bench import scrape_metrics

    engines: dict[str, str] = {}
    try:
        for sample in scrape_metrics(metrics_url, timeout=timeout):
            model = sample.labels.get("model")
            if model is not None and "engine" in sample.labels and model not in engines:
                engines[model] = f"{sample.labels['engine']} on {sample.labels.get('device', '?')}"
    except FactoryError:
        pass
    return engines
