"""The release report in a real browser: headless Chromium opens it offline and the page is read back.

Every number checked here is read from the rendered DOM (``data-k`` cells), never from
the generator, and compared with the files it must come from: accuracy.json,
metadata.json, the .plan.json sidecar, the signature bundle and the sweep JSON.
"""

from __future__ import annotations

import io
import json

import pytest
from chromium_cdp import chromium_binary, visit_page
from click.testing import CliRunner

pytestmark = [pytest.mark.slow, pytest.mark.skipif(chromium_binary() is None,
                                                   reason="chromium not installed (scripts/setup.sh installs it)")]

READ_PAGE = """JSON.stringify({
  sections: [...document.querySelectorAll('section.card')].map(s => s.id),
  values: [...document.querySelectorAll('[data-k]')].map(e => {
    const tr = e.closest('tr'), sec = e.closest('section.card');
    return {k: e.dataset.k, text: e.textContent.trim(), section: sec ? sec.id : null,
            row: tr ? Object.assign({}, tr.dataset) : {}};
  }),
  plots: [...document.querySelectorAll('figure svg')].map(s => {
    const r = s.getBoundingClientRect();
    return {figure: s.closest('figure').className, x: r.x + scrollX, y: r.y + scrollY, w: r.width, h: r.height,
            texts: [...s.querySelectorAll('text')].map(t => t.textContent.trim())};
  }),
  scripts: document.scripts.length,
  links: [...document.querySelectorAll('[src],[href]')].map(e => e.getAttribute('src') || e.getAttribute('href')),
})"""


def _values(page, section, k, **row):
    """Texts of the ``data-k = k`` cells in a section (optionally in the table row with these data-*)."""
    return [v["text"] for v in page["values"] if v["section"] == section and v["k"] == k
            and all(v["row"].get(a) == b for a, b in row.items())]


def _one(page, section, k, **row):
    found = _values(page, section, k, **row)
    assert len(found) == 1, (section, k, row, found)
    return found[0]


def _num(text):
    return float(text.replace(",", "").replace("+", ""))


@pytest.fixture(scope="module")
def rendered(release_a, release_b, sweep_a, tmp_path_factory):
    """The report of release A (bench, policy, acceptance run here, against B), written by the CLI and opened."""
    from model_factory.cli.report import report

    out = tmp_path_factory.mktemp("report") / "report.html"
    result = CliRunner().invoke(report, [str(release_a.repo), "--bench", str(sweep_a), "--policy",
                                         str(release_a.policy), "--accept", "--against", str(release_b.repo),
                                         "-o", str(out)])
    assert result.exit_code == 0, result.output
    visit = visit_page(out, READ_PAGE)
    return out, visit, json.loads(visit.data)


def test_the_page_opens_offline_without_errors_or_requests(rendered):
    out, visit, page = rendered
    assert visit.requests == [out.resolve().as_uri()]  # the page itself, nothing else
    assert visit.errors == [] and visit.console == []
    assert page["scripts"] == 0
    assert all(link.startswith("#") for link in page["links"]), page["links"]


def test_every_section_and_plot_is_drawn(rendered):
    _, visit, page = rendered
    a = "minilm-v1"
    assert page["sections"] == [f"{a}-built", f"{a}-inputs", f"{a}-accuracy", f"{a}-engines", f"{a}-trust", f"{a}-speed",
                                f"{a}-changes"]
    figures = {p["figure"]: p for p in page["plots"]}
    assert set(figures) == {"plot-accuracy", "plot-sensitivity", "plot-speed", "plot-batching"}
    assert "INT8" in figures["plot-accuracy"]["texts"] and "c=4" in figures["plot-speed"]["texts"]
    import matplotlib.image as mpimg

    shot = mpimg.imread(io.BytesIO(visit.screenshot), format="png")[..., :3]
    for name, p in figures.items():
        assert p["w"] > 300 and p["h"] > 80, (name, p)
        region = shot[int(p["y"]):int(p["y"] + p["h"]), int(p["x"]):int(p["x"] + p["w"])]
        assert region.shape[0] > 50, name  # the figure lies within the full-page screenshot
        inked = (region.min(axis=2) < 0.6).mean()  # share of clearly drawn (non-background) pixels
        assert 0.01 < inked < 0.6, (name, inked)


def test_built_and_engine_numbers_equal_the_files(rendered, release_a):
    _, _, page = rendered
    meta = json.loads((release_a.version_dir / "metadata.json").read_text())
    sec = "minilm-v1-built"
    assert _one(page, sec, "source-digest") == meta["build"]["source_digest"]
    assert _one(page, sec, "precisions") == ", ".join(meta["precisions"])
    assert _one(page, sec, "served") == meta["serve"]["precision"] == "int8"
    for name in ("model.onnx", "model.int8.onnx", "model.int8.plan"):
        assert _num(_one(page, sec, f"size:{name}", file=name)) == (release_a.version_dir / name).stat().st_size
    plan = json.loads((release_a.version_dir / "model.int8.plan.json").read_text())
    sec = "minilm-v1-engines"
    assert _num(_one(page, sec, "engine:bytes", plan="model.int8.plan")) == plan["plan_bytes"]
    assert _num(_one(page, sec, "engine:seconds", plan="model.int8.plan")) == plan["build_seconds"]
    assert _one(page, sec, "engine:builder", plan="model.int8.plan") == f"{plan['flavour']} {plan['version']}"
    device = plan["device"]["name"] if isinstance(plan["device"], dict) else plan["device"]  # GPU, or ahead of time
    assert _one(page, sec, "engine:device", plan="model.int8.plan").startswith(device)


def test_accuracy_numbers_equal_accuracy_json(rendered, release_a):
    _, _, page = rendered
    report = json.loads((release_a.version_dir / "accuracy.json").read_text())
    sec = "minilm-v1-accuracy"
    assert _num(_one(page, sec, "gate")) == report["min_accuracy"]
    for r in report["results"]:
        assert _num(_one(page, sec, f"acc:{r['precision']}:score", precision=r["precision"])) == \
            pytest.approx(r["score"], abs=5e-7)
        assert _num(_one(page, sec, f"acc:{r['precision']}:min", precision=r["precision"])) == \
            pytest.approx(r["min_cosine"], abs=5e-7)
    int8 = next(r for r in report["results"] if r["precision"] == "int8")
    gain = next(s["gain"] for s in report["search"] if s["step"] == "sensitivity") if int8["float_nodes"] else {}
    assert _num(_one(page, sec, "kept-count")) == len(int8["float_nodes"])
    for node in int8["float_nodes"]:  # each kept layer with the sensitivity the search measured
        assert _num(_one(page, sec, "kept:sensitivity", node=node)) == pytest.approx(gain[node], abs=5e-7)


def test_trust_numbers_equal_the_signature(rendered, release_a):
    from model_factory.signing.bundle import parse_bundle
    from model_factory.signing.manifest import parse_statement

    _, _, page = rendered
    bundle = parse_bundle((release_a.model_dir / "1.sig").read_bytes())
    manifest = parse_statement(bundle.statement())
    sec = "minilm-v1-trust"
    assert _one(page, sec, "key-hint") == bundle.key_hint
    assert _one(page, sec, "root-digest") == manifest.root_digest
    assert _num(_one(page, sec, "signed-files")) == len(manifest.files())
    assert _one(page, sec, "verdict") == "verified" and _one(page, sec, "verdict-signer") == "key:key-a"
    meta = json.loads((release_a.version_dir / "metadata.json").read_text())
    assert _one(page, sec, "dep:calibration-data", dependency="calibration-data") == \
        meta["build"]["quantization"]["calibration_digest"]
    assert _one(page, sec, "acceptance") == "passed" and 0.99 <= _num(_one(page, sec, "acceptance-score")) <= 1


def test_speed_numbers_equal_the_sweep(rendered, sweep_a):
    _, _, page = rendered
    sweep = json.loads(sweep_a.read_text())
    sec = "minilm-v1-speed"
    assert [p["concurrency"] for p in sweep["points"]] == [1, 4]
    for p in sweep["points"]:
        c = str(p["concurrency"])
        assert _num(_one(page, sec, "speed:throughput", concurrency=c)) == pytest.approx(p["throughput"], abs=0.005)
        assert _num(_one(page, sec, "speed:p99", concurrency=c)) == pytest.approx(p["p99_ms"], abs=0.005)
        assert _num(_one(page, sec, "speed:padding", concurrency=c)) == pytest.approx(p["padding_ratio"], abs=5e-4)
        assert _num(_one(page, sec, "speed:groups", concurrency=c)) == pytest.approx(p["groups_per_window"], abs=5e-3)


def test_against_shows_the_accuracy_and_file_differences(rendered, release_a, release_b):
    _, _, page = rendered
    sec = "minilm-v1-changes"
    new = json.loads((release_a.version_dir / "accuracy.json").read_text())
    old = json.loads((release_b.version_dir / "accuracy.json").read_text())
    score = {r["precision"]: r["score"] for r in new["results"]}
    before = {r["precision"]: r["score"] for r in old["results"]}
    assert score["int8"] != before["int8"]  # other calibration data, another INT8 model
    what = "int8 cosine"
    assert _num(_one(page, sec, "old", what=what)) == pytest.approx(before["int8"], abs=5e-7)
    assert _num(_one(page, sec, "new", what=what)) == pytest.approx(score["int8"], abs=5e-7)
    assert _num(_one(page, sec, "delta", what=what)) == pytest.approx(score["int8"] - before["int8"], abs=2e-6)
    changes = {v["row"]["file"]: v["text"] for v in page["values"] if v["section"] == sec and v["k"] == "file-change"}
    assert changes["model.int8.onnx"] == "changed" and changes["accuracy.json"] == "changed"
    assert changes["model.int8.plan"] == changes["model.int8.plan.json"] == "added"  # B has no engine
    for same in ("model.onnx", "tokenizer/tokenizer.json", "acceptance/inputs.json", "mf_backend/model.py"):
        assert same not in changes
    assert _one(page, sec, "new", what="calibration data digest") != _one(page, sec, "old",
                                                                          what="calibration data digest")
    signer = "signer (as the bundle names it)"
    assert _one(page, sec, "new", what=signer) != _one(page, sec, "old", what=signer)
    # Same export, same tokenizer and limits: the data contract holds, and the page says so.
    assert _one(page, sec, "contract-verdict").startswith("no breaking change")
    assert _one(page, "minilm-v1-inputs", "long-inputs") == "refuse"
