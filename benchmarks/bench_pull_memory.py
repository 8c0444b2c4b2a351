"""Peak memory of ``pull`` against the size of the layer it downloads: streamed to disk, so bounded.

    .venv/bin/python benchmarks/bench_pull_memory.py           # ~2 min on 2 cores, writes RESULTS.md
    .venv/bin/python benchmarks/bench_pull_memory.py --quick   # 64 MiB and 256 MiB only, RESULTS.md untouched

A signed model whose weight file is sparse (no disk here, zeros on the wire, a marker at its end) is pushed to
the real registry of the tests (Debian's docker-registry, TLS, htpasswd: tests/distribution/registry_helpers.py),
then pulled (fetched, verified, placed) in a child process whose peak resident memory (``VmHWM``) is read.
The section between ``<!-- pullmem:start -->`` and ``<!-- pullmem:end -->`` of RESULTS.md is replaced.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "distribution"))
sys.path.insert(0, str(HERE.parent / "tests" / "signing"))
from results_file import machine_header, publish, say  # noqa: E402

START, END = "<!-- pullmem:start -->", "<!-- pullmem:end -->"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args()
    sizes_mib = [64, 256] if args.quick else [64, 512, 2048]

    from cryptography.hazmat.primitives.asymmetric import ec
    from registry_helpers import start_registry, stop_registry
    from signing_helpers import build_model, write_key, write_pub
    from test_large_layer import pull_peak_rss_mib

    from model_factory.distribution.push_pull import push
    from model_factory.distribution.registry import RegistryOptions
    from model_factory.signing import SignerConfig, sign_model_version

    work = Path(tempfile.mkdtemp(prefix="bench-pull-mem-"))
    reg = start_registry(work / "registry")
    rows = []
    try:
        key = ec.generate_private_key(ec.SECP256R1())
        priv, pub = write_key(key, work / "k.pem"), write_pub(key, work / "k.pub")
        policy = work / "policy.toml"
        policy.write_text(f'version = 1\n[[keys]]\nname = "release"\npath = "{pub}"\n')
        options = RegistryOptions(config=reg.config, ca_file=reg.ca)
        for mib in sizes_mib:
            repo = work / f"repo{mib}"
            build_model(repo / "big", (1,))
            size = (mib << 20) + 12345
            with open(repo / "big" / "1" / "model.onnx.data", "wb") as f:
                f.truncate(size - 16)
                f.seek(size - 16)
                f.write(b"end-of-weights!!")
            sign_model_version(repo / "big", 1, SignerConfig(priv))
            ref = f"oci://{reg.host}/bench/big{mib}:1"
            t0 = time.perf_counter()
            push(repo, "big", ref, options=options)
            pushed = time.perf_counter() - t0
            t0 = time.perf_counter()
            peak = pull_peak_rss_mib(ref, work / f"dest{mib}", policy, options)
            pulled = time.perf_counter() - t0
            placed = work / f"dest{mib}" / "big" / "1" / "model.onnx.data"
            assert placed.stat().st_size == size
            rows.append((mib, peak, pushed, pulled))
            say(f"{mib} MiB layer: pull peak RSS {peak:.0f} MiB, push {pushed:.1f} s, pull {pulled:.1f} s")
            shutil.rmtree(repo)
            shutil.rmtree(work / f"dest{mib}")
    finally:
        stop_registry(reg)
        shutil.rmtree(work, ignore_errors=True)
    lines = [START, "## Pull: peak memory against layer size (benchmarks/bench_pull_memory.py)", "", machine_header(),
             "", "One signed model with one large weight layer, pushed to the real registry (docker-registry 2.8, "
             "TLS, htpasswd) and pulled — fetched, verified, placed — in a child process; its peak RSS "
             "(`VmHWM` of /proc/self/status, the interpreter and libraries included: `ru_maxrss` would report "
             "the forking parent's peak, which Linux carries across exec).", "",
             "| layer | pull peak RSS | push s | pull s |", "| --- | --- | --- | --- |"]
    lines += [f"| {mib} MiB | {peak:.0f} MiB | {pushed:.1f} | {pulled:.1f} |" for mib, peak, pushed, pulled in rows]
    spread = max(r[1] for r in rows) - min(r[1] for r in rows)
    lines += ["", f"Peak RSS moves by {spread:.0f} MiB from the smallest layer to the largest "
              f"({rows[-1][0] // rows[0][0]}x the bytes): downloads stream in 1 MiB chunks to a `.part` file and the "
              "status check never reads a successful body (tests/distribution/test_large_layer.py bounds it at "
              "400 MiB for 2 GiB).", END]
    publish("\n".join(lines), args.results, START, END, write=not args.quick)


if __name__ == "__main__":
    main()
