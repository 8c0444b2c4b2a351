"""The hashing benchmark: it runs, compares digests, and rewrites only its own RESULTS.md section."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_hashing.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_hashing", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_small_run_writes_its_section_only(bench, tmp_path, capsys):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n<!-- batching:start -->\nother team's numbers\n<!-- batching:end -->\n")
    assert bench.main(["--size-mib", "8", "--repeat", "1", "--no-model-signing", "--dir", str(tmp_path),
                       "--results", str(results)]) == 0
    first = results.read_text()
    assert "other team's numbers" in first and first.count(bench.START) == 1
    assert "| 4 files, 8 MiB | hashlib |" in first and "| 4 files, 8 MiB | model-factory |" in first
    bench.main(["--size-mib", "8", "--repeat", "1", "--no-model-signing", "--dir", str(tmp_path),
                       "--results", str(results)])
    second = results.read_text()
    assert second.count(bench.START) == 1 and second.count(bench.END) == 1
    assert second.startswith("# Benchmark results\n\n<!-- batching:start -->\nother team's numbers")
    assert not list(tmp_path.glob("mf-bench-hash-*"))  # the file set is removed
    assert "speed ratio on the file set" in capsys.readouterr().out
