"""benchmarks/bench_openai_embeddings: each precision's section between its own markers, the ratios per round, and
the INT8 section saying it is not like for like against infinity-emb's FP32."""

from __future__ import annotations

import argparse

from benchmarks import bench_openai_embeddings as be


def _turns() -> list[be.Turn]:
    out = []
    for r in (1, 2):
        for path, rate, cpu in (("kserve", 100.0, 8.0), ("openai", 95.0 + r, 8.8), ("infinity", 50.0, 16.0)):
            out.append(be.Turn("1 x 8", r, path, rate, 40.0, 90.0, 0, cpu))
    return out


def test_each_precision_has_its_own_section_and_the_ratios_per_round() -> None:
    args = argparse.Namespace(rounds=2, seconds=10.0, warmup=3.0, precision="fp32")
    fp32 = be._section(_turns(), args, "HEADER")
    assert fp32.startswith(be.START) and fp32.endswith(be.END)
    assert "| 1 x 8 | 96.5 | 100.0 | **0.965x** | 0.960-0.970x | 1.100x |" in fp32
    assert "| 1 x 8 | 96.5 | 50.0 | **1.93x** | 1.92-1.94x | 0.550x |" in fp32
    assert "not like for like" not in fp32
    args.precision = "int8"
    int8 = be._section(_turns(), args, "HEADER", ", its gate: mean cosine 0.99312")
    start, end = be._markers("int8")
    assert (start, end) == ("<!-- openai_embeddings_int8:start -->", "<!-- openai_embeddings_int8:end -->")
    assert int8.startswith(start) and int8.endswith(end) and be.START not in int8
    assert "MiniLM INT8 (the factory's build of the example recipe, its gate: mean cosine 0.99312" in int8
    assert "ours INT8 against its FP32, not like for like" in int8
    # A run on another machine kept beside the first: its own markers and title.
    args.precision, args.section_suffix = "fp32", "epyc"
    epyc = be._section(_turns(), args, "HEADER")
    assert be._markers("fp32", "epyc") == ("<!-- openai_embeddings-epyc:start -->", "<!-- openai_embeddings-epyc:end -->")
    assert epyc.startswith("<!-- openai_embeddings-epyc:start -->") and be.START not in epyc
    assert "against the KServe path (epyc) (benchmarks" in epyc
