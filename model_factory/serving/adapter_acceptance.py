"""A LoRA adapter entry's acceptance: what ``accept`` can say of it on this repository without a served base.

An adapter has no engine of its own (its base's stub runs it) and no golden data of its own: the build's check
compared it with ``transformers`` + ``peft`` and gated it on the held-out text (``accuracy.json``). Accepted here:
that gate passed, and this repository holds the base version the adapter names with the bytes it was built on
(``distribution/adapters.py``: the check ``pull`` makes, and the stub again at load). Anything else fails with the
reason, as a model that does not load does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from model_factory.backend.integrity import read_checked
from model_factory.backend.lora_contract import ADAPTER_SPEC, ADAPTER_WEIGHTS, AdapterSpec

ACCURACY = "accuracy.json"


def accept_adapter(model_dir: Path, digests: Mapping[str, str] | None = None,
                   version: int | None = None) -> dict[str, Any]:
    """The ``AcceptanceResult`` fields (but model) of ``version`` (default: the newest) of the adapter entry
    ``model_dir``."""
    from model_factory.distribution.adapters import base_problem
    from model_factory.signing import layout

    model_dir = Path(model_dir)
    versions = layout.model_entries(model_dir).versions
    if not versions:
        return {"version": None, "passed": False, "reason": f"{model_dir.name} has no version folder"}
    version = str(max(versions) if version is None else int(version))
    d = dict(digests) if digests is not None else None
    try:
        spec = AdapterSpec.from_json(read_checked(model_dir, f"{version}/{ADAPTER_SPEC}", d).decode())
        gate = json.loads(read_checked(model_dir, f"{version}/{ACCURACY}", d).decode())["gate"]
    except Exception as exc:  # noqa: BLE001 - unreadable or changed after verification: that is the verdict
        return {"version": version, "passed": False, "reason": f"{type(exc).__name__}: {exc}"}
    # Where it runs: its base's stub, on a CPU instance (adapters are served there).
    found = {"version": version, "engine": f"adapter of {spec.base} version {spec.base_version}",
             "file": ADAPTER_WEIGHTS, "device": "cpu",
             "metric": "perplexity_ratio", "threshold": gate.get("max_perplexity_ratio"),
             "score": gate.get("perplexity_ratio"), "samples": int(gate.get("tokens", 0))}
    problem = base_problem(model_dir / version, model_dir.parent)
    if problem:
        return {**found, "passed": False, "reason": problem}
    if not gate.get("passed"):
        return {**found, "passed": False, "reason": "the build's gate on the held-out text did not pass"}
    return {**found, "passed": True}
