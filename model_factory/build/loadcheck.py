"""Build's last check: the packaged model loads and runs its warm-up as the backend will in Triton.

The same load path as ``serve`` and ``accept`` (``backend.loading.load_for_serving``: engine, tokenizer,
one warm-up row per sequence bucket with values the model accepts), on this machine's CPU with ONNX
Runtime, against the staged version folder before it goes live. A model that cannot run its own warm-up
fails the build in one line instead of being refused later by the server.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from model_factory.errors import FactoryError


def check_packaged(version_dir: Path) -> None:
    """Load ``version_dir`` (``<model>/<version>``, config beside it) as the backend does; FactoryError if it cannot."""
    from google.protobuf import json_format

    from model_factory.backend.engines.loading import load_for_serving
    from model_factory.backend.settings import parse_settings
    from model_factory.build.repository import read_config

    version_dir = Path(version_dir)
    config = read_config(version_dir.parent)
    settings = parse_settings(json_format.MessageToDict(config, preserving_proto_field_name=True))
    # The served precision's ONNX on the CPU: the graph and the declared inputs are what is checked here
    # (a TensorRT plan or a GPU needs the machine it serves on: accept checks those there).
    settings = dataclasses.replace(settings, engine="auto")
    try:
        engine, _info, _tokenizer = load_for_serving(version_dir, settings, "CPU", 0, digests=None)
    except Exception as exc:  # every cause means the same: Triton would refuse this model
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise FactoryError(f"the packaged model {settings.model_name} cannot load and run its warm-up: {detail}"
                           + ("" if "Fix:" in detail else ". Fix: check the recipe's [[inputs]] against the model, "
                              "then rebuild")) from None
    engine.close()
