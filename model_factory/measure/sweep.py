"""``model-factory bench --sweep``: the same load generator over a range of concurrency.

One request stream (drawn once, seeded) is sent at each concurrency in turn. Each
point records the client's throughput and latency percentiles and, with the server's
metrics URL, what the model-factory backend did meanwhile: the padding ratio
(computed over real tokens), Triton's mean batch and the engine launches (groups)
per ``execute()`` window. The sweep is written as JSON (what ``model-factory report``
plots) and, optionally, as CSV for people who make their own charts.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
import os
import platform
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

from model_factory.errors import FactoryError
from model_factory.fileio import atomic_file

SWEEP_KIND = "model-factory bench sweep"
SWEEP_FORMAT = 1
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


@dataclass(frozen=True)
class SweepPoint:
    """One concurrency of a sweep."""

    concurrency: int
    throughput: float  # sequences answered per second
    p50_ms: float
    p99_ms: float
    mean_ms: float
    requests: int
    errors: int
    rejected: int
    seconds: float
    padding_ratio: float | None = None  # computed / real tokens (backend counters)
    mean_batch: float | None = None  # Triton's requests per model execution
    groups_per_window: float | None = None  # engine launches per execute() window (backend counters)
    # Texts over the model's limit the backend truncated (and the tokens it cut) or chunked (its counters;
    # None without them). Sent as ids, the texts were cut by the bench's tokenizer before the server saw them.
    truncated_texts: int | None = None
    truncated_tokens: int | None = None
    chunked_texts: int | None = None


def parse_concurrency(text: str) -> tuple[int, ...]:
    """``"1,8,32,64"`` → (1, 8, 32, 64): positive, distinct, in the order given."""
    try:
        values = tuple(int(v) for v in text.replace(" ", "").split(",") if v)
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values) or len(set(values)) != len(values):
        raise FactoryError(f"--sweep {text!r} is not a list of distinct positive concurrencies. Fix: e.g. "
                           "--sweep 1,8,32,64")
    return values


def machine() -> dict[str, Any]:
    """What the numbers were measured on: CPU, its SIMD flags, cores and the load averages at the start."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else (math.nan,) * 3
    return {"cpu": model, "cores": os.cpu_count(), "cpu_flags": [f for f in CPU_FLAGS if f in flags],
            "load_average": [round(x, 2) for x in load], "python": platform.python_version()}


def point_from(result: Any) -> SweepPoint:
    """A :class:`SweepPoint` from a :class:`model_factory.measure.bench.BenchResult`."""
    return SweepPoint(concurrency=result.concurrency, throughput=result.throughput, p50_ms=result.p50_ms,
                      p99_ms=result.p99_ms, mean_ms=result.mean_ms, requests=result.requests, errors=result.errors,
                      rejected=result.rejected, seconds=result.seconds, padding_ratio=result.padding_ratio,
                      mean_batch=result.mean_batch, groups_per_window=result.groups_per_window,
                      truncated_texts=result.truncated_texts, truncated_tokens=result.truncated_tokens,
                      chunked_texts=result.chunked_texts)


def run_sweep(url: str, model: str, texts_file: str | Path, concurrencies: Sequence[int], *, protocol: str = "http",
              requests: int = 500, warmup: int = 32, seed: int = 0, tokenizer_dir: str | Path | None = None,
              max_length: int = 128, metrics_url: str | None = None, output: str = "embedding",
              progress: Any = None) -> dict[str, Any]:
    """Run the stream at each concurrency; returns the sweep document (see :func:`write_sweep`)."""
    from model_factory.measure.bench import draw_texts, load_texts, load_tokenizer, make_payloads, run_load

    if not concurrencies:
        raise FactoryError("a sweep needs at least one concurrency. Fix: e.g. --sweep 1,8,32,64")
    header = {"kind": SWEEP_KIND, "format": SWEEP_FORMAT, "model": model, "url": url, "protocol": protocol,
              "send": "ids" if tokenizer_dir else "text", "requests": requests, "warmup": warmup, "seed": seed,
              "texts": str(texts_file), "metrics": bool(metrics_url),
              "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "machine": machine()}
    texts = draw_texts(load_texts(texts_file), requests, seed)
    tokenizer = load_tokenizer(tokenizer_dir, max_length) if tokenizer_dir else None
    payloads = make_payloads(texts, tokenizer)
    points = []
    for c in concurrencies:
        result = run_load(url, model, payloads, protocol=protocol, concurrency=c, warmup=warmup,
                          send="ids" if tokenizer is not None else "text", metrics_url=metrics_url, output=output)
        points.append(point_from(result))
        if progress is not None:
            progress(f"concurrency {c}: {result.throughput:.1f} seq/s, p99 {result.p99_ms:.1f} ms")
    return {**header, "points": [asdict(p) for p in points]}


def _json_number(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def write_sweep(doc: Mapping[str, Any], json_path: str | Path | None = None,
                csv_path: str | Path | None = None) -> None:
    """Write the sweep as JSON (the whole document) and/or CSV (one row per concurrency), atomically."""
    if json_path:
        clean = {**doc, "points": [{k: _json_number(v) for k, v in p.items()} for p in doc["points"]]}
        with atomic_file(Path(json_path)) as f:
            json.dump(clean, f, indent=2, allow_nan=False)
            f.write("\n")
    if csv_path:
        names = [f.name for f in fields(SweepPoint)]
        with atomic_file(Path(csv_path)) as f:
            writer = csv.DictWriter(f, fieldnames=["model", *names], lineterminator="\n")
            writer.writeheader()
            for p in doc["points"]:
                writer.writerow({"model": doc["model"], **{k: "" if p.get(k) is None else p[k] for k in names}})


def read_sweep(path: str | Path) -> dict[str, Any]:
    """A sweep document written by :func:`write_sweep` (checked: kind, format and points)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise FactoryError(f"cannot read the bench results {path}: {exc}. Fix: pass the file that "
                           "model-factory bench --sweep ... --json wrote") from exc
    if not isinstance(doc, dict) or doc.get("kind") != SWEEP_KIND or not isinstance(doc.get("points"), list):
        raise FactoryError(f"{path} is not a bench sweep. Fix: write one with model-factory bench --sweep 1,8,32,64 "
                           "--json FILE")
    if doc.get("format") != SWEEP_FORMAT:
        raise FactoryError(f"{path} is a bench sweep of format {doc.get('format')}; this version reads format "
                           f"{SWEEP_FORMAT}. Fix: re-run the sweep with this model-factory")
    names = {f.name for f in fields(SweepPoint)}
    try:
        points = [SweepPoint(**{k: v for k, v in p.items() if k in names}) for p in doc["points"]]
    except TypeError as exc:
        raise FactoryError(f"{path}: a sweep point is incomplete ({exc}). Fix: re-run the sweep") from exc
    return {**doc, "points": [asdict(p) for p in sorted(points, key=lambda p: p.concurrency)]}


def format_sweep(points: Sequence[Mapping[str, Any]]) -> str:
    """The sweep as an aligned text table."""
    def cell(value: object, fmt: str) -> str:
        return "n/a" if value is None else fmt.format(value)

    rows = [("conc.", "seq/s", "p50_ms", "p99_ms", "padding", "batch", "groups/win", "rejected", "errors")]
    rows += [(str(p["concurrency"]), cell(p["throughput"], "{:.1f}"), cell(p["p50_ms"], "{:.1f}"),
              cell(p["p99_ms"], "{:.1f}"), cell(p["padding_ratio"], "{:.3f}"), cell(p["mean_batch"], "{:.2f}"),
              cell(p["groups_per_window"], "{:.2f}"), str(p["rejected"]), str(p["errors"])) for p in points]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)
