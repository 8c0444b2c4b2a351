"""Hashing speed: model-factory's parallel sha256 against plain hashlib, on the same bytes.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_hashing.py            # 1 GiB, writes RESULTS.md
    PYTHONPATH=. .venv/bin/python benchmarks/bench_hashing.py --size-mib 64 --no-write   # a quick look

The file set looks like a model repository: three large files (1/2, 1/4 and
1/8 of the total, like engines and ONNX files) and 1 MiB files for the
remaining eighth. It is read once before timing, so every method hashes from
the page cache (what a verify right after a build sees); disk speed is not
measured. Methods run in turn, ``--repeat`` times; the median counts, with the range beside it.

* ``hashlib``: one ``hashlib.file_digest(f, "sha256")`` per file, in sequence.
* ``model-factory``: ``digests.hash_tasks`` (threads across files, read-ahead
  inside large files) — what sign and verify use.
* ``model_signing``: ``model_signing.hashing.Config().hash(folder)``, when installed.

The digests of all methods are compared, so a fast wrong answer fails the run.
The result replaces the section between ``<!-- hashing:start -->`` and
``<!-- hashing:end -->`` in benchmarks/RESULTS.md, leaving other sections alone.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import platform
import shutil
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file.py is beside this script
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.harness
import results_file  # noqa: E402
from benchmarks.harness.run_header import cpu_model  # noqa: E402

from model_factory.signing.digests import default_workers, file_tasks, hash_tasks

MIB = 1 << 20
START, END = "<!-- hashing:start -->", "<!-- hashing:end -->"


def make_file_set(folder: Path, size_mib: int) -> dict[str, int]:
    """Write the file set (random bytes); returns relpath -> size."""
    sizes = {"1/model.fp32.plan": size_mib // 2, "1/model.onnx": size_mib // 4, "1/model.int8.onnx": size_mib // 8}
    small = size_mib - sum(sizes.values())
    sizes.update({f"1/shards/part-{i:04d}.bin": 1 for i in range(small)})
    for rel, mib in sizes.items():
        p = folder / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as f:
            for _ in range(mib):
                f.write(os.urandom(MIB))
    return {rel: mib * MIB for rel, mib in sizes.items()}


def plain_hashlib(folder: Path, rels: list[str]) -> dict[str, str]:
    out = {}
    for rel in rels:
        with open(folder / rel, "rb") as f:
            out[rel] = hashlib.file_digest(f, "sha256").hexdigest()
    return out


def ours(folder: Path, rels: list[str]) -> dict[str, str]:
    return hash_tasks(file_tasks(folder, rels))


def model_signing_hash(folder: Path, rels: list[str]) -> dict[str, str]:
    import model_signing

    manifest = model_signing.hashing.Config().hash(folder)
    return {rd.identifier: rd.digest.digest_hex for rd in manifest.resource_descriptors()}


def time_methods(methods: dict[str, Callable], folder: Path, rels: list[str], repeat: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in methods}
    reference = None
    for fn in methods.values():
        fn(folder, rels)  # untimed: imports, thread start-up, page cache
    for _ in range(repeat):
        for name, fn in methods.items():
            t0 = time.perf_counter()
            digests = fn(folder, rels)
            times[name].append(time.perf_counter() - t0)
            subset = {r: digests[r] for r in rels}
            if reference is None:
                reference = subset
            elif subset != reference:
                raise SystemExit(f"{name} computed different digests: the benchmark is void")
    return times


def render(size_mib: int, n_files: int, scenarios: list[tuple[str, int, dict[str, list[float]]]],
           load: tuple[float, float] = (0.0, 0.0)) -> str:
    lines = [
        START,
        "## Hashing (sign / verify)",
        "",
        f"`benchmarks/bench_hashing.py`, {time.strftime('%Y-%m-%d')}: {cpu_model()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, {ssl.OPENSSL_VERSION}; {default_workers()} hashing threads. "
        "Files are in the page cache; median of the runs, with the range (fastest–slowest) in brackets. "
        "Ratio = hashlib median time / method median time (above 1 is faster than plain hashlib). "
        f"Load average (1 min) before / after the timed runs: {load[0]:.2f} / {load[1]:.2f} ("
        + ("other work shared the cores, which lowers the parallel speed-up" if max(load) > (os.cpu_count() or 1)
           else "no sign of other work on the cores") + ").",
        "",
        "| scenario | method | median s (range) | GiB/s at the median | ratio vs hashlib |",
        "|---|---|---|---|---|",
    ]
    for label, nbytes, times in scenarios:
        base = statistics.median(times["hashlib"])
        for name, ts in times.items():
            mid = statistics.median(ts)
            lines.append(f"| {label} | {name} | {mid:.3f} ({min(ts):.3f}–{max(ts):.3f}) | "
                         f"{nbytes / mid / (1 << 30):.2f} | {base / mid:.2f} |")
    lines += [
        "",
        "Digest scheme: one plain sha256 per file (model_signing v1.0 \"files\", its default), so a single file is "
        "one sequential hash chain: parallelism is across files, and inside a large file only the reads overlap "
        f"the hashing. On the whole set ({n_files} files, {size_mib} MiB) threads use every core; on one large "
        "file the ceiling is one core's sha256 speed.",
        END,
    ]
    return "\n".join(lines)


def write_section(path: Path, section: str) -> None:
    """Replace this benchmark's section of RESULTS.md; other sections stay as they are."""
    results_file.write_section(path, START, END, section)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024, help="total size of the file set (default 1024)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where to write the files (default: a temp folder)")
    ap.add_argument("--results", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    ap.add_argument("--no-write", action="store_true", help="print only, do not update RESULTS.md")
    ap.add_argument("--no-model-signing", action="store_true", help="leave model_signing out")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="mf-bench-hash-", dir=args.dir))
    try:
        print(f"writing {args.size_mib} MiB to {work} ...", flush=True)
        sizes = make_file_set(work, args.size_mib)
        rels = sorted(sizes)
        methods: dict[str, Callable] = {"hashlib": plain_hashlib, "model-factory": ours}
        if not args.no_model_signing and importlib.util.find_spec("model_signing") is not None:
            methods["model_signing"] = model_signing_hash
        load_before = os.getloadavg()[0]
        whole = time_methods(methods, work, rels, args.repeat)
        largest = max(rels, key=lambda r: sizes[r])
        single = time_methods({"hashlib": plain_hashlib, "model-factory": ours}, work, [largest], args.repeat)
        scenarios = [(f"{len(rels)} files, {args.size_mib} MiB", sum(sizes.values()), whole),
                     (f"1 file, {sizes[largest] // MIB} MiB", sizes[largest], single)]
        section = render(args.size_mib, len(rels), scenarios, (load_before, os.getloadavg()[0]))
        print(section)
        if not args.no_write:
            write_section(args.results, section)
            print(f"updated {args.results}")
        ratio = statistics.median(whole["hashlib"]) / statistics.median(whole["model-factory"])
        print(f"model-factory / hashlib speed ratio on the file set (medians): {ratio:.2f}")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
