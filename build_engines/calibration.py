"""Calibration and held-out data: read, split, and turn into model inputs.

Three file kinds are read:

* ``.txt`` — one sample per line (blank lines are skipped);
* ``.jsonl`` — one JSON object per line with a ``"text"`` field, or ``"query"``
  and ``"passage"`` fields (a reranker's pairs, tokenized as pairs);
* ``.npz`` — input tensors keyed by the model's input names, samples on axis 0.

Text goes through the model's *own* tokenizer (the one the export stage saved
next to the ONNX file), so calibration sees exactly the ids the server will
send. There is no fallback: without data the stage stops with a
:class:`~model_factory.errors.FactoryError` that says how to provide it.
Random inputs would calibrate ranges that real traffic never produces.

Calibration feeds are padded to one length for the whole set: histogram
calibrators (percentile, entropy) and any consumer that concatenates batches
need equal shapes.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from model_factory.errors import FactoryError, require
from model_factory.fileio import digest_path
from model_factory.recipe import QuantizationSpec

SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".npz")

# When no held-out file is given, every HELDOUT_EVERY-th calibration sample is held out.
HELDOUT_EVERY = 5

Feeds = dict[str, np.ndarray]


@dataclass(frozen=True)
class Samples:
    """Samples read from one file: either texts or tensors keyed by input name."""

    source: Path
    digest: str
    texts: tuple[str | tuple[str, str], ...] = ()  # (query, passage) tuples for a reranker's pairs
    tensors: Mapping[str, np.ndarray] | None = field(default=None, compare=False)

    @property
    def is_text(self) -> bool:
        return self.tensors is None

    @property
    def is_pairs(self) -> bool:
        """True for (query, passage) pairs."""
        return self.tensors is None and bool(self.texts) and isinstance(self.texts[0], tuple)

    def groups(self) -> list[str] | None:
        """The query of each pair (rerankers are scored per query); None for other samples."""
        return [q.strip() for q, _ in self.texts] if self.is_pairs else None

    def __len__(self) -> int:
        if self.tensors is None:
            return len(self.texts)
        return int(next(iter(self.tensors.values())).shape[0])

    def keys(self) -> list[str]:
        """One identity per sample, used to prove calibration and held-out sets are disjoint."""
        if self.tensors is None:
            return [t.strip() if isinstance(t, str) else "\0".join(x.strip() for x in t) for t in self.texts]
        names = sorted(self.tensors)
        out = []
        for i in range(len(self)):
            h = hashlib.sha256()
            for n in names:
                row = np.ascontiguousarray(self.tensors[n][i])
                h.update(n.encode() + b"\0" + str(row.shape).encode() + row.tobytes())
            out.append(h.hexdigest())
        return out

    def select(self, indices: Sequence[int]) -> "Samples":
        """A subset, in the given order (same source and file digest)."""
        idx = list(indices)
        if self.tensors is None:
            return Samples(self.source, self.digest, tuple(self.texts[i] for i in idx))
        return Samples(self.source, self.digest, (), {k: v[idx] for k, v in self.tensors.items()})


@dataclass(frozen=True)
class DataSplit:
    """Calibration samples (None when INT8 is not built) and held-out samples, disjoint."""

    calibration: Samples | None
    heldout: Samples
    note: str
    overlap: int = 0  # samples common to both sets after the split; always 0, recorded for the report


def read_samples(path: Path, what: str = "calibration data") -> Samples:
    """Read a .txt, .jsonl or .npz file of samples; every problem is a FactoryError naming the fix."""
    path = Path(path)
    if not path.is_file():
        raise FactoryError(f"{what}: {path} does not exist. Fix: point the recipe at a local .txt (one sample per "
                           "line), .jsonl (field \"text\") or .npz (input tensors) file")
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise FactoryError(f"{what}: {path} has the suffix {suffix!r}, which is not read. Fix: give a .txt (one "
                           "sample per line), .jsonl (field \"text\") or .npz (input tensors) file")
    digest = digest_path(path)
    if suffix == ".npz":
        samples = _read_npz(path, digest, what)
    else:
        texts = _read_txt(path, what) if suffix == ".txt" else _read_jsonl(path, what)
        samples = Samples(path, digest, tuple(texts))
    if len(samples) == 0:
        raise FactoryError(f"{what}: {path} holds no samples. Fix: add real inputs of the model, one per line "
                           "(or rows in the .npz arrays)")
    return samples


def _read_txt(path: Path, what: str) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise FactoryError(f"{what}: {path} is not UTF-8 text ({exc}). Fix: save it as UTF-8") from exc
    return [line.strip() for line in lines if line.strip()]


def _read_jsonl(path: Path, what: str) -> list[str | tuple[str, str]]:
    samples: list[str | tuple[str, str]] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise FactoryError(f"{what}: {path} is not UTF-8 text ({exc.reason} at byte {exc.start}). Fix: save it as "
                           "UTF-8") from exc
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise FactoryError(f"{what}: {path} line {n} is not JSON ({exc.msg}). Fix: write one JSON object "
                               "per line, e.g. {\"text\": \"...\"}") from exc
        except RecursionError:
            raise FactoryError(f"{what}: {path} line {n} nests JSON too deeply. Fix: write one flat JSON object "
                               "per line, e.g. {\"text\": \"...\"}") from None
        obj = obj if isinstance(obj, dict) else {}
        if "query" in obj or "passage" in obj:
            q, p = obj.get("query"), obj.get("passage")
            if not (isinstance(q, str) and q.strip() and isinstance(p, str) and p.strip()):
                raise FactoryError(f"{what}: {path} line {n} needs non-empty string fields \"query\" and "
                                   "\"passage\". Fix: write {\"query\": \"...\", \"passage\": \"...\"} on every line")
            sample: str | tuple[str, str] = (q.strip(), p.strip())
        else:
            text = obj.get("text")
            if not isinstance(text, str) or not text.strip():
                raise FactoryError(f"{what}: {path} line {n} has no non-empty string field \"text\". Fix: write "
                                   "{\"text\": \"...\"} on every line ({\"query\": ..., \"passage\": ...} for a "
                                   "reranker)")
            sample = text.strip()
        if samples and isinstance(samples[0], tuple) != isinstance(sample, tuple):
            raise FactoryError(f"{what}: {path} line {n} mixes single texts and query/passage pairs. Fix: give "
                               "one kind per file")
        samples.append(sample)
    return samples


def _read_npz(path: Path, digest: str, what: str) -> Samples:
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: np.asarray(z[k]) for k in z.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:  # a truncated or forged zip too
        raise FactoryError(f"{what}: cannot read {path} as .npz ({exc}). Fix: save it with "
                           "numpy.savez(path, input_ids=..., attention_mask=...)") from exc
    if not arrays:
        raise FactoryError(f"{what}: {path} holds no arrays. Fix: save one array per model input")
    counts = {k: (v.shape[0] if v.ndim else -1) for k, v in arrays.items()}
    if len(set(counts.values())) != 1 or -1 in counts.values():
        raise FactoryError(f"{what}: the arrays in {path} disagree on the number of samples (axis 0): {counts}. "
                           "Fix: stack the same samples on axis 0 of every array")
    return Samples(path, digest, (), arrays)


def split_data(spec: QuantizationSpec, need_calibration: bool) -> DataSplit:
    """Resolve the recipe's data into disjoint calibration and held-out sets.

    ``need_calibration`` is True when INT8 is built. Without a held-out file the
    calibration file is split deterministically (every 5th sample is held out).
    Held-out samples that also appear in the calibration file are dropped, so
    the accuracy report never scores data the ranges were fitted on.
    """
    if spec.calibration_data is None and spec.heldout_data is None:
        raise FactoryError(
            "quantization needs real data and the recipe gives none: the accuracy report compares against FP32 on "
            "held-out inputs, and INT8 calibrates its ranges on calibration inputs. Fix: set "
            "quantization.calibration_data (and ideally quantization.heldout_data) to a local .txt (one sample per "
            "line), .jsonl (field \"text\") or .npz (input tensors) file. Random inputs are never used")
    if need_calibration and spec.calibration_data is None:
        raise FactoryError("int8 needs calibration data and quantization.calibration_data is not set. Fix: point it "
                           "at a local .txt/.jsonl of representative inputs or an .npz of input tensors")
    calib = read_samples(spec.calibration_data, "quantization.calibration_data") if spec.calibration_data else None
    if spec.heldout_data is not None:
        held = read_samples(spec.heldout_data, "quantization.heldout_data")
        if calib is not None and (calib.is_text != held.is_text or calib.is_pairs != held.is_pairs):
            raise FactoryError("calibration_data and heldout_data are of different kinds (text, pairs or tensors). "
                               "Fix: give both as text (.txt/.jsonl), both as query/passage pairs (.jsonl) or both "
                               "as .npz")
        seen = set(calib.keys()) if calib is not None else set()
        keep = [i for i, k in enumerate(held.keys()) if k not in seen]
        dropped = len(held) - len(keep)
        if not keep:
            raise FactoryError(f"every held-out sample in {held.source} also appears in the calibration data. Fix: "
                               "give held-out data the ranges were not fitted on")
        held = held.select(keep)
        note = f"held-out file {held.source.name}"
        if dropped:
            note += f"; {dropped} sample(s) also in the calibration data were dropped"
    else:
        assert calib is not None
        if len(calib) < 2:
            raise FactoryError(f"{calib.source} has {len(calib)} sample; with no heldout_data it must be split into "
                               "calibration and held-out parts. Fix: add samples or set quantization.heldout_data")
        keys = calib.keys()
        held_idx = [i for i in range(len(calib)) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1] or [len(calib) - 1]
        held_keys = {keys[i] for i in held_idx}
        # A duplicate of a held-out sample may not stay in the calibration part.
        calib_idx = [i for i in range(len(calib)) if keys[i] not in held_keys]
        held = calib.select(held_idx)
        calib = calib.select(calib_idx)
        note = (f"no heldout_data: every {HELDOUT_EVERY}th sample of {calib.source.name} held out "
                f"({len(held)} held out, {len(calib)} calibrate)")
    if calib is not None:
        calib = calib.select(range(min(len(calib), spec.max_calibration_samples)))
    held = held.select(range(min(len(held), spec.max_heldout_samples)))
    overlap = len(set(held.keys()) & set(calib.keys())) if calib is not None else 0
    if overlap:  # pragma: no cover - guarded above; a failure here is a bug
        raise AssertionError("calibration and held-out sets overlap")
    return DataSplit(calib, held, note, overlap)


class InputEncoder:
    """Turns samples into model feeds: texts through the model's tokenizer, tensors checked and cast."""

    def __init__(self, input_types: Mapping[str, np.dtype], tokenizer_dir: Path | None, max_length: int) -> None:
        self.input_types = dict(input_types)
        self.tokenizer_dir = tokenizer_dir
        self.max_length = max_length
        self._tokenizer = None

    def _tok(self):  # noqa: ANN202 - a transformers tokenizer
        if self._tokenizer is None:
            if self.tokenizer_dir is None:
                raise FactoryError("the data is text but this model ships no tokenizer (only Hugging Face sources "
                                   "do). Fix: give calibration/held-out data as an .npz of input tensors keyed by "
                                   f"input name ({', '.join(self.input_types)})")
            transformers = require("transformers", "export")
            # Air-gapped: the tokenizer comes from the export folder, never from a hub.
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
            try:
                self._tokenizer = transformers.AutoTokenizer.from_pretrained(str(self.tokenizer_dir),
                                                                             local_files_only=True)
            except (OSError, ValueError) as exc:
                raise FactoryError(f"cannot load the tokenizer from {self.tokenizer_dir}: {exc}. Fix: re-run the "
                                   "export stage, which saves it next to model.onnx") from exc
        return self._tokenizer

    def encode(self, samples: Samples) -> Feeds:
        """All samples as one set of feeds, padded to a single sequence length."""
        if samples.is_text:
            return self._encode_texts(list(samples.texts))
        assert samples.tensors is not None
        missing = [n for n in self.input_types if n not in samples.tensors]
        if missing:
            raise FactoryError(f"{samples.source} lacks arrays for the model inputs {missing} (it has "
                               f"{sorted(samples.tensors)}). Fix: save one array per input, named as in the model")
        return {n: np.asarray(samples.tensors[n]).astype(t, copy=False) for n, t in self.input_types.items()}

    def _encode_texts(self, texts: list) -> Feeds:
        tok = self._tok()
        # padding=True pads every sample to the longest one: one length for the whole set.
        if texts and isinstance(texts[0], tuple):  # (query, passage) pairs, tokenized as pairs (token_type_ids)
            enc = tok([q for q, _ in texts], [p for _, p in texts], padding=True, truncation=True,
                      max_length=self.max_length, return_tensors="np")
        else:
            enc = tok(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="np")
        feeds: Feeds = {}
        for name, dtype in self.input_types.items():
            if name in enc:
                feeds[name] = np.asarray(enc[name]).astype(dtype, copy=False)
            elif name == "token_type_ids":
                feeds[name] = np.zeros_like(np.asarray(enc["input_ids"]), dtype=dtype)
            else:
                raise FactoryError(f"the tokenizer does not produce the model input {name!r} (it gives "
                                   f"{sorted(enc)}). Fix: give the data as an .npz of input tensors instead")
        return feeds


def batches(feeds: Feeds, batch_size: int) -> Iterator[Feeds]:
    """Consecutive slices of ``batch_size`` samples (the last one may be smaller)."""
    n = int(next(iter(feeds.values())).shape[0])
    for start in range(0, n, batch_size):
        yield {k: v[start:start + batch_size] for k, v in feeds.items()}


def sample_count(feeds: Feeds) -> int:
    return int(next(iter(feeds.values())).shape[0])


def input_types(session: Any) -> dict[str, np.dtype]:
    """``input name -> numpy dtype`` of an ONNX Runtime session's inputs (a type calibration cannot feed is refused)."""
    table = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
             "tensor(float16)": np.float16, "tensor(bool)": np.bool_, "tensor(int8)": np.int8,
             "tensor(uint8)": np.uint8, "tensor(double)": np.float64}
    out = {}
    for i in session.get_inputs():
        if i.type not in table:
            raise FactoryError(f"model input {i.name} has type {i.type}, which calibration cannot feed. Fix: keep "
                               "int8/fp16 out of the recipe for this model")
        out[i.name] = np.dtype(table[i.type])
    return out
