"""Acceptance: golden inputs and FP32 outputs in every signed version, replayed through the engine served here.

The repository (``accept_repo`` in conftest.py) holds a good model, a model whose engine was swapped for
one with other weights (signed by a second trusted key, so it verifies), and an INT8 model below the gate.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from model_factory.serving.acceptance import accept_model, accept_repository, render
from model_factory.build_engines.golden import (ACCEPTANCE_DIR, INPUTS_FILE, OUTPUTS_FILE, REFERENCE_RUNNER,
                                                SPEC_FILE, read_inputs, read_outputs, read_spec)

pytestmark = pytest.mark.slow

FILES = (SPEC_FILE, INPUTS_FILE, OUTPUTS_FILE)


def test_acceptance_data_is_present_signed_and_from_the_heldout_set(accept_repo, minilm_recipe) -> None:
    from transformers import AutoTokenizer

    from model_factory.signing import load_policy, signed_digests, verify_repository

    repo, policy = accept_repo
    assert all(r.ok for r in verify_repository(repo, load_policy(policy)))
    digests = signed_digests(repo / "good", 1, load_policy(policy))
    for name in FILES:
        assert f"1/{ACCEPTANCE_DIR}/{name}" in digests  # covered by the version's signature
    v = repo / "good" / "1" / ACCEPTANCE_DIR
    spec = read_spec((v / SPEC_FILE).read_bytes())
    assert (spec.task, spec.metric, spec.threshold, spec.primary_output) == ("embedding", "cosine", 0.99, "embedding")
    assert spec.outputs == ("last_hidden_state", "embedding") and "heldout.txt" in spec.heldout
    inputs, outputs = read_inputs((v / INPUTS_FILE).read_bytes()), read_outputs((v / OUTPUTS_FILE).read_bytes())
    assert len(inputs) == len(outputs) == spec.iterations and sum(len(i["input_ids"]) for i in inputs) == spec.samples
    assert {i["input_ids"].shape[1] for i in inputs} == {spec.sequence_length}  # one profile covers them all
    # The first samples are the held-out file's first lines, tokenized as the model's tokenizer does.
    heldout = minilm_recipe.quantization.heldout_data.read_text().splitlines()
    calibration = set(minilm_recipe.quantization.calibration_data.read_text().splitlines())
    tok = AutoTokenizer.from_pretrained(str(repo / "good" / "1" / "tokenizer"))
    ids = tok(heldout[0])["input_ids"]
    np.testing.assert_array_equal(inputs[0]["input_ids"][0, :len(ids)], ids)
    assert heldout[0] not in calibration
    assert outputs[0]["embedding"].shape == (len(inputs[0]["input_ids"]), 384)
    meta = json.loads((repo / "good" / "1" / "metadata.json").read_text())
    assert meta["acceptance"] == f"{ACCEPTANCE_DIR}/{SPEC_FILE}"


def test_changed_acceptance_data_fails_verification(accept_repo, tmp_path: Path) -> None:
    from model_factory.signing import load_policy, verify_repository

    repo, policy = accept_repo
    copy = tmp_path / "repo"
    shutil.copytree(repo / "good", copy / "good")
    spec = copy / "good" / "1" / ACCEPTANCE_DIR / SPEC_FILE
    spec.write_text(spec.read_text().replace('"threshold": 0.99', '"threshold": 0.1'))  # loosen the gate
    (result,) = verify_repository(copy, load_policy(policy))
    assert not result.ok and any(f"{ACCEPTANCE_DIR}/{SPEC_FILE}" in r for r in result.reasons)


def test_accept_passes_on_the_good_model_and_reports_engine_and_device(accept_repo) -> None:
    repo, _ = accept_repo
    result = accept_model(repo / "good")
    assert result.passed, result.reason
    assert (result.engine, result.file, result.device) == ("onnxruntime", "model.onnx", "cpu")
    assert result.score > 0.99999 and {o.name for o in result.outputs} == {"embedding", "last_hidden_state"}
    assert all(o.max_abs_error < 1e-3 for o in result.outputs)


def test_accept_fails_on_an_engine_swapped_for_one_that_verifies(accept_repo) -> None:
    repo, _ = accept_repo
    result = accept_model(repo / "swapped")
    assert not result.passed and result.score < 0.9
    assert "below the gate 0.99" in result.reason and result.engine == "onnxruntime"


def test_accept_fails_on_an_int8_engine_below_the_gate_and_names_the_layers(accept_repo) -> None:
    repo, _ = accept_repo
    # Where the CPU has no integer dot products, `auto` would serve the FP32 model packaged beside this INT8 one
    # (it has no 7-bit form): the INT8 graph is then scored with Q/DQ in float, as its gate was.
    from model_factory.backend.engines.cpu_features import integer_dot_product

    result = accept_model(repo / "int8", int8_kernels=None if integer_dot_product() else "simulated")
    assert not result.passed and result.file == "model.int8.onnx" and result.score < 0.99
    # Where the INT8 graph first departs from FP32, by exact tensor name: a quantized MatMul of layer 0.
    assert result.departures and result.departures[0]["op"] == "MatMul"
    assert "layer.0" in result.departures[0]["tensor"] and "first departs from FP32 at" in result.reason


def test_accept_replays_the_int8_kernels_that_will_serve(accept_repo) -> None:
    import os

    from model_factory.backend.engines.cpu_features import INT8_KERNELS_ENV, choose_int8_kernels, integer_dot_product

    repo, _ = accept_repo
    # This CPU's choice; the package keeps model.onnx beside the INT8 model (and has no 7-bit form).
    assert accept_model(repo / "int8", layers=False).int8_kernels == choose_int8_kernels("auto", fp32=True)[0]
    for kernels in ("integer", "simulated"):  # serve --int8-kernels / accept --int8-kernels
        result = accept_model(repo / "int8", int8_kernels=kernels, layers=False)
        if kernels == "integer" and not integer_dot_product():
            # AVX2 only and no 7-bit form in this package: 8-bit weights on integer kernels would compute wrong
            # values here, so the load is refused, and acceptance says why instead of scoring wrong numbers.
            assert not result.passed and result.int8_kernels is None
            assert "refused on this CPU" in result.reason and "no integer dot-product" in result.reason
            continue
        assert result.int8_kernels == kernels and f"int8 {kernels} kernels" in result.where
        assert result.to_dict()["int8_kernels"] == kernels
    assert INT8_KERNELS_ENV not in os.environ  # set for the acceptance run only
    assert accept_model(repo / "good", layers=False).int8_kernels is None


def test_accept_checks_the_bytes_against_verified_digests(accept_repo) -> None:
    from model_factory.signing import load_policy, signed_digests

    repo, policy = accept_repo
    digests = signed_digests(repo / "good", 1, load_policy(policy))
    assert accept_model(repo / "good", digests=digests).passed
    changed = dict(digests) | {"1/model.onnx": "0" * 64}
    result = accept_model(repo / "good", digests=changed)
    assert not result.passed and "changed after verification" in result.reason


def test_accept_command_table_json_and_exit_status(accept_repo) -> None:
    from model_factory.cli.main import main

    repo, _ = accept_repo
    ok = CliRunner().invoke(main, ["accept", str(repo), "--model", "good"])
    assert ok.exit_code == 0, ok.output
    assert "good/1" in ok.output and "onnxruntime (model.onnx)" in ok.output and "cpu" in ok.output
    assert "good: PASS" in ok.output
    bad = CliRunner().invoke(main, ["accept", str(repo), "--json"])
    assert bad.exit_code == 1
    records = {r["model"]: r for r in json.loads(bad.output)}
    assert records["good"]["passed"] and not records["swapped"]["passed"]
    from model_factory.backend.engines.cpu_features import integer_dot_product

    if integer_dot_product():  # the clipped INT8 graph itself, on integer kernels: below the gate
        assert not records["int8"]["passed"]
        assert records["int8"]["file"] == "model.int8.onnx" and records["int8"]["device"] == "cpu"
    else:  # no dot products, no 7-bit form: `auto` serves (and so accepts) the FP32 model packaged beside it
        assert records["int8"]["passed"] and records["int8"]["int8_kernels"] == "fp32"
        assert records["int8"]["file"] == "model.onnx" and records["int8"]["device"] == "cpu"
    missing = CliRunner().invoke(main, ["accept", str(repo), "--model", "nope"])
    assert missing.exit_code == 1 and "Fix:" in missing.output and "Traceback" not in missing.output


def test_a_model_without_acceptance_data_is_not_accepted(minilm_recipe, minilm_export, tmp_path: Path) -> None:
    from dataclasses import replace

    from model_factory.build.repository import package_model

    recipe = replace(minilm_recipe, repository=replace(minilm_recipe.repository, path=tmp_path))
    package_model(recipe, {"model.onnx": minilm_export.onnx_path}, tokenizer_dir=minilm_export.tokenizer_dir)
    (result,) = accept_repository(tmp_path)
    assert not result.passed and "no acceptance data" in result.reason and "heldout_data" in result.reason
    assert "FAIL" in render([result])


def _polygraphy(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("polygraphy")
    return subprocess.run([str(exe), "run", *args], capture_output=True, text=True, timeout=300)


def test_polygraphy_cli_consumes_the_files(accept_repo) -> None:
    """Polygraphy's own ONNX Runtime runner replays the packaged data on the packaged ONNX (the docs' command)."""
    repo, _ = accept_repo
    for model, passes in (("good", True), ("swapped", False)):
        v = repo / model / "1"
        a = v / ACCEPTANCE_DIR
        run = _polygraphy(str(v / "model.onnx"), "--onnxrt", "--load-inputs", str(a / INPUTS_FILE),
                          "--load-outputs", str(a / OUTPUTS_FILE), "--compare", "cosine_similarity",
                          "--cosine-similarity-threshold", "0.99")
        assert (run.returncode == 0) is passes, run.stdout[-3000:] + run.stderr[-2000:]
        log = run.stdout + run.stderr
        # Outputs are paired by their exact names, never by Polygraphy's fuzzy fallback.
        for name in ("embedding", "last_hidden_state"):
            assert f"Comparing Output: '{name}'" in log and f"with '{name}'" in log
        assert REFERENCE_RUNNER in log and "fuzzy" not in log.lower()
        if passes:
            assert "Passed: 4/4 iterations" in log


def test_accept_runs_the_torch_engine_the_backend_would_load(tmp_path: Path, monkeypatch) -> None:
    """A torch source exported with TorchScript, held-out data as .npz, engine=torch on a CPU instance."""
    from tiny_torch_models import encoder_recipe, write_factory

    from model_factory.build_engines.export import export_model
    from model_factory.build_engines.golden import write_acceptance_data
    from model_factory.recipe import parse_recipe
    from model_factory.build.repository import package_model

    module = write_factory(tmp_path, monkeypatch)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "heldout.npz", input_ids=rng.integers(0, 50, (12, 9)), attention_mask=np.ones((12, 9), np.int64))
    data = encoder_recipe(f"{module}:make", torchscript=True) | {
        "quantization": {"heldout_data": "heldout.npz"},
        "repository": {"path": str(tmp_path / "repo"), "engine": "torch", "instance_kind": "cpu"}}
    recipe = parse_recipe(data, tmp_path)
    exported = export_model(recipe)
    golden = write_acceptance_data(recipe, exported.onnx_path, None, tmp_path / "golden")
    package_model(recipe, {"model.onnx": exported.onnx_path, "model.pt2": exported.torchscript_path},
                  acceptance_dir=golden)
    result = accept_model(tmp_path / "repo" / "enc")
    assert result.passed, result.reason
    assert (result.engine, result.file, result.device) == ("torch", "model.pt2", "cpu")
    assert result.samples == 12 and result.score > 0.99999


def test_accept_on_a_machine_where_the_tensorrt_plan_cannot_run_says_why(accept_repo, tmp_path: Path) -> None:
    """engine=tensorrt on a KIND_GPU instance here (no GPU): refused with the loader's reason, not served elsewhere."""
    from google.protobuf import text_format

    from model_factory.build.repository import read_config

    repo, _ = accept_repo
    shutil.copytree(repo / "good", tmp_path / "good")
    (tmp_path / "good" / "1" / "model.fp32.plan").write_bytes(b"a plan for another GPU")
    config = read_config(tmp_path / "good")
    config.parameters["engine"].string_value = "tensorrt"
    config.parameters["plan_file"].string_value = "model.fp32.plan"
    config.instance_group[0].kind = type(config.instance_group[0]).KIND_GPU
    (tmp_path / "good" / "config.pbtxt").write_text(text_format.MessageToString(config))
    result = accept_model(tmp_path / "good")
    assert not result.passed and result.engine is None
    assert result.reason.startswith("the model does not load here (GPU instance): EngineError")


def test_a_missing_polygraphy_names_the_extra(monkeypatch) -> None:
    import sys as _sys

    from model_factory.build_engines.golden import read_inputs
    from model_factory.errors import FactoryError

    monkeypatch.setitem(_sys.modules, "polygraphy", None)
    with pytest.raises(FactoryError, match=r"pip install 'model-factory\[serve\]'"):
        read_inputs(b"[]")


def test_without_a_heldout_file_the_samples_are_the_held_out_split_never_calibration(minilm_recipe, minilm_export,
                                                                                      tmp_path: Path) -> None:
    from dataclasses import replace

    from transformers import AutoTokenizer

    from model_factory.build_engines.calibration import HELDOUT_EVERY
    from model_factory.build_engines.golden import write_acceptance_data

    calib = minilm_recipe.quantization.calibration_data
    recipe = replace(minilm_recipe, quantization=replace(minilm_recipe.quantization, heldout_data=None))
    golden = write_acceptance_data(recipe, minilm_export.onnx_path, minilm_export.tokenizer_dir, tmp_path / "g")
    spec = read_spec((golden / SPEC_FILE).read_bytes())
    lines = [t for t in calib.read_text().splitlines() if t.strip()]
    held = {t for i, t in enumerate(lines) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1}
    assert spec.samples == min(len(held), 32) and "held out" in spec.heldout
    tok = AutoTokenizer.from_pretrained(str(minilm_export.tokenizer_dir))
    ids = np.concatenate([i["input_ids"] for i in read_inputs((golden / INPUTS_FILE).read_bytes())])
    texts = {tok.decode(row, skip_special_tokens=True) for row in ids}
    normalized = {tok.decode(tok(t)["input_ids"], skip_special_tokens=True): t for t in lines}
    assert {normalized[t] for t in texts} <= held  # every sample is a held-out line, none a calibration one
