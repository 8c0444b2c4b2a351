"""Two signed releases of one recipe for the report tests, and a real sweep of one of them.

Both come from the session's MiniLM export (tests/conftest.py) with INT8 served
(Q/DQ, mixed-precision search) and differ only in their calibration data:

* ``a``: the example's ``calibration.txt``, signed with key A, with a TensorRT-RTX INT8 plan;
* ``b``: 100 other sentences (``benchmarks/texts.txt``), signed with key B, no engine.

Each is quantized once (about half a minute on two cores) and packaged as ``build``
does it: accuracy.json beside the models, acceptance data, signed provenance.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "model_factory" / "examples"


@dataclass(frozen=True)
class Release:
    repo: Path
    model_dir: Path
    version_dir: Path
    policy: Path
    keys: object


def _release(root: Path, minilm_export, calibration: Path, key, policy: Path, engine: bool) -> Release:
    from model_factory.build.pipeline import provenance_for
    from model_factory.build.repository import package_model
    from model_factory.build_engines.golden import write_acceptance_data
    from model_factory.build_engines.quantize import quantize_model
    from model_factory.recipe import load_recipe
    from model_factory.signing import SignerConfig, sign_model_version

    recipe = load_recipe(EXAMPLES / "minilm.toml", {
        "repository.path": str(root / "model_repository"), "precisions": ["fp32", "int8"],
        "quantization.calibration_data": str(calibration),
        "quantization.heldout_data": str(EXAMPLES / "heldout.txt"), "quantization.min_accuracy": 0.99,
        "repository.serve": "int8", "repository.keep_all_precisions": True})
    q = quantize_model(recipe, minilm_export, out_dir=root / "quantize")
    artifacts = {"model.onnx": minilm_export.onnx_path, "model.int8.onnx": q.models["int8"]}
    if engine:
        from model_factory.build_engines.tensorrt import build_engine, tensorrt_available

        if tensorrt_available() is not None:
            (root / "engines").mkdir()
            e = build_engine("int8", q.models["int8"], root / "engines" / "model.int8.plan", recipe)
            artifacts.update({e.plan_path.name: e.plan_path, e.metadata_path.name: e.metadata_path})
    build_info = {"source_digest": minilm_export.source_digest,
                  "quantization": {"float_nodes": list(q.float_nodes), "calibration_digest": q.calibration_digest}}
    golden = write_acceptance_data(recipe, minilm_export.onnx_path, minilm_export.tokenizer_dir, root / "golden")
    provenance = provenance_for(recipe, build_info, q.report.to_dict())

    def sign(staged: Path) -> Path:
        return sign_model_version(staged, recipe.version, SignerConfig(private_key=key.private_key),
                                  provenance=provenance)

    package_model(recipe, artifacts, tokenizer_dir=minilm_export.tokenizer_dir, extra_files=[q.report_path],
                  parameters={"cost_model": "0.002,1e-6,1e-9"}, build_info=build_info, acceptance_dir=golden,
                  sign=sign)
    model_dir = recipe.repository.path / recipe.name
    return Release(recipe.repository.path, model_dir, model_dir / str(recipe.version), policy, key)


@pytest.fixture(scope="session")
def report_keys(tmp_path_factory):
    from model_factory.signing import generate_keypair

    root = tmp_path_factory.mktemp("report-keys")
    key_a, key_b = generate_keypair(root / "key-a"), generate_keypair(root / "key-b")
    policy = root / "policy.toml"  # both keys trusted, named key-a and key-b
    policy.write_text("version = 1\n" + "".join(f'[[keys]]\nname = "{n}"\npath = "{k.public_key}"\n'
                                                for n, k in (("key-a", key_a), ("key-b", key_b)))
                      + "[provenance]\nrequired = true\n")
    return key_a, key_b, policy


@pytest.fixture(scope="session")
def release_a(tmp_path_factory, minilm_export, report_keys):
    key_a, _, policy = report_keys
    return _release(tmp_path_factory.mktemp("release-a"), minilm_export, EXAMPLES / "calibration.txt", key_a,
                    policy, engine=True)


@pytest.fixture(scope="session")
def release_b(tmp_path_factory, minilm_export, report_keys):
    _, key_b, policy = report_keys
    root = tmp_path_factory.mktemp("release-b")
    # Sentences of neither the example's calibration nor its held-out set (the held-out set, and with it the
    # acceptance data, stays the same: only the calibration differs).
    taken = set((EXAMPLES / "heldout.txt").read_text().splitlines()) | set(
        (EXAMPLES / "calibration.txt").read_text().splitlines())
    lines = [t for t in (ROOT / "benchmarks" / "texts.txt").read_text().splitlines()
             if t.strip() and t not in taken][:100]
    (root / "calibration-b.txt").write_text("\n".join(lines) + "\n")
    return _release(root, minilm_export, root / "calibration-b.txt", key_b, policy, engine=False)


@pytest.fixture(scope="session")
def sweep_a(release_a, tmp_path_factory) -> Path:
    """A real ``model-factory bench --sweep 1,4`` of release A served by the bundled Triton (JSON and CSV)."""
    from click.testing import CliRunner

    from model_factory.cli.bench import bench
    from model_factory.serving.server import ServerOptions, TritonServer

    out = tmp_path_factory.mktemp("sweep") / "sweep.json"
    server = TritonServer(release_a.repo, options=ServerOptions(0, 0, 0)).start()
    try:
        result = CliRunner().invoke(bench, [
            "--url", server.http_url, "-m", "minilm", "--texts", str(ROOT / "benchmarks" / "texts.txt"),
            "--tokenizer", str(release_a.version_dir / "tokenizer"), "-n", "48", "--warmup", "8", "--sweep", "1,4",
            "--metrics-url", server.metrics_url, "--json", str(out), "--csv", str(out.with_suffix(".csv"))])
    finally:
        server.stop()
    assert result.exit_code == 0, result.output
    assert "groups/win" in result.output and len(out.with_suffix(".csv").read_text().splitlines()) == 3
    return out
