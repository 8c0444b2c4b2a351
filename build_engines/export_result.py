"""What the export stage produced (both exporters: encoders in ``export``, decoders in ``causal_lm``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ExportResult:
    """What the export stage produced and how close it is to the source framework."""

    onnx_path: Path
    max_abs_error: float
    tolerance: float
    tokenizer_dir: Path | None
    source_digest: str
    opset: int
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    # The torch engine's file (export.torchscript = true: model.pt2, an ExportedProgram) and its max abs error
    torchscript_path: Path | None = None
    torchscript_max_abs_error: float | None = None
    # The scan of every source file before anything read it (build_engines/source_scan.py), as a table.
    source_scan: dict[str, Any] | None = None
