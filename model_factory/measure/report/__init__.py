"""One self-contained HTML page per release: what was built, accuracy, engines, trust, speed, what changed.

One module per section, each reading what the factory already wrote and returning a
frozen dataclass; ``page`` collects them per model version and renders the Jinja2
templates (``templates/``, shipped as package data); ``plots`` draws with matplotlib
(Agg) into inline SVG.

* ``release``  a model version on disk: metadata.json and its files
* ``built``    source and digest, task, precisions, what is served, sizes
* ``inputs``   the data contract (contract.json): inputs, outputs, limits, the long-input policy; and the texts
               the backend truncated or chunked during the sweep (its counters)
* ``accuracy`` accuracy.json: each precision against the gate, INT8's float layers and their sensitivity
* ``engines``  the TensorRT plans' .plan.json sidecars
* ``trust``    signature, provenance, the policy's verdict, acceptance on this machine
* ``speed``    the ``bench --sweep`` JSON: throughput vs p99 latency, padding, groups per window
* ``changes``  against an older release (``--against``), the data-contract diff first (breaking changes named)
"""

from __future__ import annotations

from model_factory.measure.report.page import ReportInputs, collect, render, write_report

__all__ = ["ReportInputs", "collect", "render", "write_report"]
