"""The soak in short (CI): a few thousand requests at fixed concurrency, text and token ids mixed. Checks
what does not depend on time: no errors, no stub restarted, descriptors and threads as after warm-up."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_short_soak_has_no_errors_no_stub_restarts_and_flat_descriptors(triton, minilm_export) -> None:
    from pathlib import Path

    from model_factory.measure import bench
    from benchmarks.harness import soak

    texts = bench.draw_texts(bench.load_texts(Path(__file__).resolve().parents[2] / "benchmarks" / "texts.txt"),
                             500, seed=1)
    payloads = bench.make_payloads(texts, bench.load_tokenizer(minilm_export.tokenizer_dir, 128))
    args = (triton.grpc_url, "minilm", payloads, triton.process.pid, triton.served_repository)
    soak.run_soak(*args, concurrency=8, requests=100, sample_s=60)  # warm-up: connections, threads, caches
    report = soak.run_soak(*args, concurrency=8, requests=1000, sample_s=2)
    assert report.requests == 1000 and report.sent_text == report.sent_ids == 500
    assert len(report.samples) >= 2
    # A socket may be open for a moment (a connection being set up or torn down): two descriptors of slack.
    verdict = {name: (ok, detail) for name, ok, detail in soak.judge(report, warmup_s=0, fd_slack=2,
                                                                    thread_slack=2).checks}
    for name in ("errors", "stub restarts", "descriptors flat"):
        assert verdict[name][0], f"{name}: {verdict[name][1]}"
    assert report.rejected == 0
