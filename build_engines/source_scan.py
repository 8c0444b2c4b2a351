"""Every file of a model source classified, and every pickle scanned, before any library opens it.

A pickle (``pytorch_model.bin``, ``.pt``, ``.pth``, ``.ckpt``, a zip-format torch file's ``data.pkl``, a
numpy object array) is a program: loading it may import and call anything. So each file of the source is
classified from its first bytes (and its name only where the bytes do not say), and each pickle it holds
is disassembled by `picklescan <https://github.com/mmaitre314/picklescan>`_ (never unpickled) to list the
globals it imports. The verdict:

* a pickle that imports something the scanner flags as dangerous (``os.system``, ``builtins.eval``,
  ``getattr`` in a reduce chain, ``subprocess``...) or that it does not know (not on its safe list) is
  refused, always;
* a clean pickle is refused by default (convert it to safetensors), admitted with
  ``[source] allow_pickle = true``;
* safetensors, ONNX, GGUF and plain numpy arrays hold data only and pass.

picklescan was chosen by measurement (docs/signing.md, "Scanning sources"): on the known-bad and
known-good files the tests make it flagged every bad one and no good one; modelscan skipped a pickle
named ``.bin`` and the pickles inside a zip-format torch file, and fickling flagged a plain state dict
and could not read zip-format torch files.

The scan reads files as streams (the scanner walks the pickle opcodes; nothing is loaded whole), and its
verdict (:class:`SourceScan`) goes into the provenance and the BOM.
"""

from __future__ import annotations

import logging
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from model_factory.errors import FactoryError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".joblib", ".dat", ".data", ".model")
TEXT_SUFFIXES = (".json", ".txt", ".md", ".jsonl", ".toml", ".yaml", ".yml", ".csv")
# The kinds a file can be; only those that carry a pickle are scanned.
PICKLE_KINDS = ("pickle", "torch-zip", "numpy-object", "numpy-object-zip")
NUMPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"
ALLOW_FIX = "set [source] allow_pickle = true in the recipe (files the scanner flags stay refused)"


@dataclass(frozen=True)
class FileVerdict:
    """One source file: what it is, what its pickles import, and whether it may be read."""

    path: str  # relative to the source's folder
    kind: str  # safetensors onnx gguf pickle torch-zip numpy numpy-object numpy-zip numpy-object-zip text python other
    imports: tuple[str, ...] = ()  # module.name of every global its pickles import (scanned kinds only)
    flagged: tuple[str, ...] = ()  # those the scanner calls dangerous or does not know
    verdict: str = "ok"  # ok | allowed (a clean pickle, allow_pickle) | refused

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "kind": self.kind, "verdict": self.verdict}
        if self.kind in PICKLE_KINDS:
            out["imports"] = list(self.imports)
            out["flagged"] = list(self.flagged)
        return out


@dataclass(frozen=True)
class SourceScan:
    """The verdict on a whole source: every file, the scanner that read the pickles, and the policy."""

    files: tuple[FileVerdict, ...]
    scanner: str
    allow_pickle: bool

    @property
    def refused(self) -> tuple[FileVerdict, ...]:
        return tuple(f for f in self.files if f.verdict == "refused")

    @property
    def verdict(self) -> str:
        if self.refused:
            return "refused"
        return "pickle-allowed" if any(f.verdict == "allowed" for f in self.files) else "clean"

    def to_dict(self) -> dict[str, Any]:
        return {"scanner": self.scanner, "allow_pickle": self.allow_pickle, "verdict": self.verdict,
                "files": [f.to_dict() for f in self.files]}

    def check(self) -> "SourceScan":
        """Self, or a FactoryError (one line) about the first refused file."""
        for f in self.refused:
            raise FactoryError(refusal_line(f, self.scanner, self.allow_pickle))
        return self


def refusal_line(f: FileVerdict, scanner: str, allow_pickle: bool) -> str:
    imports = ", ".join(f.imports[:6]) + (" ..." if len(f.imports) > 6 else "") or "nothing"
    if f.flagged:
        flagged = ", ".join(f.flagged[:4])
        return (f"source file {f.path} is a {_kind_text(f.kind)} that imports {flagged}, which {scanner} flags as "
                "dangerous or unknown: loading it could run that code, so it is refused before anything reads it. "
                "Fix: do not use this file; get the model as safetensors from a source you trust "
                "(allow_pickle does not admit flagged files)")
    return (f"source file {f.path} is a {_kind_text(f.kind)} (it imports {imports}); a pickle can run code when "
            "it is loaded, so it is refused by default. Fix: convert it to safetensors (load it where you trust it "
            "and save_pretrained(..., safe_serialization=True) or safetensors.torch.save_file), or " + ALLOW_FIX)


def _kind_text(kind: str) -> str:
    return {"pickle": "pickle", "torch-zip": "zip-format torch file (a pickle inside)",
            "numpy-object": "numpy object array (a pickle inside)",
            "numpy-object-zip": ".npz whose arrays hold pickles"}.get(kind, kind)


def classify(path: Path) -> str:
    """What ``path`` is, from its first bytes (its name only where they do not say)."""
    with Path(path).open("rb") as f:
        head = f.read(16)
    suffix = Path(path).suffix.lower()
    if head.startswith(b"GGUF"):
        return "gguf"
    if head.startswith(NUMPY_MAGIC):
        return "numpy-object" if _npy_holds_objects(path) else "numpy"
    if head.startswith(ZIP_MAGIC):
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
        if any(n.endswith(".pkl") or n.endswith("/data.pkl") for n in names):
            return "torch-zip"
        if names and all(n.endswith(".npy") for n in names):
            # an .npz: plain arrays are data; an object array is a pickle (scanned)
            with zipfile.ZipFile(path) as z:
                objects = any(_npy_holds_objects(z.open(n)) for n in names)
            return "numpy-object-zip" if objects else "numpy-zip"
        return "zip"
    if _looks_like_safetensors(path, head):
        return "safetensors"
    if head[:1] == b"\x80" and len(head) > 1 and 2 <= head[1] <= 5:
        return "pickle"  # protocol 2..5, whatever the file is called
    if suffix == ".onnx":
        return "onnx"
    if suffix in PICKLE_SUFFIXES:
        return "pickle"  # protocol 0/1 pickles have no magic: by name
    if suffix == ".py":
        return "python"
    if suffix in TEXT_SUFFIXES:
        return "text"
    return "other"


def _looks_like_safetensors(path: Path, head: bytes) -> bool:
    if len(head) < 9:
        return False
    n = int.from_bytes(head[:8], "little")
    return 2 <= n <= Path(path).stat().st_size - 8 and head[8:9] == b"{"


def _npy_holds_objects(source: Any) -> bool:
    """Whether an .npy (a path or an open stream) holds an object array, from its header alone."""
    import numpy as np

    with (Path(source).open("rb") if isinstance(source, (str, Path)) else source) as f:
        version = np.lib.format.read_magic(f)
        header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                  else np.lib.format.read_array_header_2_0)(f)
    return bool(header[2].hasobject)


def scanner_name() -> str:
    import importlib.metadata

    return f"picklescan {importlib.metadata.version('picklescan')}"


def scan_pickles(path: Path, kind: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(imports, flagged) of the pickles in ``path``: disassembled by picklescan, never unpickled."""
    try:
        from picklescan import scanner
    except ImportError as exc:
        raise FactoryError("scanning a pickle-based source needs picklescan. Fix: pip install "
                           "'model-factory[export]'") from exc
    # picklescan logs every finding at WARNING: the verdict is ours to say, once.
    logging.getLogger("picklescan").setLevel(logging.CRITICAL)
    with Path(path).open("rb") as f:
        if kind in ("torch-zip", "numpy-object-zip"):
            result = scanner.scan_zip_bytes(f, path.name)
        elif kind == "numpy-object":
            result = scanner.scan_numpy(f, path.name)
        else:
            try:  # torch's legacy format: a few pickles, then raw storage bytes the scanner must not parse
                result = scanner.scan_pytorch(f, path.name)
            except scanner.InvalidMagicError:  # a plain pickle (or several in a row)
                f.seek(0)
                result = scanner.scan_pickle_bytes(f, path.name, multiple_pickles=True)
    imports = tuple(sorted({f"{g.module}.{g.name}" for g in result.globals}))
    flagged = tuple(sorted({f"{g.module}.{g.name}" for g in result.globals
                            if g.safety.name in ("Dangerous", "Suspicious")}))
    if result.scan_err and not flagged:
        flagged = ("(a pickle the scanner could not read to its end)",)
    return imports, flagged


def scan_files(files: Iterable[Path], root: Path, allow_pickle: bool = False) -> SourceScan:
    """Classify each of ``files`` (named relative to ``root``) and scan its pickles."""
    verdicts = []
    scanner = None
    for p in sorted(Path(x) for x in files):
        kind = classify(p)
        rel = str(p.relative_to(root)) if p != root and root in p.parents else p.name
        if kind not in PICKLE_KINDS:
            verdicts.append(FileVerdict(rel, kind))
            continue
        scanner = scanner or scanner_name()
        imports, flagged = scan_pickles(p, kind)
        verdict = "refused" if flagged or not allow_pickle else "allowed"
        verdicts.append(FileVerdict(rel, kind, imports, flagged, verdict))
    return SourceScan(tuple(verdicts), scanner or _scanner_or_none(), allow_pickle)


def _scanner_or_none() -> str:
    try:
        return scanner_name()
    except Exception:  # not installed: nothing needed it
        return "none (no pickles)"


def source_files(recipe: Any) -> tuple[Path, list[Path]]:
    """The folder a recipe's source lies in and the files a build reads from it (and its data files)."""
    src = recipe.source
    files: list[Path] = []
    if src.kind == "huggingface" and src.path is not None:
        root = Path(src.path)
        files = [p for p in root.rglob("*") if p.is_file() and ".git" not in p.relative_to(root).parts]
    elif src.kind in ("onnx", "gguf") and src.path is not None:  # one file (a GGUF holds no code: classified)
        root = Path(src.path).parent
        files = [Path(src.path)]
    else:  # torch: the factory's own code runs inside the build sandbox; its data files are scanned below
        root = Path(src.base_dir or Path.cwd())
    q = recipe.quantization
    for data in (q.calibration_data, q.heldout_data):
        if data is not None and Path(data).suffix.lower() in (".npz", ".npy") and Path(data).is_file():
            files.append(Path(data))
    return root, files


def scan_source(recipe: Any) -> SourceScan:
    """The checked verdict on ``recipe``'s source: a FactoryError (one line) names the first refused file."""
    root, files = source_files(recipe)
    return scan_files(files, root, allow_pickle=bool(getattr(recipe.source, "allow_pickle", False))).check()


def scan_summary(scan: Mapping[str, Any]) -> str:
    """One line: the verdict and what was scanned (for the build's output and the BOM)."""
    files = scan.get("files") or []
    pickles = [f for f in files if f.get("kind") in PICKLE_KINDS]
    kinds = sorted({f.get("kind") for f in files})
    return (f"{scan.get('verdict')}: {len(files)} file(s) ({', '.join(kinds) or 'none'}), {len(pickles)} pickle(s) "
            f"scanned by {scan.get('scanner')}")


__all__ = ["FileVerdict", "SourceScan", "classify", "scan_files", "scan_source", "scan_summary", "source_files",
           "scan_pickles"]
