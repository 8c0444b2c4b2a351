"""FP16 and INT8 Q/DQ: graph rules on a tiny model, the search, and MiniLM end to end."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from precision_helpers import EXAMPLES, minilm_precision_recipe, tiny_feeds, write_recipe

from model_factory.build_engines import onnx_files
from model_factory.build_engines.accuracy import AccuracyGateError, AccuracyReport, ort_session
from model_factory.build_engines.export import ExportResult
from model_factory.build_engines.quantize import (
    QdqBuilder,
    calibrate,
    convert_fp16,
    find_candidates,
    quantize_model,
    quantized_models,
    search_mixed_precision,
    search_target,
    toposort,
)
from model_factory.errors import FactoryError
from model_factory.recipe import QuantizationSpec


def _run(model, feeds, out="hidden", extra=None):
    path = Path(feeds["_dir"]) / "m.onnx"
    onnx.save(model, str(path))
    sess = ort_session(path, simulate_qdq=True)
    return sess.run([out], {k: v for k, v in feeds.items() if k != "_dir"} | (extra or {}))[0]


@pytest.fixture()
def feeds(tmp_path):
    return tiny_feeds() | {"_dir": str(tmp_path)}


# --------------------------------------------------------------------------- graph rules (tiny model)


def test_candidates_skip_the_mask_path(tiny):
    cands, skipped = find_candidates(tiny)
    by_name = {c.node: c for c in cands}
    assert set(by_name) == {"proj_in", "scores", "context", "head"}
    assert skipped == {"mask_proj": "reads the mask path"}
    assert by_name["proj_in"].weight == "w_in" and by_name["proj_in"].weight_axis == 1
    assert by_name["head"].weight == "w_head" and by_name["head"].weight_axis == 0  # Gemm transB=1: rows
    assert by_name["scores"].weight is None and set(by_name["scores"].activations) == {"h_act", "h_t"}


def test_calibration_methods(tiny, feeds, tmp_path):
    cands, _ = find_candidates(tiny)
    tensors = [a for c in cands for a in c.activations]
    data = {k: v for k, v in feeds.items() if k != "_dir"}
    ranges = {m: calibrate(tiny, tensors, data, m, tmp_path) for m in ("minmax", "percentile", "entropy")}
    assert float(np.abs(data["x"]).max()) == pytest.approx(ranges["minmax"]["x"])
    for t in set(tensors):
        assert 0 < ranges["percentile"][t] <= ranges["minmax"][t]
        assert 0 < ranges["entropy"][t] <= ranges["minmax"][t]
    with pytest.raises(FactoryError, match="unknown calibration method"):
        calibrate(tiny, tensors, data, "mse", tmp_path)


def test_qdq_only_on_quantized_inputs_symmetric_per_channel(tiny, feeds, tmp_path):
    cands, _ = find_candidates(tiny)
    data = {k: v for k, v in feeds.items() if k != "_dir"}
    amax = calibrate(tiny, [a for c in cands for a in c.activations], data, "minmax", tmp_path)
    q = QdqBuilder(tiny, cands, amax).build([c.node for c in cands])
    onnx.checker.check_model(q)
    inits = {i.name: i for i in q.graph.initializer}
    readers = {}
    for n in q.graph.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    dqs = [n for n in q.graph.node if n.op_type == "DequantizeLinear"]
    assert dqs
    for dq in dqs:  # every dequantized tensor feeds only MatMul/Gemm
        assert {r.op_type for r in readers[dq.output[0]]} <= {"MatMul", "Gemm"}
        zp = onnx.numpy_helper.to_array(inits[dq.input[2]])
        assert zp.dtype == np.int8 and not zp.any()  # symmetric
    for n in q.graph.node:  # nothing on the mask path, and the residual Add still reads float tensors
        if n.op_type == "QuantizeLinear":
            assert not n.input[0].startswith("mask")
    assert [n for n in q.graph.node if n.name == "mask_proj"][0].input[0] == "mask_f3"
    w = onnx.numpy_helper.to_array(inits["w_in_int8"])
    scale = onnx.numpy_helper.to_array(inits["w_in_int8_scale"])
    assert w.dtype == np.int8 and scale.shape == (16,) and np.abs(w).max() == 127  # per output channel
    assert "w_in" not in inits  # the float weight is gone
    ref, got = _run(tiny, feeds), _run(q, feeds)
    cos = np.sum(ref * got) / np.linalg.norm(ref) / np.linalg.norm(got)
    assert cos > 0.99


def test_switchable_model_matches_the_clean_variants(tiny, feeds, tmp_path):
    cands, _ = find_candidates(tiny)
    data = {k: v for k, v in feeds.items() if k != "_dir"}
    builder = QdqBuilder(tiny, cands, calibrate(tiny, [a for c in cands for a in c.activations], data, "minmax",
                                                tmp_path))
    switchable, switches = builder.build_switchable()
    assert set(switches) == {c.node for c in cands}
    for subset in ({"proj_in"}, {"scores", "head"}, {c.node for c in cands}, set()):
        flags = {sw: np.array(node in subset) for node, sw in switches.items()}
        got = _run(switchable, feeds, "logits", flags)
        want = _run(builder.build(subset), feeds, "logits")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_int8_is_scored_as_tensorrt_computes_it(tiny, feeds, tmp_path):
    """Scores use fake-quantized float arithmetic (TensorRT's int8 GEMM result), not ORT's int8 CPU kernels,
    which saturate 16-bit sums on AVX2 machines without VNNI."""
    cands, _ = find_candidates(tiny)
    data = {k: v for k, v in feeds.items() if k != "_dir"}
    amax = calibrate(tiny, [a for c in cands for a in c.activations], data, "minmax", tmp_path)
    q = QdqBuilder(tiny, cands, amax).build(["head"])
    got = _run(q, feeds, "logits")
    # The same arithmetic in numpy: logits = fq(pooled) @ fq(w_head).T, per-tensor / per-row scales.
    float_path = tmp_path / "float.onnx"
    float_path.write_bytes(onnx_files.with_outputs(tiny, ["pooled"], float32=True).SerializeToString())
    pooled = ort_session(float_path).run(["pooled"], data)[0]
    s_act = amax["pooled"] / 127
    pooled_fq = np.clip(np.round(pooled / s_act), -128, 127) * s_act
    w = onnx.numpy_helper.to_array({i.name: i for i in tiny.graph.initializer}["w_head"])
    s_w = np.abs(w).max(axis=1, keepdims=True) / 127
    w_fq = np.clip(np.round(w / s_w), -127, 127) * s_w
    np.testing.assert_allclose(got, pooled_fq @ w_fq.T, rtol=1e-4, atol=1e-4)


def test_search_keeps_the_most_harmful_nodes_and_gives_back_the_rest():
    harm = {"a": 0.001, "b": 0.02, "c": 0.004, "d": 0.015, "e": 0.0005}

    def score(int8_nodes):
        return 1.0 - sum(harm[n] for n in int8_nodes)

    calls = []
    kept, steps = search_mixed_precision(list(harm), lambda s: calls.append(1) or score(s), target=0.99)
    # b (0.02) in float: 1 - 0.0205 < 0.99; b and d in float: 1 - 0.0055 >= 0.99. Neither can go back.
    assert kept == ["b", "d"]
    assert steps[0]["step"] == "all int8" and steps[1]["step"] == "sensitivity"
    assert [s["node"] for s in steps if s["step"] == "keep in float"] == ["b", "d"]
    assert score([n for n in harm if n not in kept]) >= 0.99


def test_search_give_back_pass_returns_unneeded_nodes():
    # Scores of each INT8 set; y's harm is partly the same harm as x's, so once w is float y can go back.
    table = {"xyw": 0.95, "yw": 0.975, "xw": 0.97, "xy": 0.96, "w": 0.985, "y": 0.992, "x": 0.98, "": 1.0}

    def score(int8_nodes):
        return table["".join(n for n in "xyw" if n in set(int8_nodes))]

    kept, steps = search_mixed_precision(["x", "y", "w"], score, target=0.99)
    assert [s["node"] for s in steps if s["step"] == "keep in float"] == ["x", "y", "w"]
    assert [s["node"] for s in steps if s["step"] == "back to int8"] == ["y"]
    assert kept == ["x", "w"]


def test_search_stops_at_once_when_all_int8_meets_target():
    kept, steps = search_mixed_precision(["a", "b"], lambda s: 0.999, target=0.99)
    assert kept == [] and len(steps) == 1


def test_search_target_aims_above_the_gate():
    assert search_target(0.99) == pytest.approx(0.992)
    assert search_target(1.0) == 1.0


def test_toposort_fixes_appended_nodes(tiny):
    nodes = list(tiny.graph.node)
    del tiny.graph.node[:]
    tiny.graph.node.extend(nodes[4:] + nodes[:4])  # readers before producers
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(tiny)
    toposort(tiny.graph)
    onnx.checker.check_model(tiny)


def test_fp16_keeps_io_types_and_sensitive_ops_in_float(tiny, feeds):
    m16 = convert_fp16(tiny)
    onnx.checker.check_model(m16)
    assert [i.type.tensor_type.elem_type for i in m16.graph.input] == [1, 7]  # float, int64 kept
    assert all(o.type.tensor_type.elem_type == 1 for o in m16.graph.output)
    assert onnx.numpy_helper.to_array({i.name: i for i in m16.graph.initializer}["w_in"]).dtype == np.float16
    np.testing.assert_allclose(_run(m16, feeds), _run(tiny, feeds), rtol=2e-2, atol=2e-2)


# --------------------------------------------------------------------------- MiniLM end to end


def test_minilm_fp16_and_int8_meet_the_gate(quantized, precision_recipe):
    report = quantized.report
    fp16, int8 = report.result("fp16"), report.result("int8")
    assert fp16.metric == "cosine" and fp16.score >= 0.999 and fp16.min_cosine >= 0.999
    assert int8.score >= 0.99, report.render()
    assert report.passed and report.min_accuracy == 0.99
    assert report.heldout_samples == 40 and report.calibration_samples == 100 and report.overlap == 0
    # Mixed precision: some MatMuls stay float, as few as the target allows, and they are listed.
    assert 0 < len(quantized.float_nodes) <= 6, quantized.float_nodes
    assert int8.float_nodes == quantized.float_nodes
    assert int8.candidates == 48 and int8.int8_nodes == 48 - len(quantized.float_nodes)
    assert all(n.endswith("MatMul") for n in quantized.float_nodes)
    steps = [s["step"] for s in report.search]
    assert steps[:3] == ["search", "all int8", "sensitivity"] and "keep in float" in steps


def test_minilm_artifacts(quantized, precision_recipe, minilm_export):
    out = precision_recipe.work_dir / "quantize"
    assert quantized.models == {"fp32": minilm_export.onnx_path, "fp16": out / "model.fp16.onnx",
                                "int8": out / "model.int8.onnx"}
    assert quantized.report_path == out / "accuracy.json"
    on_disk = json.loads(quantized.report_path.read_text())
    assert on_disk["passed"] is True and on_disk["results"][1]["float_nodes"] == list(quantized.float_nodes)
    assert quantized.calibration_digest == hashlib.sha256((EXAMPLES / "calibration.txt").read_bytes()).hexdigest()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary files left behind
    int8 = onnx.load(str(quantized.models["int8"]))
    kept = {n.name: n for n in int8.graph.node if n.name in quantized.float_nodes}
    assert len(kept) == len(quantized.float_nodes)
    assert not any("DequantizeLinear" in x for n in kept.values() for x in n.input)  # really float
    for n in int8.graph.node:  # never on the mask
        if n.op_type == "QuantizeLinear":
            assert "mask" not in n.input[0].lower()
    assert sum(n.op_type == "QuantizeLinear" for n in int8.graph.node) > 0
    # The 7-bit weight form (integer kernels on CPUs without VNNI/AMX): scored, kept when it passes the gate.
    seven = json.loads((out / "quantize.json").read_text())["int8_7bit"]
    assert seven["metric"] == "cosine" and 0.9 < seven["score"] <= 1.0 and seven["weights_changed"] > 0
    assert seven["passed"] == (seven["score"] >= on_disk["min_accuracy"])
    assert (out / "model.int8.w7.onnx").is_file() == seven["passed"]


def test_quantized_models_reads_the_work_dir(quantized, precision_recipe, minilm_export, tmp_path):
    # The stand-alone build-engine command finds the models the earlier stages left in the work dir.
    export_dir = precision_recipe.work_dir / "export"
    export_dir.mkdir(exist_ok=True)
    link = export_dir / "model.onnx"
    if not link.exists():
        link.symlink_to(minilm_export.onnx_path)
    models = quantized_models(precision_recipe)
    assert set(models) == {"fp32", "fp16", "int8"} and models["int8"] == quantized.models["int8"]


def test_failed_gate_writes_the_report_then_raises(minilm_export, tmp_path):
    recipe = minilm_precision_recipe(tmp_path, **{
        "precisions": ["fp32", "int8"], "quantization.mixed_precision": False,
        "quantization.max_calibration_samples": 16, "quantization.max_heldout_samples": 8})
    with pytest.raises(AccuracyGateError) as exc:
        quantize_model(recipe, minilm_export, min_accuracy=0.9999)
    path = recipe.work_dir / "quantize" / "accuracy.json"
    assert exc.value.report_path == path and path.is_file()
    report = AccuracyReport.read(path)
    assert not report.passed and report.min_accuracy == 0.9999
    assert report.result("int8").score < 0.9999 and report.result("int8").float_nodes == ()
    msg = str(exc.value)
    assert "accuracy gate failed: int8" in msg and "FAIL" in msg and "Accuracy of minilm vs FP32" in msg
    # The report names where the INT8 graph first departs from FP32, per layer, by exact tensor name.
    assert "int8 first departs from FP32 at" in msg and "(MatMul) -> /model/encoder/layer." in msg
    departures = json.loads((recipe.work_dir / "quantize" / "departures.json").read_text())["int8"]
    assert departures and departures[0]["op"] == "MatMul" and departures[0]["cosine"] < 0.9999
    assert [d["position"] for d in departures] == sorted(d["position"] for d in departures)
    (recipe.work_dir / "export").mkdir()
    (recipe.work_dir / "export" / "model.onnx").symlink_to(minilm_export.onnx_path)
    with pytest.raises(FactoryError, match="the int8 model failed the accuracy gate"):
        quantized_models(recipe)  # build-engine refuses the failed model


def test_missing_calibration_data_is_a_clear_error(minilm_export, tmp_path):
    calib = tmp_path / "calib.txt"
    calib.write_text("one sentence\n")
    recipe = minilm_precision_recipe(tmp_path, **{"quantization.calibration_data": str(calib)})
    calib.unlink()  # it vanished after the recipe was read
    with pytest.raises(FactoryError, match="calibration_data: .*calib.txt does not exist"):
        quantize_model(recipe, minilm_export)
    fp16_only = minilm_precision_recipe(tmp_path, precisions=["fp32", "fp16"])
    fp16_only = dataclasses.replace(fp16_only, quantization=QuantizationSpec())  # no data at all
    with pytest.raises(FactoryError, match="needs real data"):
        quantize_model(fp16_only, minilm_export)
    assert not (tmp_path / "build").exists() or not any((tmp_path / "build").rglob("accuracy.json"))


def test_broken_onnx_is_a_clear_error(minilm_export, tmp_path):
    broken = tmp_path / "model.onnx"
    broken.write_bytes(b"\x08\x07garbage, not a protobuf" * 10)
    fake = ExportResult(broken, 0.0, 1e-3, minilm_export.tokenizer_dir, "x", 17,
                        minilm_export.input_names, minilm_export.output_names)
    recipe = minilm_precision_recipe(tmp_path, precisions=["fp32", "fp16"])
    with pytest.raises(FactoryError, match="is not a valid ONNX model"):
        quantize_model(recipe, fake)


# --------------------------------------------------------------------------- the command


def test_quantize_command(minilm_export, tmp_path):
    from click.testing import CliRunner

    from model_factory.cli.precision import COMMANDS, quantize

    assert [c.name for c in COMMANDS] == ["quantize", "build-engine"]
    recipe = write_recipe(tmp_path, ["fp32", "fp16"], minilm_export.onnx_path.parent)
    res = CliRunner().invoke(quantize, [str(recipe), "-r", str(tmp_path / "model_repository")])
    assert res.exit_code == 0, res.output
    assert "fp16" in res.output and "report:" in res.output
    report = AccuracyReport.read(tmp_path / "build" / "minilm" / "quantize" / "accuracy.json")
    assert report.passed and report.result("fp16").score >= 0.999


def test_quantize_command_errors_are_clean(tmp_path):
    from click.testing import CliRunner

    from model_factory.cli.precision import quantize

    recipe = write_recipe(tmp_path, ["fp32", "fp16"])  # no export yet
    res = CliRunner().invoke(quantize, [str(recipe)])
    assert res.exit_code == 1
    assert "Error:" in res.output and "run model-factory export on the recipe first" in res.output
    assert "Traceback" not in res.output
    assert "Example" in quantize.get_help(quantize.make_context("quantize", [str(recipe)]))


def test_reranker_data_must_be_pairs_and_pairs_only_for_rerankers(tmp_path) -> None:
    from model_factory.build_engines.calibration import read_samples, DataSplit
    from model_factory.build_engines.quantize import check_task_data

    texts = tmp_path / "t.txt"
    texts.write_text("one text\nanother\n")
    pairs = tmp_path / "p.jsonl"
    pairs.write_text('{"query": "q", "passage": "p"}\n')
    text_split = DataSplit(read_samples(texts), read_samples(texts), "n")
    pair_split = DataSplit(None, read_samples(pairs), "n")
    with pytest.raises(FactoryError, match=r"calibration_data: a reranker scores \(query, passage\) pairs.*Fix:"):
        check_task_data("reranker", text_split)
    with pytest.raises(FactoryError, match="only a reranker reads.*Fix:"):
        check_task_data("classification", pair_split)
    check_task_data("reranker", pair_split)
    check_task_data("embedding", text_split)
