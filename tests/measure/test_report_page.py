"""The report and the sweep files without a browser: inputs refused with a fix, a bare version, the sweep's files."""

from __future__ import annotations

import json

import pytest

from model_factory.errors import FactoryError


def _doc(points):
    from model_factory.measure.sweep import SWEEP_FORMAT, SWEEP_KIND

    return {"kind": SWEEP_KIND, "format": SWEEP_FORMAT, "model": "minilm", "protocol": "http", "send": "ids",
            "requests": 10, "machine": {}, "points": points}


def _point(c, **more):
    return {"concurrency": c, "throughput": 10.0 * c, "p50_ms": 1.5, "p99_ms": 2.0 + c, "mean_ms": 1.6,
            "requests": 10, "errors": 0, "rejected": 0, "seconds": 1.0, **more}


def test_parse_concurrency():
    from model_factory.measure.sweep import parse_concurrency

    assert parse_concurrency("1,8, 32,64") == (1, 8, 32, 64)
    for bad in ("", "0,1", "1,1", "a,2", "-4"):
        with pytest.raises(FactoryError, match="Fix: e.g. --sweep 1,8,32,64"):
            parse_concurrency(bad)


def test_sweep_json_and_csv_round_trip(tmp_path):
    from model_factory.measure.sweep import format_sweep, read_sweep, write_sweep

    doc = _doc([_point(8, padding_ratio=1.25, groups_per_window=2.0), _point(1, padding_ratio=None)])
    write_sweep(doc, tmp_path / "s.json", tmp_path / "s.csv")
    back = read_sweep(tmp_path / "s.json")
    assert [p["concurrency"] for p in back["points"]] == [1, 8]  # sorted by concurrency
    assert back["points"][1]["padding_ratio"] == 1.25 and back["points"][0]["groups_per_window"] is None
    rows = (tmp_path / "s.csv").read_text().splitlines()
    assert rows[0].startswith("model,concurrency,throughput,p50_ms,p99_ms") and len(rows) == 3
    assert rows[1].split(",")[:3] == ["minilm", "8", "80.0"]
    table = format_sweep(back["points"])
    assert "n/a" in table and "1.250" in table


def test_sweep_files_that_are_not_sweeps_are_refused(tmp_path):
    from model_factory.measure.sweep import read_sweep

    (tmp_path / "other.json").write_text(json.dumps({"runs": []}))
    with pytest.raises(FactoryError, match="is not a bench sweep. Fix"):
        read_sweep(tmp_path / "other.json")
    (tmp_path / "new.json").write_text(json.dumps(_doc([]) | {"format": 99}))
    with pytest.raises(FactoryError, match="format 99"):
        read_sweep(tmp_path / "new.json")
    with pytest.raises(FactoryError, match="cannot read the bench results"):
        read_sweep(tmp_path / "missing.json")


def test_report_inputs_are_checked(tmp_path):
    from model_factory.measure.report import ReportInputs, render

    with pytest.raises(FactoryError, match="does not exist. Fix"):
        render(ReportInputs(tmp_path / "nowhere"))
    (tmp_path / "repo").mkdir()
    with pytest.raises(FactoryError, match="holds no model folder"):
        render(ReportInputs(tmp_path / "repo"))


def test_a_bare_fp32_version_says_what_it_lacks(tmp_path, minilm_recipe, minilm_export):
    """Unsigned, FP32 only, no engine, no bench: each section says so instead of failing."""
    from dataclasses import replace

    from model_factory.build.repository import package_model
    from model_factory.measure.report import ReportInputs, collect, render

    recipe = replace(minilm_recipe, repository=replace(minilm_recipe.repository, path=tmp_path / "repo"))
    package_model(recipe, {"model.onnx": minilm_export.onnx_path}, tokenizer_dir=minilm_export.tokenizer_dir,
                  parameters={"cost_model": "0.002,1e-6,1e-9"})
    with pytest.raises(FactoryError, match="has no model 'other'"):
        collect(ReportInputs(tmp_path / "repo", model="other"))
    html = render(ReportInputs(tmp_path / "repo"))
    for text in ('data-k="no-engines">No engines built', 'data-k="accuracy-absent"', 'data-k="unsigned"',
                 'data-k="no-bench"', 'data-k="acceptance">not run'):
        assert text in html, text
    assert "<script" not in html and "http://" not in html.replace("http://www.w3.org", "")


def test_groups_per_window_from_the_backend_counters():
    from model_factory.measure import bench

    def scrape(groups, windows):
        return bench.parse_prometheus(
            f'model_factory_groups_total{{instance="minilm_0",model="minilm"}} {groups}\n'
            f'model_factory_executions_total{{instance="minilm_0",model="minilm"}} {windows}\n'
            f'model_factory_groups_total{{instance="minilm_1",model="minilm"}} {groups}\n'
            f'model_factory_executions_total{{instance="minilm_1",model="minilm"}} {windows}\n')

    d = bench.counter_deltas(scrape(10, 8), scrape(40, 18), "minilm")
    assert (d["groups"], d["windows"]) == (60, 20)  # summed over the instances
    r = bench.with_counters(bench.summarize([0.01], 0, 1.0), **d)
    assert r.groups_per_window == 3.0
    assert bench.summarize([0.01], 0, 1.0).groups_per_window is None
    merged = bench.merge_results([r, r])
    assert (merged.groups, merged.windows) == (120, 40)


def test_against_names_a_breaking_contract_change_and_a_rebuild_has_none(tmp_path, minilm_recipe, minilm_export):
    """--against shows `contract diff`'s verdict: a retrained tokenizer is named as breaking, a rebuild is not."""
    from contract_versions import package_version, retrained_tokenizer

    from model_factory.build.data_contract import diff_contracts, load_contract
    from model_factory.measure.report import ReportInputs, render

    old = package_version(minilm_recipe, minilm_export, tmp_path / "old")
    rebuild = package_version(minilm_recipe, minilm_export, tmp_path / "rebuild")
    retrained = package_version(minilm_recipe, minilm_export, tmp_path / "retrained",
                                tokenizer_dir=retrained_tokenizer(minilm_export.tokenizer_dir, tmp_path / "tok"))
    expected = [c.what for c in diff_contracts(load_contract(old), load_contract(retrained)) if c.breaking]
    assert expected  # the library function the report reuses finds the break

    html = render(ReportInputs(tmp_path / "retrained", against=tmp_path / "old"))
    assert f'data-k="contract-breaking-count">{len(expected)} breaking change(s)' in html
    assert f'data-k="summary-contract">{len(expected)} breaking' in html
    for what in expected:
        assert f'<span class="tag removed bad">BREAKING</span> <span data-k="contract-change">{escape(what)}</span>' \
            in html, what
    assert "golden text &#39;A man is playing a guitar.&#39; is tokenized differently" in html

    html = render(ReportInputs(tmp_path / "rebuild", against=tmp_path / "old"))
    assert 'data-k="contract-verdict"><span class="ok">no breaking change</span>: the same contract' in html
    assert 'data-k="summary-contract">no breaking change' in html and "BREAKING" not in html
    # The inputs section states the long-input policy the contract records.
    assert 'data-k="long-inputs">refuse</code>: a text over the limit is answered 400' in html
    assert 'data-k="max-sequence-length">128<' in html
    assert 'data-k="truncations-none"' in html  # no bench given: no counts, and it says so


def test_the_speed_and_inputs_sections_show_the_sweeps_truncation_counts(tmp_path, minilm_recipe, minilm_export):
    from contract_versions import package_version

    from model_factory.measure.report import ReportInputs, render
    from model_factory.measure.sweep import write_sweep

    package_version(minilm_recipe, minilm_export, tmp_path / "repo")
    doc = _doc([_point(1, truncated_texts=2, truncated_tokens=310, chunked_texts=0),
                _point(8, truncated_texts=3, truncated_tokens=95, chunked_texts=0)]) | {"send": "text"}
    write_sweep(doc, tmp_path / "sweep.json")
    html = render(ReportInputs(tmp_path / "repo", bench=tmp_path / "sweep.json"))
    assert 'data-k="truncated-texts">5<' in html and 'data-k="truncated-tokens">405<' in html
    assert 'data-k="speed:truncated">3<' in html and 'data-k="speed:truncated-tokens">310<' in html
    # Sent as ids, the bench's tokenizer cut the texts: the page says the server saw none, not "0 truncated".
    write_sweep(_doc([_point(1)]), tmp_path / "ids.json")
    html = render(ReportInputs(tmp_path / "repo", bench=tmp_path / "ids.json"))
    assert 'data-k="truncations-ids"' in html and 'data-k="truncated-texts"' not in html


def escape(text: str) -> str:
    from markupsafe import escape as _escape

    return str(_escape(text))


def test_the_accuracy_section_says_which_precision_keeps_its_kv_cache_in_int8(tmp_path):
    """accuracy.json as the generative quantize stage writes it: a row with kv_cache "int8" is named so in the
    report's table (and its plot), the others not."""
    from types import SimpleNamespace

    from model_factory.build_engines.lm_quantize import GenerativeAccuracy, GenerativeResult
    from model_factory.measure.report.accuracy import collect
    from model_factory.measure.report.page import environment

    rows = (GenerativeResult("int8", "dynamic", 0.95, 10.0, 10.0, 1.0, 0.5, 8, 64, True),
            GenerativeResult("int4", "awq", 0.85, 10.1, 10.0, 1.01, 2.0, 8, 64, True, kv_cache="int8"))
    GenerativeAccuracy(model="m", heldout_source="h.txt", heldout_samples=8, heldout_note="held-out file h.txt",
                       calibration_source="c.txt", calibration_samples=4, min_accuracy=0.8, max_perplexity_ratio=1.1,
                       results=rows).write(tmp_path / "accuracy.json")
    acc = collect(SimpleNamespace(read_json=lambda name: json.loads((tmp_path / name).read_text())))
    assert {r.precision: r.kv_cache for r in acc.rows} == {"int8": "float", "int4": "int8"}
    html = environment().get_template("_accuracy.html.j2").render(v=SimpleNamespace(anchor="m", accuracy=acc))
    assert 'data-k="acc:int4:kv">(KV cache INT8)' in html and 'data-k="acc:int8:kv"' not in html
    assert "INT4 (KV INT8)" in acc.score_plot
