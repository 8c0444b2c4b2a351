"""Shared fixtures: the MiniLM recipe, its ONNX export and a packaged repository (built once per session)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# MiniLM FP32's cost model (a + b·n·L + c·n·L² s per launch of n sequences of L tokens) as measured on a 2-core Xeon
# (queue_bound.measure_engine_cost: 0.0024, 8.4e-5, 4.0e-7): fixed in test packages so that nothing is measured.
MINILM_COST = "0.002,8e-5,4e-7"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

EXAMPLE = Path(__file__).resolve().parents[1] / "model_factory" / "examples" / "minilm.toml"


def has_gpu() -> bool:
    """True when an NVIDIA GPU is visible (GPU tests skip otherwise)."""
    return Path("/dev/nvidia0").exists()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU; run benchmarks/gpu_checks.sh on a GPU machine")
    if not has_gpu():
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def minilm_recipe(tmp_path_factory):
    """The shipped MiniLM recipe, with its repository in a temporary folder (FP32 only)."""
    from model_factory.recipe import load_recipe

    root = tmp_path_factory.mktemp("minilm")
    return load_recipe(EXAMPLE, {"repository.path": str(root / "model_repository"), "precisions": ["fp32"]})


@pytest.fixture(scope="session")
def minilm_export(minilm_recipe):
    """The FP32 ONNX export of MiniLM (about 15 s, once per session)."""
    from model_factory.build_engines.export import export_model

    return export_model(minilm_recipe)


@pytest.fixture(scope="session")
def package_signed(minilm_export):
    """A factory: ``package_signed(recipe, key, artifacts=None, **package_model_kwargs)`` packages the session's
    MiniLM export (or ``artifacts``) as ``recipe`` says and signs it with ``key`` (a ``KeyPaths``) and provenance.

    The cost model is fixed, so Triton loads the model without measuring it: MINILM_COST, about what MiniLM FP32
    measures on 2 cores, so that the queue timeout `serve` derives from it for the default shedding by age
    (twice a full launch of 64 x 128 tokens: about 2 s) is not shorter than a real launch. Returns the model folder.
    """
    def package_signed(recipe, key, artifacts=None, **kwargs) -> Path:
        from model_factory.build.pipeline import provenance_for
        from model_factory.build.repository import package_model
        from model_factory.signing import SignerConfig, sign_model_version

        package_model(recipe, artifacts or {"model.onnx": minilm_export.onnx_path},
                      tokenizer_dir=minilm_export.tokenizer_dir, parameters={"cost_model": MINILM_COST}, **kwargs)
        model_dir = recipe.repository.path / recipe.name
        sign_model_version(model_dir, recipe.version, SignerConfig(private_key=key.private_key, password=None),
                           provenance=provenance_for(recipe, {"source_digest": minilm_export.source_digest},
                                                     accuracy=None))
        return model_dir

    return package_signed


def _other_weights(src: Path, dst: Path) -> Path:
    """A copy of an ONNX model with three of its weight matrices changed (a model built with other weights)."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from model_factory.build_engines import onnx_files

    # Through our loader: onnx's own refuses the export's data file once packaging has hard-linked it.
    model = onnx_files.load_weights(onnx_files.load_graph(src), src.parent)
    rng = np.random.default_rng(1)
    changed = 0
    for init in model.graph.initializer:
        a = numpy_helper.to_array(init)
        if changed < 3 and a.dtype == np.float32 and a.ndim == 2 and min(a.shape) > 1:
            init.CopyFrom(numpy_helper.from_array((a + rng.normal(0, 0.2, a.shape)).astype(np.float32), init.name))
            changed += 1
    onnx.save(model, str(dst))
    return dst


def _clipped_int8(src: Path, dst: Path) -> Path:
    """An INT8 Q/DQ model whose activation ranges are far too narrow: it scores well below any gate."""
    import onnx

    from model_factory.build_engines import onnx_files
    from model_factory.build_engines.quantize import QdqBuilder, _node_names, find_candidates

    model = onnx_files.load_weights(onnx_files.load_graph(src), src.parent)
    _node_names(model)
    candidates, _ = find_candidates(model)
    amax = {a: 0.5 for c in candidates for a in c.activations}
    onnx.save(QdqBuilder(model, candidates, amax).build([c.node for c in candidates]), str(dst))
    return dst


@pytest.fixture(scope="session")
def accept_repo(tmp_path_factory, minilm_recipe, minilm_export, package_signed):
    """A signed repository with acceptance data and three MiniLM models, and a policy trusting two keys.

    ``good``: the FP32 export (key A). ``swapped``: the golden data of ``good`` but a model.onnx with other
    weights, signed with key B, so it verifies. ``int8``: served from an INT8 model with clipped ranges
    (``[repository] serve = "int8"``, every precision kept), signed with key A. Cost models are fixed so Triton loads fast.
    """
    from dataclasses import replace

    from model_factory.build_engines.golden import write_acceptance_data
    from model_factory.signing import generate_keypair

    root = tmp_path_factory.mktemp("accept")
    repo = root / "repo"
    golden = write_acceptance_data(minilm_recipe, minilm_export.onnx_path, minilm_export.tokenizer_dir,
                                   root / "golden")
    key_a, key_b = generate_keypair(root / "key-a"), generate_keypair(root / "key-b")
    fp32 = minilm_export.onnx_path
    models = {
        "good": ({"model.onnx": fp32}, "fp32", key_a),
        "swapped": ({"model.onnx": _other_weights(fp32, root / "other.onnx")}, "fp32", key_b),
        "int8": ({"model.onnx": fp32, "model.int8.onnx": _clipped_int8(fp32, root / "model.int8.onnx")}, "int8",
                 key_a),
    }
    for name, (artifacts, serve, key) in models.items():
        # int8 serves model.int8.onnx and keeps model.onnx beside it (the FP32 graph the layer report compares with).
        recipe = replace(minilm_recipe, name=name, precisions=tuple(sorted({"fp32", serve})),
                         repository=replace(minilm_recipe.repository, path=repo, serve=serve,
                                            keep_all_precisions=True))
        package_signed(recipe, key, artifacts, acceptance_dir=golden)
    policy = root / "policy.toml"  # two trusted keys (write_key_policy names keys by file name: both alike)
    policy.write_text("version = 1\n" + "".join(f'[[keys]]\nname = "{n}"\npath = "{k.public_key}"\n'
                                                for n, k in (("a", key_a), ("b", key_b)))
                      + "[provenance]\nrequired = true\n")
    return repo, policy


# --------------------------------------------------------------------------- generative models (issue 32)


@pytest.fixture(scope="session")
def tiny_llm(tmp_path_factory):
    """A random-weight Llama (hidden 64, 2 layers, 4 heads, 2 KV heads) and its FP32 ONNX from onnxruntime-genai's
    builder: ``(hf_dir, onnx_dir)``; 2048 positions (a stream long enough to cancel midway)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # onnxruntime-genai's builder and onnx-ir come with the `export` extra (issue 31's build side adds them).
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai (extra export) builds the generative graphs")
    pytest.importorskip("onnx_ir", reason="onnx-ir (extra export) is needed by onnxruntime-genai's builder")
    from tests.generative_models import make_causal_lm
    from tests.generative_repository import build_onnx

    root = tmp_path_factory.mktemp("tiny-llm")
    hf = make_causal_lm("llama", root / "hf", max_positions=2048)
    return hf, build_onnx(hf, root / "onnx-fp32", "fp32")


@pytest.fixture(scope="session")
def gemma3_build(request, tmp_path_factory):
    """(recipe, BuildResult) of Gemma 3 270M at FP32 and INT8 (served: INT8), in one session's repository: the suite's
    one build of the real LLM (about 5 minutes on 2 cores), scored by tests/build/test_gemma3.py and served by
    tests/integration/test_gemma3_structured_serving.py. Skips when its packages are not installed."""
    from tests import gemma3_model

    missing = gemma3_model.available()
    if missing:
        pytest.skip(missing)
    pytest.importorskip("onnxruntime_genai")
    from model_factory.build.pipeline import build
    from model_factory.recipe import load_recipe

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider: this session's tmp then
    folder = gemma3_model.fp32_folder(Path(cache.mkdir("gemma3-270m")) if cache is not None
                                      else tmp_path_factory.mktemp("gemma3-270m-cache"))
    root = tmp_path_factory.mktemp("gemma3")
    (root / "heldout.txt").write_text("\n".join(gemma3_model.license_paragraphs("Apache-2.0", 26)) + "\n")
    (root / "calibration.txt").write_text("\n".join(gemma3_model.license_paragraphs("GPL-3", 32)) + "\n")
    recipe = root / "gemma3.toml"
    recipe.write_text(f"""precisions = ["fp32", "int8"]
[model]
name = "gemma3-270m"
task = "text-generation"
[source]
kind = "huggingface"
path = "{folder}"
[shapes]
max_context = 256
[quantization]
calibration_data = "calibration.txt"
heldout_data = "heldout.txt"
[repository]
path = "repo"
serve = "int8"
keep_all_precisions = true
""")
    loaded = load_recipe(recipe)
    return loaded, build(loaded)
